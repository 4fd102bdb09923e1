"""The student's precision policy (kava_ray/core/precision.py): the GPU policy run on a CPU keeps small AdamW
updates that pure bf16 rounds away; float16 and contradictory dtype/precision pairs are refused in one line."""

import copy
import io
from types import SimpleNamespace

import pytest
import torch

from kava_ray.common.config import load_config
from kava_ray.common.errors import KavaError
from kava_ray.core.distiller import build_optimizer
from kava_ray.core.models import load_student
from kava_ray.core.precision import resolve_precision, student_precision
from kava_ray.testing.inprocess_source import InProcessSource
from kava_ray.testing.tiny import build_tiny_model, build_tokenizer

LR, STEPS = 3e-5, 10


@pytest.fixture(scope="module")
def student_fp32(tmp_path_factory):
    """A tiny llama student (fp32), weights re-initialised ~N(0, 0.02) like a real LM's."""
    path = build_tiny_model(tmp_path_factory.mktemp("prec") / "student", family="llama", num_layers=2,
                            hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256, seed=3)
    model = load_student(path, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def _as_distiller(model):
    """What `build_optimizer` reads of a Distiller: the student, projectors and fusion (none here)."""
    return SimpleNamespace(student=model, projectors=torch.nn.ModuleList(), fusion=torch.nn.ModuleList())


def _batch():
    """[4, 65]: every one of the 260 token ids once, so every embedding row gets a gradient."""
    return torch.randperm(260, generator=torch.Generator().manual_seed(1)).view(4, 65)


def _changed_after_steps(model, opt, autocast) -> float:
    """The fraction of the student's weights whose stored value differs after STEPS AdamW steps."""
    before = [p.detach().clone() for p in model.parameters()]
    ids = _batch()
    for _ in range(STEPS):
        with autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before))
    return changed / sum(b.numel() for b in before)


def _realised(model, reference, start) -> float:
    """How much of the reference's total update `model` made: the projection of (model - start) on
    (reference - start), 1.0 = all of it on average."""
    pairs = [(p.detach().float() - s.detach().float(), r.detach().float() - s.detach().float())
             for p, r, s in zip(model.parameters(), reference.parameters(), start.parameters())]
    return float(sum((d * r).sum() for d, r in pairs) / sum((r * r).sum() for _, r in pairs))


def test_gpu_policy_on_cpu_changes_every_weight_where_pure_bf16_loses_most(student_fp32):
    """bf16-mixed (the GPU default), forced on the CPU: fp32 master weights, bf16 autocast; vs bf16 weights
    with a plain AdamW, the same tiny model, batch, lr 3e-5 and 10 steps."""
    prec = resolve_precision("auto", "cuda")  # what a bf16 GPU resolves `auto` to ...
    assert prec.policy == "bf16-mixed" and prec.weight_dtype == torch.float32
    prec = resolve_precision("bf16-mixed", "cpu")  # ... run on this CPU
    assert prec.autocast_dtype == torch.bfloat16
    mixed = copy.deepcopy(student_fp32).to(prec.weight_dtype)
    with prec.autocast():  # the forward really computes in bf16
        assert mixed(input_ids=_batch()[:1, :8]).logits.dtype == torch.bfloat16
    opt = build_optimizer(_as_distiller(mixed), load_config_optim())
    assert type(opt) is torch.optim.AdamW
    frac_mixed = _changed_after_steps(mixed, opt, prec.autocast)

    pure = copy.deepcopy(student_fp32).to(torch.bfloat16)
    opt = torch.optim.AdamW(pure.parameters(), lr=LR, weight_decay=0.0)
    frac_pure = _changed_after_steps(pure, opt, resolve_precision("fp32", "cpu").autocast)
    print(f"weights changed after {STEPS} AdamW steps at lr {LR}: bf16-mixed {frac_mixed:.1%}, "
          f"pure bf16 {frac_pure:.1%}")
    assert frac_mixed >= 0.99, frac_mixed
    assert frac_pure < 0.50, frac_pure


