"""LoRA / QLoRA students through PEFT (`student.lora`).

The adapters are injected in place with transformers' PEFT integration (`model.add_adapter`, which
freezes the base), so the student stays its Hugging Face class: the KV capture, the chunked
vocabulary loss and FSDP2 see the same modules, each targeted Linear now
`peft.tuners.lora.Linear` (base + B @ A x scaling). The defaults are TRL's `--use_peft`
(`trl.ModelConfig`: r 16, alpha 32, dropout 0.05, PEFT's target modules for the architecture);
B starts at zero, so a LoRA student's first forward is its base model's. QLoRA
(`quantize_base: 4bit`): the frozen base in bitsandbytes NF4 with double quantisation (the QLoRA
paper's), the adapters in the master weights' dtype.

Files: a checkpoint's `student/` holds the adapter (`adapter_model.safetensors`,
`adapter_config.json`, whose base is `student.model`) beside the tokenizer; the run's
`final/student` is the merged model (base + B @ A x scaling in every targeted Linear: a plain
Hugging Face directory that `kava-ray generate`, lm-eval and vLLM load) and `final/adapter` the
adapter alone. `merged` streams the merged weights by name (no second model), which is also
what a vLLM sampler is pushed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
NAME = "default"  # the adapter's name (PEFT's default)


def lora_config(spec):
    """PEFT's `LoraConfig` of a `student.lora` section."""
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=spec.target_modules,
                      task_type="CAUSAL_LM")


def add_lora(model: torch.nn.Module, spec) -> torch.nn.Module:
    """Inject the adapters into `model` in place (the base frozen, only A and B trainable); one line
    where a target is not a layer whose adapters `merged` can fold (`scalings`)."""
    model.add_adapter(lora_config(spec), adapter_name=NAME)
    scalings(model)
    return model


def has_lora(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def is_adapter_dir(path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def scalings(model: torch.nn.Module) -> dict[str, tuple[float, bool]]:
    """{module name: (its B @ A factor, alpha / r; whether its weight is stored transposed,
    PEFT's `fan_in_fan_out`: GPT-2's Conv1D)} of every LoRA layer of `model`. An adapter on
    anything else (an embedding's) is one line: `merged` folds those of Linear layers only."""
    from peft.tuners.lora import LoraLayer

    from kava_ray.common.errors import KavaError

    out = {}
    for n, m in model.named_modules():
        if isinstance(m, LoraLayer):
            if NAME not in m.lora_A:
                raise KavaError(f"student.lora.target_modules: {n} is not a Linear layer ({type(m).__name__}); "
                                f"kava-ray folds the adapters of Linear layers only: target those")
            out[n] = (float(m.scaling[NAME]), bool(getattr(m, "fan_in_fan_out", False)))
    return out


def adapter_state(state: dict) -> dict:
    """The adapter's tensors of a LoRA student's state dict (its own or one gathered from FSDP2
    shards), under PEFT's file names (`...q_proj.lora_A.weight`)."""
    return {n.replace(f".{NAME}.", "."): t.detach().contiguous() for n, t in state.items() if ".lora_" in n}


def save_adapter(path, model: torch.nn.Module, state: Optional[dict] = None) -> None:
    """`path`/adapter_model.safetensors and adapter_config.json (what `PeftModel.from_pretrained`
    and transformers' `from_pretrained` read: the base, then the adapter; no config.json beside them,
    which would make it a model directory). state: the student's whole state dict where the model
    holds shards."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model.state_dict() if state is None else state), path / ADAPTER_WEIGHTS,
              metadata={"format": "pt"})
    model.peft_config[NAME].save_pretrained(str(path))


def load_adapter(model: torch.nn.Module, path) -> None:
    """The adapter saved in `path` (`save_adapter`) into `model`'s LoRA weights, every one of them."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from kava_ray.common.errors import KavaError

    saved = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    result = set_peft_model_state_dict(model, saved, adapter_name=NAME)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise KavaError(f"{path}: its adapter does not match student.lora ({len(missing)} LoRA weights missing, "
                        f"{len(result.unexpected_keys)} unexpected); resume with the run's student.lora")


def merged(named: Iterable[tuple[str, torch.Tensor]],
           scale: dict[str, tuple[float, bool]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA student's (name, tensor) pairs, in state-dict order, as its merged model's: each
    targeted Linear's `base_layer.weight` + scale x B @ A (transposed where the layer stores its
    weight so: `scalings`; PEFT's `get_delta_weight`), computed in fp32 and returned in the base's
    dtype, under the plain name; its bias renamed, A and B dropped; everything else as it comes.
    Lazy: a module's three tensors are held only until its last arrives (a gathered student's
    are gathered one at a time)."""
    held: dict[str, dict] = {}
    for n, t in named:
        if ".base_layer." in n:
            module, part = n.split(".base_layer.")
            if part != "weight":
                yield f"{module}.{part}", t
                continue
            key = "W"
        elif ".lora_A." in n or ".lora_B." in n:
            module, key = n.split(".lora_")[0], n.split(".lora_")[1][0]
        else:
            yield n, t
            continue
        h = held.setdefault(module, {})
        h[key] = t
        if len(h) == 3:
            factor, transposed = scale[module]
            delta = h["B"].float() @ h["A"].float()
            w = h["W"].float() + factor * (delta.T if transposed else delta)
            yield f"{module}.weight", w.to(h["W"].dtype)
            del held[module]


def merged_model(model: torch.nn.Module, state: Optional[dict] = None) -> torch.nn.Module:
    """A plain model of `model`'s class (no adapters) holding its merged weights, on the CPU in the
    dtype of its unquantised weights. state: its whole state dict where `model` holds shards. A
    QLoRA student's base is loaded again in that dtype (4-bit weights have no dense values to merge
    into), as PEFT's docs merge a QLoRA adapter."""
    from peft import set_peft_model_state_dict

    from kava_ray.core.models import load_model, load_named, plain_config, whole_copy

    dtype = model.get_input_embeddings().weight.dtype
    state = model.state_dict() if state is None else state
    if getattr(model.config, "quantization_config", None) is not None:
        dense = load_model(model.peft_config[NAME].base_model_name_or_path, dtype=dtype)
        dense.add_adapter(model.peft_config[NAME], adapter_name=NAME)
        set_peft_model_state_dict(dense, adapter_state(state), adapter_name=NAME)
        model, state = dense, dense.state_dict()
    copy = whole_copy(model, dtype, "cpu", plain_config(model))
    load_named(copy, merged(((n, t.cpu()) for n, t in state.items()), scalings(model)))
    return copy


def save_final(path, model: torch.nn.Module, state: Optional[dict] = None) -> None:
    """A LoRA run's final student: `path`/student the merged model (a plain Hugging Face directory)
    and `path`/adapter the adapter alone."""
    merged_model(model, state).save_pretrained(Path(path) / "student", safe_serialization=True)
    save_adapter(Path(path) / "adapter", model, state)
