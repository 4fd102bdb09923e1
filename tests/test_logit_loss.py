"""Logit KD: the top-k forward KL (`losses.topk_kl_loss`), top-1 agreement, and the Distiller with
loss.logit_weight > 0 (teacher top-k log-probs built in process, no Ray)."""

import copy
import dataclasses

import pytest
import torch

from jobs import write_job
from kava_ray.align.layers import plan_teacher_layers
from kava_ray.config import load_config, set_dotted, validate_config
from kava_ray.data import BatchStream
from kava_ray.distill import Distiller
from kava_ray.errors import KavaError
from kava_ray.job import TeacherPlan, load_splits, student_tokenizer
from kava_ray.kv import teacher_forward_kv
from kava_ray.losses import top1_agreement, topk_kl_loss
from kava_ray.models import kv_geometry, load_model, load_student
from tiny_models import train_on_one_batch

pytestmark = pytest.mark.unit


def teacher_topk(logits: torch.Tensor, k: int):
    """(ids [B, T, k] int64, log-probs [B, T, k]) at temperature 1, sorted descending: what a teacher sends."""
    logp, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return ids, logp


def example(seed=0, B=2, T=5, V=11, k=4):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(B, T, V, generator=g) * 2
    student = torch.randn(B, T, V, generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -2:] = 0  # padding
    ids, logp = teacher_topk(teacher, k)
    return student, ids, logp, mask


# ----------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_kl_is_zero_when_student_equals_teacher(temperature):
    _, ids, logp, mask = example()
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(2, 5, 11, generator=g)
    ids, logp = teacher_topk(teacher, 4)
    for student in (teacher, teacher + 3.0, teacher.bfloat16()):  # a constant shift changes no distribution
        loss = topk_kl_loss(student, ids, logp, mask, temperature=temperature)
        assert loss.dtype == torch.float32 and loss.dim() == 0
        tol = 1e-2 if student.dtype == torch.bfloat16 else 1e-6
        assert abs(float(loss)) < tol, (student.dtype, float(loss))
    assert float(topk_kl_loss(teacher.roll(1, -1), ids, logp, mask)) > 0.1


def test_gradient_matches_the_closed_form_and_finite_differences():
    student, ids, logp, mask = example()
    T = 2.0
    z = student.clone().requires_grad_(True)
    topk_kl_loss(z, ids, logp, mask, temperature=T).backward()
    # closed form: T * (q_s - p_t) on the k gathered logits, times mask / n; 0 elsewhere
    m = mask.float()[..., None]
    q = torch.softmax(student.gather(-1, ids) / T, -1)
    p = torch.softmax(logp / T, -1)
    want = torch.zeros_like(student).scatter(-1, ids, T * (q - p) * m / mask.sum())
    torch.testing.assert_close(z.grad, want, atol=1e-6, rtol=1e-5)
    assert (z.grad[1, -2:] == 0).all()  # padding gets no gradient
    # finite differences on a few entries, in float64 arithmetic on float32 losses
    eps = 1e-2
    for b, t, v in [(0, 0, int(ids[0, 0, 0])), (1, 2, int(ids[1, 2, 3])), (0, 4, int(ids[0, 4, 1]))]:
        up, down = student.clone(), student.clone()
        up[b, t, v] += eps
        down[b, t, v] -= eps
        fd = (float(topk_kl_loss(up, ids, logp, mask, T)) - float(topk_kl_loss(down, ids, logp, mask, T))) / (2 * eps)
        assert abs(fd - float(z.grad[b, t, v])) < 1e-3, (b, t, v, fd, float(z.grad[b, t, v]))


def test_masked_positions_change_nothing():
    student, ids, logp, mask = example()
    z = student.clone().requires_grad_(True)
    clean = topk_kl_loss(z, ids, logp, mask)
    clean.backward()
    bad_s, bad_ids, bad_logp = student.clone(), ids.clone(), logp.clone()
    bad_s[1, -2:] = float("nan")
    bad_s[1, -1, 0] = float("inf")
    bad_ids[1, -2:] = 10 ** 9  # past any vocab: never gathered
    bad_logp[1, -2:] = float("nan")
    z2 = bad_s.clone().requires_grad_(True)
    dirty = topk_kl_loss(z2, bad_ids, bad_logp, mask)
    dirty.backward()
    assert torch.equal(clean.detach(), dirty.detach())
    torch.testing.assert_close(z2.grad, z.grad, atol=0, rtol=0)
    assert float(top1_agreement(bad_s, bad_ids, mask)) == float(top1_agreement(student, ids, mask))
    # the mean is over counted positions: a position-wise equal loss does not depend on how many are masked
    none = torch.zeros_like(mask)
    assert float(topk_kl_loss(student, ids, logp, none)) == 0.0