def test_bf16_sr_keeps_small_updates_on_average(student_fp32, monkeypatch):
    """bf16-sr: bf16 weights, torchao AdamW8bit with stochastic rounding (what single_gpu_8gb trains with).

    torchao compiles its per-parameter step; on this CPU (no GPU here) inductor would spend ~30 s
    compiling C++, so the step runs eagerly: the same math and the same rounding.
    """
    import torchao.optim  # noqa: F401 - the `sr` extra, which `make test` installs: a missing one fails here
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    prec = resolve_precision("bf16-sr", "cpu")
    assert prec.weight_dtype == torch.bfloat16 and prec.stochastic_rounding
    mixed = copy.deepcopy(student_fp32)  # the reference: bf16-mixed's fp32 master weights
    _changed_after_steps(mixed, torch.optim.AdamW(mixed.parameters(), lr=LR, weight_decay=0.0), prec.autocast)
    sr = copy.deepcopy(student_fp32).to(prec.weight_dtype)
    opt = build_optimizer(_as_distiller(sr), load_config_optim("adamw8bit"))
    assert type(opt).__name__ == "AdamW8bitSR"
    torch.manual_seed(0)
    frac_sr = _changed_after_steps(sr, opt, prec.autocast)
    assert isinstance(opt.param_groups[0]["lr"], float)  # the scheduler, logs and checkpoints see floats

    pure = copy.deepcopy(student_fp32).to(torch.bfloat16)
    frac_pure = _changed_after_steps(pure, torch.optim.AdamW(pure.parameters(), lr=LR, weight_decay=0.0),
                                     prec.autocast)
    real_sr, real_pure = _realised(sr, mixed, student_fp32), _realised(pure, mixed, student_fp32)
    print(f"after {STEPS} steps: bf16 + torchao AdamW8bit SR changed {frac_sr:.1%} of the weights and made "
          f"{real_sr:.2f} of bf16-mixed's update; pure bf16 {frac_pure:.1%} and {real_pure:.2f}")
    # SR moves a weight by a whole ulp with probability update/ulp: fewer weights move, by the right amount
    assert frac_sr > frac_pure + 0.3, (frac_sr, frac_pure)
    assert 0.8 < real_sr < 1.2 and real_pure < 0.5, (real_sr, real_pure)

    # a checkpoint's optimizer state survives torch.load(weights_only=True) (the 8-bit states are subclasses)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    ids = _batch()
    sr(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in sr.parameters())


def load_config_optim(optimizer: str = "adamw"):
    return load_config("single_gpu_8gb", [f"optim.optimizer={optimizer}", f"optim.lr_student={LR}",
                                          "optim.weight_decay=0.0"]).optim


def test_auto_is_plain_fp32_on_the_cpu_and_bf16_mixed_on_a_bf16_gpu():
    cpu = resolve_precision("auto", "cpu")
    assert (cpu.policy, cpu.weight_dtype, cpu.autocast_dtype) == ("fp32", torch.float32, None)
    assert student_precision(SimpleNamespace(precision="auto"), "cpu") == cpu
    with cpu.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert resolve_precision("auto", "cuda", bf16_supported=False).policy == "fp32"
    assert resolve_precision("bf16-sr", "cuda").weight_dtype == torch.bfloat16
    with pytest.raises(KavaError, match="no bf16 support"):
        resolve_precision("bf16-mixed", "cuda", bf16_supported=False)


