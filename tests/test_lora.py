"""LoRA / QLoRA students through PEFT (`student.lora`, `kava_ray/core/lora.py`): B starts at zero, so a LoRA student's
first step is the full student's at the same seed, and only its adapters (and the projectors) train; a checkpoint holds
the adapter and resumes exactly; final/ holds the merged model (the LoRA student's own logits, as a plain Hugging Face
directory `kava-ray generate` loads) and the adapter; QLoRA trains adapters over an NF4 base on this CPU; through Ray
Train under DDP and FSDP2 (two workers) a LoRA run resumes exactly from its checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from jobs import assert_same_curve, run_recipe, train_steps, write_job
from kava_ray.common.config import load_config
from kava_ray.core.models import load_model
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans

LORA = ["student.lora.r=4", "student.lora.alpha=8", "student.lora.target_modules=all-linear"]


@pytest.fixture(scope="module")
def ljob(tmp_path_factory, tiny_qwen2_dir, tiny_student_dir):
    return write_job(tmp_path_factory.mktemp("lora"), tiny_qwen2_dir, None, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"}],
                     data={"num_train": 32, "num_val": 4, "num_test": 4},
                     train={"steps": 4, "save_steps": 2, "eval_steps": 100, "batch_size": 2},
                     loss={"logit_weight": 0.5, "logit_top_k": 8},
                     align={"projector": {"dropout": 0.0, "kind": "identity"}},
                     optim={"lr_student": 1e-2, "lr_projector": 3e-3, "warmup_steps": 0})


@pytest.fixture(scope="module")
def qwen(ljob):
    cfg = load_config(ljob)
    models = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    return models, in_process_plans(cfg, models)


def _named(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_lora_student_starts_on_the_full_students_curve_and_trains_only_its_adapters(ljob, qwen, tmp_path):
    models, plans = qwen
    full, _, _ = run_recipe(load_config(ljob), plans, InProcessSource(models), 2)
    cfg = load_config(ljob, LORA)
    lora, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), 1)
    assert lora[1]["loss"] == pytest.approx(full[1]["loss"], rel=1e-6)  # B = 0: the base's forward
    student = recipe.distiller.student
    before = _named(student)
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable), trainable
    recipe.step(2, recipe.data(InProcessSource(models), until=2).next_step(2))
    after = _named(student)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)  # the base is frozen
    assert all(not torch.equal(before[n], after[n]) for n in trainable if ".lora_B." in n)
    n_adapter = sum(p.numel() for n, p in student.named_parameters() if n in trainable)
    assert n_adapter < 0.2 * sum(p.numel() for p in student.parameters())


def test_a_checkpoint_holds_the_adapter_and_resumes_exactly_and_final_is_the_merged_model(ljob, qwen, tmp_path):
    from kava_ray.cli import main
    from kava_ray.core.lora import ADAPTER_WEIGHTS

    models, plans = qwen
    cfg = load_config(ljob, LORA)
    full, recipe, data = run_recipe(cfg, plans, InProcessSource(models), 4, tmp_path / "ck", save_at=2)
    saved = sorted(p.name for p in (tmp_path / "ck" / "student").iterdir())
    assert ADAPTER_WEIGHTS in saved and "adapter_config.json" in saved and "model.safetensors" not in saved, saved
    assert main(["generate", str(tmp_path / "ck"), "--prompt", "Sorted:", "--max-new-tokens", "4"]) == 0  # base + it
    resumed, again, _ = run_recipe(cfg, plans, InProcessSource(models), 4, resume=str(tmp_path / "ck"))
    assert again.start_step == 2
    assert_same_curve(resumed, full, resumed, keys=("loss", "ce", "kv_loss", "logit_kl", "grad_norm"), tol=1e-6)

    recipe.save(tmp_path / "final", 4, data.state_dict(), with_optimizer=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "student")
    assert not any(".lora_" in n or "base_layer" in n for n in merged.state_dict())
    ids = torch.randint(0, merged.config.vocab_size, (2, 12))
    student = recipe.distiller.student.eval()
    with torch.no_grad():
        want = student(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)
        adapter = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "adapter")  # base + adapter (PEFT)
        assert torch.allclose(adapter(input_ids=ids).logits, want, atol=1e-5)
    assert main(["generate", str(tmp_path / "final"), "--prompt", "Sorted:", "--max-new-tokens", "4"]) == 0


def test_qlora_trains_adapters_over_a_4bit_base_and_merges_into_the_dense_base(ljob, qwen, tmp_path):
    """QLoRA (`quantize_base: 4bit`, bitsandbytes NF4 on this CPU): the base's Linears are 4-bit, the loss is finite
    and falls on the step's batch, the merged final/ model is the dense base plus scale x B @ A."""
    import bitsandbytes as bnb

    from kava_ray.core.lora import merged_model, scalings

    models, plans = qwen
    cfg = load_config(ljob, LORA + ["student.lora.quantize_base=4bit"])
    curve, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), 2)
    student = recipe.distiller.student
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in student.modules())
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in curve.values())
    merged = merged_model(student).state_dict()
    dense = load_model(cfg.student.model, dtype="float32").state_dict()
    name = "model.layers.0.mlp.down_proj"
    a, b = (student.get_submodule(f"{name}.lora_{x}.default").weight.float() for x in "AB")
    assert torch.allclose(merged[f"{name}.weight"], dense[f"{name}.weight"] + scalings(student)[name][0] * (b @ a),
                          atol=1e-6)
    assert torch.equal(merged["model.embed_tokens.weight"], dense["model.embed_tokens.weight"])