def test_temperature_scales_by_t_squared_and_large_t_flattens():
    student, ids, logp, mask = example(seed=3)
    zs = student.gather(-1, ids)
    for T in (0.5, 1.0, 3.0):
        p = torch.log_softmax(logp / T, -1)
        q = torch.log_softmax(zs / T, -1)
        kl = (p.exp() * (p - q)).sum(-1)
        want = T ** 2 * (kl * mask).sum() / mask.sum()
        torch.testing.assert_close(topk_kl_loss(student, ids, logp, mask, temperature=T), want)
    # large T: both sides flatten (the unscaled KL -> 0), and T^2 * KL -> Hinton's limit 0.5 * Var_k(z_s - logp_t)
    unscaled = [float(topk_kl_loss(student, ids, logp, mask, temperature=T)) / T ** 2 for T in (1, 4, 16, 64)]
    assert all(a > b for a, b in zip(unscaled, unscaled[1:])) and unscaled[-1] < 1e-3
    d = zs - logp
    limit = (0.5 * d.var(-1, unbiased=False) * mask).sum() / mask.sum()
    near = [abs(float(topk_kl_loss(student, ids, logp, mask, temperature=T)) - float(limit)) for T in (3, 10, 100)]
    assert near[0] > near[1] > near[2] and near[2] < 5e-3 * float(limit), near  # (fp32 limits larger T)
    with pytest.raises(KavaError):
        topk_kl_loss(student, ids, logp, mask, temperature=0.0)


def test_top1_agreement_is_a_masked_mean_tensor():
    logits = torch.zeros(1, 3, 5)
    logits[0, 0, 2] = logits[0, 1, 4] = logits[0, 2, 1] = 1.0  # student argmax: 2, 4, 1
    ids = torch.tensor([[[2, 0], [3, 4], [1, 0]]])  # teacher top-1: 2, 3, 1
    agree = top1_agreement(logits, ids, torch.tensor([[1, 1, 0]]))
    assert isinstance(agree, torch.Tensor) and agree.dim() == 0 and not agree.requires_grad
    assert float(agree) == 0.5
    assert float(top1_agreement(logits, ids)) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- the Distiller


@pytest.fixture(scope="module")
def job_path(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir):
    return write_job(tmp_path_factory.mktemp("logitjob"), tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir)


SHARPEN = 10.0  # random tiny teachers are near uniform (KL ~ 0.005): sharpened, they have something to teach


@pytest.fixture(scope="module")
def setup(job_path):
    """One batch, the teachers' KV and top-k log-probs (k=8, of SHARPEN x the logits) from an in-process
    forward, the plans."""
    cfg = load_config(job_path)
    tok, _ = student_tokenizer(cfg)
    train, _ = load_splits(cfg, tok)
    _, _, _, batch = BatchStream(train, 4, 0).next()
    s_geom = kv_geometry(load_student(cfg.student.model, dtype="float32"))
    plans, kv = {}, {}
    for t in cfg.teachers:
        model = load_model(t.model, dtype=t.dtype, quantization=t.quantization)
        g = kv_geometry(model)
        lm, layers = plan_teacher_layers("ratio", g.num_layers, s_geom.num_layers, mode=cfg.align.mode)
        plans[t.name] = TeacherPlan(t.name, g, lm, layers)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ids, logp = teacher_topk(logits * SHARPEN, 8)
        kv_t = teacher_forward_kv(model, batch["input_ids"], batch["attention_mask"], layers=layers)
        kv[t.name] = dataclasses.replace(kv_t.to(dtype=torch.float32), topk_ids=ids, topk_logp=logp)
    return cfg.to_dict(), batch, plans, kv, s_geom


def make(setup, *overrides):
    """A fresh Distiller (same student init every time) for the job config with dotted overrides."""
    data, batch, plans, kv, s_geom = setup
    d = copy.deepcopy(data)
    for o in overrides:
        key, value = o.split("=", 1)
        set_dotted(d, key.split("."), value)
    cfg = validate_config(d)
    torch.manual_seed(0)
    student = load_student(cfg.student.model, dtype="float32")
    return Distiller(student, plans, s_geom, cfg), cfg, batch, kv