def test_float16_and_contradictions_are_refused_in_one_line(student_fp32):
    cases = {("student.dtype=float16",): ("student.dtype", "float16"),
             ("student.precision=auto", "student.dtype=bfloat16"): ("student.dtype", "bf16-sr"),  # plain AdamW
             ("student.precision=bf16-sr", "student.dtype=float32"): ("student.dtype", "bfloat16"),
             ("student.precision=fp16",): ("student.precision", "bf16-mixed")}
    for overrides, (key, hint) in cases.items():
        with pytest.raises(KavaError) as info:
            load_config("single_gpu_8gb", list(overrides))
        msg = str(info.value)
        assert "\n" not in msg and f"'{key}'" in msg and hint in msg, msg
    # agreeing pairs load; `auto` takes the policy's stored dtype
    assert load_config("single_gpu_8gb", ["student.dtype=bfloat16"]).student.precision == "bf16-sr"
    assert load_config("single_gpu_8gb", ["student.precision=bf16-mixed", "student.dtype=float32"])
    # an fp16 student that reaches the optimizer anyway (not through a config) is refused there too
    with pytest.raises(KavaError, match="float16"):
        build_optimizer(_as_distiller(torch.nn.Linear(2, 2).half()), load_config_optim())


def test_bf16_sr_without_torchao_is_one_line_with_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as if torchao were missing
    with pytest.raises(KavaError) as info:
        build_optimizer(_as_distiller(torch.nn.Linear(2, 2).bfloat16()), load_config_optim())
    msg = str(info.value)
    assert "\n" not in msg and "bf16-sr needs torchao" in msg and "pip install" in msg, msg


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-sr"])
def test_the_training_recipe_runs_a_policy_end_to_end(policy, tiny_qwen2_dir, student_fp32, tmp_path, monkeypatch):
    """DistillRecipe (the Ray Train worker's step) on this CPU: the student is loaded in the policy's dtype,
    steps and held-out evaluation run under its autocast, and a checkpoint resumes with its optimizer."""
    import yaml

    from jobs import job_dict
    from kava_ray.core.models import kv_geometry, load_model
    from kava_ray.core.plans import student_geometry, teacher_plans
    from kava_ray.recipes.distill import DistillRecipe

    if policy == "bf16-sr":
        import torchao.optim  # noqa: F401 - the `sr` extra (installed by `make test`)
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # see test_bf16_sr_keeps_small_updates_on_average
    student_fp32.save_pretrained(tmp_path / "student")
    build_tokenizer().save_pretrained(tmp_path / "student")
    job = job_dict(tiny_qwen2_dir, tiny_qwen2_dir, tmp_path / "student", tmp_path / "runs")
    job["teachers"] = job["teachers"][:1]
    job["student"] = {"model": str(tmp_path / "student"), "precision": policy}
    job["train"].update(batch_size=2)
    job["data"].update(num_train=8, num_val=2, num_test=2)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cfg = load_config(tmp_path / "job.yaml")
    teacher = {"qwen": load_model(tiny_qwen2_dir, dtype="float32")}
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, {"qwen": kv_geometry(teacher["qwen"]).to_dict()},
                          student_geometry(cfg.student))
    source = InProcessSource(teacher)

    recipe = DistillRecipe(cfg, plans)  # device cpu: the policy as configured, not auto's fp32
    assert recipe.precision.policy == policy
    recipe.setup()
    want = torch.bfloat16 if policy == "bf16-sr" else torch.float32
    assert {p.dtype for p in recipe.distiller.student.parameters()} == {want}
    entered = []  # one entry per autocast context the recipe opens
    real = recipe.autocast
    recipe.autocast = lambda: entered.append(1) or real()
    data = recipe.data(source, until=2, depth=1)
    for step in (1, 2):
        out = recipe.step(step, data.next_step(step))
        assert torch.isfinite(out["loss"]) and torch.isfinite(out["grad_norm"])
    n_train = len(entered)
    val = recipe.evaluate(source)
    assert len(entered) > n_train and all(torch.isfinite(torch.tensor(v)) for v in val.values())  # eval autocasts
    ckpt = recipe.save(tmp_path / "ckpt", 2, data.state_dict())

    resumed = DistillRecipe(cfg, plans)
    assert resumed.setup(str(ckpt))["step"] == 2
    assert {p.dtype for p in resumed.distiller.student.parameters()} == {want}
    assert resumed.opt.state and isinstance(resumed.opt.param_groups[0]["lr"], float)