def test_lora_config_mistakes_are_one_line(ljob):
    from kava_ray.common.errors import KavaError

    for extra, line in ((["student.keep_layers=[0]"], "config key 'student.lora': its adapters train on the student "
                                                      "as it loads, and student.keep_layers builds a smaller model"),
                        (["student.lora.quantize_base=4bit", "ray.num_workers=2", "ray.strategy=fsdp"],
                         "config key 'student.lora.quantize_base': 4bit (QLoRA) keeps the base in bitsandbytes' "
                         "4-bit weights, which FSDP2 does not shard"),
                        (["student.lora.quantize_base=4bit", "onpolicy.fraction=1", "onpolicy.engine=vllm"],
                         "config key 'student.lora.quantize_base': 4bit (QLoRA): the vLLM sampler takes the merged "
                         "weights"),
                        (["student.lora.r=0"], "config key 'student.lora.r': Input should be greater than or "
                                               "equal to 1")):
        with pytest.raises(KavaError) as err:
            load_config(ljob, LORA + extra)
        assert str(err.value).startswith(line) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ray_train_trains_a_lora_student_on_two_workers_resumes_exactly_and_generates(tiny_pool, ljob, strategy):
    """Two Ray Train workers (DDP: the adapters' gradients all-reduced; FSDP2: base and adapters sharded, the frozen
    base sharded too): from the step-2 checkpoint steps 3-4 are the uninterrupted curve; final/ holds the merged
    student, whose logits are the base + adapter's (PEFT's load of final/adapter); `kava-ray generate RUN` runs on
    it."""
    from pathlib import Path

    from kava_ray.cli import main
    from kava_ray.core.checkpoint import find_checkpoint
    from kava_ray.recipes.train import run_training

    cfg = load_config(ljob, LORA + ["ray.num_workers=2", f"ray.strategy={strategy}"])
    run = Path(run_training(cfg, name=f"lora-{strategy}", progress=False)["run_dir"])
    curve = train_steps(run)
    step2 = next(c for c in run.glob("checkpoint_2*") if '"step": 2' in (c / "state.json").read_text())
    assert find_checkpoint(run, for_resume=True) != step2
    resumed = train_steps(run_training(cfg, name=f"lora-{strategy}-resumed", resume=str(step2),
                                       progress=False)["run_dir"])
    assert sorted(resumed) == [3, 4] and curve[4]["loss"] != curve[1]["loss"]
    assert_same_curve(resumed, curve, (3, 4), keys=("loss", "ce", "kv_loss", "logit_kl"), tol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(run / "final" / "student")
    adapter = AutoModelForCausalLM.from_pretrained(run / "final" / "adapter")  # the base + the adapter (PEFT)
    assert not any(".lora_" in n for n in merged.state_dict())
    ids = torch.randint(0, merged.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapter(input_ids=ids).logits, atol=1e-5)
    assert main(["generate", str(run), "--prompt", "Sorted:", "--max-new-tokens", "4"]) == 0


def test_a_gpt2_students_conv1d_adapters_merge_transposed_and_an_embeddings_are_one_line():
    """GPT-2 stores its attention and MLP weights transposed (Conv1D: PEFT's fan_in_fan_out): the merged model's logits
    are the LoRA model's; an adapter on the embedding is refused in one line (only Linear adapters are folded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from kava_ray.common.config import LoraSpec
    from kava_ray.common.errors import KavaError
    from kava_ray.core.lora import add_lora, merged_model

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).eval()
    lora = add_lora(model, LoraSpec(r=4, target_modules=["c_attn", "c_proj", "c_fc"])).eval()
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.2)
        ids = torch.randint(0, 64, (2, 12))
        assert torch.allclose(merged_model(lora)(input_ids=ids).logits, lora(input_ids=ids).logits, atol=1e-5)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(KavaError, match=r"^student.lora.target_modules: transformer.wte is not a Linear layer"):
        add_lora(gpt2, LoraSpec(r=4, target_modules=["wte"]))