@pytest.mark.parametrize("fusion,kv_weight", [("fixed", "1.0"), ("sum", "0.0"), ("gate", "0.5")])
def test_distiller_logit_kd_trains(setup, fusion, kv_weight):
    distiller, cfg, batch, kv = make(setup, f"fusion.kind={fusion}", "loss.logit_weight=1.0",
                                     f"loss.kv_weight={kv_weight}", "loss.logit_top_k=4", "loss.logit_temperature=2.0")
    history = train_on_one_batch(distiller, cfg.optim, batch, kv, steps=6)
    first, last = history[0], history[-1]
    for k in ("logit_kl", "logit_kl/qwen", "logit_kl/llama", "top1_agree/qwen", "top1_agree/llama"):
        assert isinstance(last[k], torch.Tensor) and last[k].dim() == 0 and not last[k].requires_grad, k
    assert last["logit_kl"] < 0.9 * first["logit_kl"], (float(first["logit_kl"]), float(last["logit_kl"]))
    for t in ("qwen", "llama"):
        assert last[f"top1_agree/{t}"] >= first[f"top1_agree/{t}"], t
    # the loss is ce_weight * CE + kv_weight * KV + logit_weight * KL, with the fusion weights over teachers
    w = {t: float(first[f"fusion/{t}"]) for t in ("qwen", "llama")}
    kl = sum(w[t] * float(first[f"logit_kl/{t}"]) for t in w)
    assert float(first["logit_kl"]) == pytest.approx(kl, rel=1e-5)
    want = float(first["ce"]) + float(kv_weight) * float(first["kv_loss"]) + kl
    assert float(first["loss"]) == pytest.approx(want, rel=1e-5)


def test_logit_weight_zero_is_exactly_as_before(setup):
    off, _, batch, kv = make(setup)
    plain = {n: dataclasses.replace(b, topk_ids=None, topk_logp=None) for n, b in kv.items()}
    loss_a, m_a = off(batch, kv)
    loss_b, m_b = off(batch, plain)  # no logits needed, none used
    assert torch.equal(loss_a, loss_b) and not any(k.startswith(("logit_kl", "top1_agree")) for k in m_a)
    on, _, _, _ = make(setup, "loss.logit_weight=0.5")
    loss_c, m_c = on(batch, kv)
    assert torch.equal(m_c["ce"], m_a["ce"]) and torch.equal(m_c["kv_loss"], m_a["kv_loss"])
    assert float(loss_c) == pytest.approx(float(loss_a) + 0.5 * float(m_c["logit_kl"]), rel=1e-6)


def test_missing_logits_and_vocab_mismatch_fail_with_one_line(setup):
    distiller, _, batch, kv = make(setup, "loss.logit_weight=1.0")
    no_llama = {**kv, "llama": dataclasses.replace(kv["llama"], topk_ids=None, topk_logp=None)}
    with pytest.raises(KavaError) as info:
        distiller(batch, no_llama)
    msg = str(info.value)
    assert "\n" not in msg and "'llama'" in msg and "loss.logit_weight" in msg, msg
    big = kv["qwen"].topk_ids.clone()
    big[0, 3, 1] = 10_000
    with pytest.raises(KavaError) as info:
        distiller(batch, {**kv, "qwen": dataclasses.replace(kv["qwen"], topk_ids=big)})
    msg = str(info.value)
    assert "\n" not in msg and "'qwen'" in msg and "10000" in msg and "vocab" in msg, msg


def test_heldout_eval_aggregates_the_logit_metrics(job_path):
    """evaluate_heldout end to end (in-process teachers serving top-k through the KVFeed): eval/logit_kl,
    eval/logit_kl/<t>, eval/top1_agree/<t>, token-weighted like the KV metrics."""
    from kava_ray.evaluate import evaluate_heldout
    from kava_ray.job import student_geometry, teacher_plans
    from kava_ray.testing.sources import InProcessSource

    cfg = load_config(job_path, ["loss.logit_weight=1.0", "loss.logit_top_k=4", "fusion.kind=fixed"])
    tok, _ = student_tokenizer(cfg)
    _, val = load_splits(cfg, tok)
    teachers = {t.name: load_model(t.model, dtype=t.dtype, quantization=t.quantization) for t in cfg.teachers}
    plans = teacher_plans(cfg, {n: kv_geometry(m).to_dict() for n, m in teachers.items()}, student_geometry(cfg))
    student = load_student(cfg.student.model, dtype="float32")
    distiller = Distiller(student, plans, kv_geometry(student), cfg)
    got = evaluate_heldout(distiller, InProcessSource(teachers), plans, val, cfg, "cpu", torch.float32)
    for t in ("qwen", "llama"):
        assert got[f"eval/logit_kl/{t}"] > 0 and 0 <= got[f"eval/top1_agree/{t}"] <= 1
    # fixed equal weights: the weighted KL is the mean of the teachers' (token weighting is linear)
    assert got["eval/logit_kl"] == pytest.approx((got["eval/logit_kl/qwen"] + got["eval/logit_kl/llama"]) / 2)
    plain = load_config(job_path)
    off = evaluate_heldout(Distiller(student, plans, kv_geometry(student), plain), InProcessSource(teachers), plans,
                           val, plain, "cpu", torch.float32)
    assert not any("logit" in k or "top1" in k for k in off)
