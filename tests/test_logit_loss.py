"""Logit KD: the top-k forward KL (`losses.topk_kl_loss`), top-1 agreement, and the Distiller with
loss.logit_weight > 0 (teacher top-k log-probs built in process, no Ray)."""

import copy
import dataclasses
import math

import pytest
import torch

from jobs import write_job
from kava_ray.common.config import load_config, set_dotted, validate_config
from kava_ray.common.errors import KavaError
from kava_ray.core.align.layers import plan_teacher_layers
from kava_ray.core.kv import teacher_forward_kv
from kava_ray.core.losses import (
    log_normalizer,
    masked_ce,
    next_token_mask,
    position_masks,
    top1_agreement,
    topk_kl_loss,
    topk_tail,
)
from kava_ray.core.models import kv_geometry, load_model, load_student
from kava_ray.core.plans import TeacherPlan, student_tokenizer
from kava_ray.data import Batch, BatchStream
from kava_ray.data.splits import load_splits
from kava_ray.recipes.build import build_distiller
from tiny_models import train_on_one_batch

pytestmark = pytest.mark.unit


def teacher_topk(logits: torch.Tensor, k: int):
    """(ids [B, T, k] int64, log-probs [B, T, k], tail [B, T]) at temperature 1, sorted descending: what a
    teacher sends (the log-probs normalised over the full vocabulary, the tail = log mass outside the k ids)."""
    full = torch.log_softmax(logits.float(), -1)
    logp, ids = full.topk(k, dim=-1)
    return ids, logp, full.scatter(-1, ids, float("-inf")).logsumexp(-1)


def example(seed=0, B=2, T=5, V=11, k=4):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(B, T, V, generator=g) * 2
    student = torch.randn(B, T, V, generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -2:] = 0  # padding
    ids, logp, tail = teacher_topk(teacher, k)
    return student, ids, logp, tail, mask


def by_hand(student, ids, logp, tail, mask, T=1.0, bucket=True):
    """The KD of one tiny vocabulary in plain Python, position by position (DistillKit's sparse_kl_div)."""
    total, n = 0.0, 0
    for b in range(student.shape[0]):
        for t in range(student.shape[1]):
            if not mask[b, t]:
                continue
            z = [float(x) / T for x in student[b, t]]
            lse = math.log(sum(math.exp(x) for x in z))
            s = [z[int(i)] - lse for i in ids[b, t]]  # the student over its FULL vocabulary
            p = [float(x) for x in logp[b, t]]
            if bucket:
                s.append(math.log(1 - sum(math.exp(x) for x in s)))
                p.append(float(tail[b, t]))
            a = [x / T for x in p]
            z_t = math.log(sum(math.exp(x) for x in a))
            q = [x - z_t for x in a]  # the teacher at T over its k (+ 1) entries
            total += sum(math.exp(qi) * (qi - si) for qi, si in zip(q, s))
            n += 1
    return T * T * total / n


# ----------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("bucket", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_full_vocab_kd_equals_a_hand_computation(bucket, temperature):
    student, ids, logp, tail, mask = example()
    got = topk_kl_loss(student, ids, logp, mask, temperature=temperature, tail="bucket" if bucket else "none",
                       teacher_tail=tail)
    assert float(got) == pytest.approx(by_hand(student, ids, logp, tail, mask, temperature, bucket), rel=1e-5)
    # the shared normaliser (CE's logsumexp) gives the same number
    lse = log_normalizer(student, temperature)
    assert torch.allclose(topk_kl_loss(student, ids, logp, mask, temperature, "bucket" if bucket else "none",
                                       tail, lse), got)
    # without a served tail, the bucket is 1 - sum p (what older caches give)
    if bucket:
        derived = topk_kl_loss(student, ids, logp, mask, temperature=temperature)
        assert float(derived) == pytest.approx(float(got), rel=1e-4)


def test_renormalising_the_student_over_the_k_ids_would_hide_its_mass_elsewhere():
    """The bug this loss replaces: a student whose logits on the k ids have the teacher's shape but whose mass
    sits elsewhere scored 0 when renormalised over the k ids; over the full vocabulary it pays."""
    V, k = 50, 4
    teacher = torch.full((1, 1, V), -10.0)
    teacher[0, 0, :k] = torch.tensor([3.0, 2.0, 1.0, 0.0])
    ids, logp, tail = teacher_topk(teacher, k)
    student = teacher.clone()
    student[0, 0, k:] = 6.0  # the same shape on the ids, >= 97 % of its mass on the other 46 tokens
    renormalised = torch.log_softmax(logp, -1), torch.log_softmax(student.gather(-1, ids), -1)
    assert float((renormalised[0].exp() * (renormalised[0] - renormalised[1])).sum()) < 1e-6
    for mode in ("bucket", "none"):
        assert float(topk_kl_loss(student, ids, logp, teacher_tail=tail, tail=mode)) > 3.0, mode


@pytest.mark.parametrize("mode", ["bucket", "none"])
def test_mass_off_the_support_gives_a_large_loss_that_one_step_lowers(mode):
    torch.manual_seed(0)
    B, T, V, k = 2, 6, 40, 5
    teacher = torch.randn(B, T, V) * 3
    ids, logp, tail = teacher_topk(teacher, k)
    student = torch.randn(B, T, V)
    student.scatter_(-1, ids, -4.0)  # the student's mass sits off the teacher's top-k

    def off_support(z):
        return 1 - torch.softmax(z, -1).gather(-1, ids).sum(-1)

    assert float(off_support(student).min()) >= 0.9
    z = torch.nn.Parameter(student.clone())
    opt = torch.optim.Adam([z], lr=0.5)
    loss = topk_kl_loss(z, ids, logp, teacher_tail=tail, tail=mode)
    assert float(loss.detach()) > 1.0
    loss.backward()
    assert float(z.grad.gather(-1, ids).sum()) < 0  # the support, as a whole, is pushed up
    opt.step()
    after = off_support(z.detach())
    assert (after < off_support(student)).all() and float(after.mean()) < float(off_support(student).mean()) - 0.002
    assert float(topk_kl_loss(z.detach(), ids, logp, teacher_tail=tail, tail=mode)) < float(loss) - 0.5


def test_zero_loss_and_zero_gradient_when_the_student_is_the_teacher():
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(2, 5, 11, generator=g) * 2
    ids, logp, tail = teacher_topk(teacher, 4)
    mask = torch.ones(2, 5)
    for student in (teacher, teacher + 3.0):  # a constant shift changes no distribution
        z = student.clone().requires_grad_(True)
        loss = topk_kl_loss(z, ids, logp, mask, teacher_tail=tail)
        assert loss.dtype == torch.float32 and loss.dim() == 0
        loss.backward()
        assert abs(float(loss)) < 1e-6 and float(z.grad.abs().max()) < 1e-6, (float(loss), float(z.grad.abs().max()))
    assert abs(float(topk_kl_loss(teacher.bfloat16(), ids, logp, mask, teacher_tail=tail))) < 1e-2
    assert float(topk_kl_loss(teacher.roll(1, -1), ids, logp, mask, teacher_tail=tail)) > 0.1


def test_gradient_matches_finite_differences_on_the_whole_vocabulary():
    student, ids, logp, tail, mask = example()
    T = 2.0
    z = student.clone().double().requires_grad_(True)
    topk_kl_loss(z, ids, logp, mask, temperature=T, teacher_tail=tail).backward()
    assert (z.grad[1, -2:] == 0).all()  # padding gets no gradient
    off = [v for v in range(11) if v not in ids[0, 0].tolist()][0]  # a token outside the support gets one too
    assert z.grad[0, 0, off] != 0
    eps = 1e-4
    for b, t, v in [(0, 0, int(ids[0, 0, 0])), (1, 2, int(ids[1, 2, 3])), (0, 0, off)]:
        up, down = student.clone().double(), student.clone().double()
        up[b, t, v] += eps
        down[b, t, v] -= eps
        fd = (float(topk_kl_loss(up, ids, logp, mask, T, teacher_tail=tail))
              - float(topk_kl_loss(down, ids, logp, mask, T, teacher_tail=tail))) / (2 * eps)
        assert abs(fd - float(z.grad[b, t, v])) < 1e-4, (b, t, v, fd, float(z.grad[b, t, v]))


def test_masked_teacher_positions_change_nothing():
    student, ids, logp, tail, mask = example()
    z = student.clone().requires_grad_(True)
    clean = topk_kl_loss(z, ids, logp, mask, teacher_tail=tail)
    clean.backward()
    bad_ids, bad_logp, bad_tail = ids.clone(), logp.clone(), tail.clone()
    bad_ids[1, -2:] = 10 ** 9  # past any vocab: never gathered
    bad_logp[1, -2:] = float("nan")
    bad_tail[1, -2:] = float("nan")
    z2 = student.clone().requires_grad_(True)
    dirty = topk_kl_loss(z2, bad_ids, bad_logp, mask, teacher_tail=bad_tail)
    dirty.backward()
    assert torch.equal(clean.detach(), dirty.detach())
    torch.testing.assert_close(z2.grad, z.grad, atol=0, rtol=0)
    assert float(top1_agreement(student, bad_ids, mask)) == float(top1_agreement(student, ids, mask))
    none = torch.zeros_like(mask)
    assert float(topk_kl_loss(student, ids, logp, none)) == 0.0
    with pytest.raises(KavaError):
        topk_kl_loss(student, ids, logp, mask, temperature=0.0)
    with pytest.raises(KavaError):
        topk_kl_loss(student, ids, logp, mask, tail="renormalise")


def test_at_a_temperature_the_bucket_tempers_the_teachers_tail_as_one_token():
    """What docs/training.md and `loss.logit_temperature` say, measured: the teacher sends its top-k and tail at
    T = 1, and the bucket form tempers that tail as one token, (tail)^(1/T) renormalised over the k + 1 entries,
    where the full teacher at T would give its tail sum(p_i^(1/T)), far more; the student's tail at T is its real
    mass outside the ids. At T = 1 the bucket form is the coarse-grained KL, below the exact full-vocabulary one;
    at T = 2 (k 8; 2,048 ids, teacher logits N(0, 5^2), the student's the teacher's + N(0, 1): top 8 hold 89 %)
    it is 2.45 against the exact 0.47 (both x T^2)."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(4, 32, 2048, generator=g) * 5
    student = teacher + torch.randn(4, 32, 2048, generator=g)
    ids, logp, tail = teacher_topk(teacher, 8)
    assert float(1 - logp.exp().sum(-1).mean()) == pytest.approx(0.11, abs=0.01)
    got, exact = {}, {}
    for T in (1.0, 2.0):
        got[T] = float(topk_kl_loss(student, ids, logp, teacher_tail=tail, temperature=T))
        p_t, p_s = torch.log_softmax(teacher / T, -1), torch.log_softmax(student / T, -1)
        exact[T] = float((p_t.exp() * (p_t - p_s)).sum(-1).mean()) * T ** 2
    assert got[1.0] <= exact[1.0] and (round(got[1.0], 2), round(exact[1.0], 2)) == (0.26, 0.31), (got, exact)
    assert got[2.0] > 5 * exact[2.0] and (round(got[2.0], 2), round(exact[2.0], 2)) == (2.45, 0.47), (got, exact)


def test_a_shorter_top_k_moves_the_dropped_mass_into_the_tail():
    g = torch.Generator().manual_seed(2)
    teacher = torch.randn(1, 3, 30, generator=g) * 2
    ids, logp, tail = teacher_topk(teacher, 8)
    ids4, logp4, tail4 = teacher_topk(teacher, 4)
    torch.testing.assert_close(topk_tail(logp, tail, 4), tail4)
    torch.testing.assert_close(topk_tail(logp, None, 4), tail4, atol=1e-5, rtol=1e-5)


def test_top1_agreement_is_a_masked_mean_tensor():
    logits = torch.zeros(1, 3, 5)
    logits[0, 0, 2] = logits[0, 1, 4] = logits[0, 2, 1] = 1.0  # student argmax: 2, 4, 1
    ids = torch.tensor([[[2, 0], [3, 4], [1, 0]]])  # teacher top-1: 2, 3, 1
    agree = top1_agreement(logits, ids, torch.tensor([[1, 1, 0]]))
    assert isinstance(agree, torch.Tensor) and agree.dim() == 0 and not agree.requires_grad
    assert float(agree) == 0.5
    assert float(top1_agreement(logits, ids)) == pytest.approx(2 / 3)


def test_ce_with_the_shared_normaliser_equals_cross_entropy():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 13, generator=g)
    labels = torch.randint(0, 13, (2, 6), generator=g)
    labels[0, :3] = -100
    labels[1, -1] = -100
    torch.testing.assert_close(masked_ce(logits, labels, lse=log_normalizer(logits)), masked_ce(logits, labels))


@pytest.mark.parametrize("tokens", ["all", "answer", "no_shared_prefix"])
def test_kd_and_ce_count_the_same_positions_under_every_loss_tokens(tokens):
    """Logits at t predict t + 1: CE and KD both count t where labels[t + 1] carries a loss, whatever
    `loss_tokens` says the KV loss counts."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 0], [1, 2, 7, 8, 9, 0, 0]])
    attn = (ids != 0).long()
    labels = torch.where(attn.bool(), ids, -100)
    labels[:, :3] = -100  # a 3-token prompt
    answer = (labels != -100).long()
    batch = Batch(ids, attn, labels, answer)
    kv, nxt = position_masks(batch, tokens)
    want = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(nxt, want)  # the position before the first answer token counts, the last answer token not
    assert torch.equal(kv, {"all": attn.bool(), "answer": answer.bool(),
                            "no_shared_prefix": attn.bool() & (torch.arange(7) >= 2)}[tokens])
    # CE averages over exactly these positions: a logit change elsewhere changes neither CE nor KD
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 7, 10, generator=g)
    t_ids, t_logp, t_tail = teacher_topk(torch.randn(2, 7, 10, generator=g), 3)
    poked = logits.clone()
    poked[~nxt] += torch.randn(int((~nxt).sum()), 10, generator=g)
    for f in (lambda z: masked_ce(z, labels), lambda z: topk_kl_loss(z, t_ids, t_logp, nxt, teacher_tail=t_tail)):
        assert torch.equal(f(logits), f(poked))
    poked_in = logits.clone()
    poked_in[0, 2, int(labels[0, 3])] += 1.0  # the position that predicts the first answer token counts for both
    assert not torch.equal(masked_ce(logits, labels), masked_ce(poked_in, labels))
    assert not torch.equal(topk_kl_loss(logits, t_ids, t_logp, nxt, teacher_tail=t_tail),
                           topk_kl_loss(poked_in, t_ids, t_logp, nxt, teacher_tail=t_tail))


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
    tok, _ = student_tokenizer(cfg.student)
    train, _ = load_splits(cfg.data, cfg.train, tok)
    _, _, _, batch = BatchStream(train, 4, 0).next()
    s_geom = kv_geometry(load_student(cfg.student.model, dtype="float32"))
    plans, kv = {}, {}
    for t in cfg.teachers:
        model = load_model(t.model, dtype=t.dtype, quantization=t.quantization)
        g = kv_geometry(model)
        lm, layers = plan_teacher_layers("ratio", g.num_layers, s_geom.num_layers, mode=cfg.align.mode)
        plans[t.name] = TeacherPlan(t.name, g, lm, layers)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        ids, logp, tail = teacher_topk(logits * SHARPEN, 8)
        kv_t = teacher_forward_kv(model, batch.input_ids, batch.attention_mask, layers=layers)
        kv[t.name] = dataclasses.replace(kv_t.to(dtype=torch.float32), topk_ids=ids, topk_logp=logp, topk_tail=tail)
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
    return build_distiller(student, plans, s_geom, cfg), cfg, batch, kv


@pytest.mark.parametrize("fusion,kv_weight", [("fixed", "1.0"), ("sum", "0.0"), ("gate", "0.5")])
def test_distiller_logit_kd_trains(setup, fusion, kv_weight):
    distiller, cfg, batch, kv = make(setup, f"fusion.kind={fusion}", "loss.logit_weight=1.0",
                                     f"loss.kv_weight={kv_weight}", "loss.logit_top_k=4", "loss.logit_temperature=2.0")
    history = train_on_one_batch(distiller, cfg.optim, batch, kv, steps=6)
    first, last = history[0], history[-1]
    for k in ("logit_kl", "logit_kl/qwen", "logit_kl/llama", "top1_agree/qwen", "top1_agree/llama"):
        assert isinstance(last[k], torch.Tensor) and last[k].dim() == 0 and not last[k].requires_grad, k
    # over the full vocabulary the near-uniform tiny student must move real mass: the KL falls steadily, slowly
    kls = [float(h["logit_kl"]) for h in history]
    assert all(b < a for a, b in zip(kls, kls[1:])) and kls[-1] < 0.985 * kls[0], kls
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
    plain = {n: dataclasses.replace(b, topk_ids=None, topk_logp=None, topk_tail=None) for n, b in kv.items()}
    a = off(batch, kv)
    loss_a, m_a = a.loss, a.metrics
    loss_b = off(batch, plain).loss  # no logits needed, none used
    assert torch.equal(loss_a, loss_b) and not any(k.startswith(("logit_kl", "top1_agree")) for k in m_a)
    on, _, _, _ = make(setup, "loss.logit_weight=0.5")
    c = on(batch, kv)
    loss_c, m_c = c.loss, c.metrics
    # CE from the normaliser it shares with the KD: equal to F.cross_entropy's to float rounding
    assert float(m_c["ce"]) == pytest.approx(float(m_a["ce"]), rel=1e-6) and torch.equal(m_c["kv_loss"], m_a["kv_loss"])
    assert float(loss_c) == pytest.approx(float(loss_a) + 0.5 * float(m_c["logit_kl"]), rel=1e-5)


def test_missing_logits_and_vocab_mismatch_fail_with_one_line(setup):
    distiller, cfg, batch, kv = make(setup, "loss.logit_weight=1.0")
    no_llama = {**kv, "llama": dataclasses.replace(kv["llama"], topk_ids=None, topk_logp=None, topk_tail=None)}
    with pytest.raises(KavaError) as info:
        distiller(batch, no_llama)
    msg = str(info.value)
    assert "\n" not in msg and "'llama'" in msg and "loss.logit_weight" in msg, msg
    big = kv["qwen"].topk_ids.clone()
    b, t = next_token_mask(batch.labels).nonzero()[0].tolist()  # a position the KD counts
    big[b, t, 1] = 10_000
    with pytest.raises(KavaError) as info:
        distiller(batch, {**kv, "qwen": dataclasses.replace(kv["qwen"], topk_ids=big)})
    msg = str(info.value)
    assert "\n" not in msg and "'qwen'" in msg and "10000" in msg and "vocab" in msg, msg
    # a teacher whose plan says its head is wider (one tokenizer, padding rows): an id past the student's head is
    # its tail mass, not an error
    _, _, plans, _, s_geom = setup
    V = s_geom.vocab_size
    wide = {**plans, "qwen": dataclasses.replace(plans["qwen"], geometry=dataclasses.replace(
        plans["qwen"].geometry, vocab_size=V + 64))}
    big[b, t, 1] = V + 1
    padded = build_distiller(distiller.student, wide, s_geom, cfg)
    out = padded(batch, {**kv, "qwen": dataclasses.replace(kv["qwen"], topk_ids=big)})
    loss, m = out.loss, out.metrics
    assert torch.isfinite(loss) and torch.isfinite(m["logit_kl/qwen"])


@pytest.mark.parametrize("tail", ["bucket", "none"])
def test_a_teacher_head_wider_than_the_student_s_puts_its_padding_ids_in_the_tail(tail):
    """Same tokenizer, the teacher's LM head 2 rows wider (Qwen2.5-7B's 152,064 against 1.5B's 151,936): top-k ids
    past the student's head are mass the student cannot place -- in the tail bucket (none: left out of the k),
    checked against a hand computation over the teacher's full distribution; a padded top-1 never agrees."""
    from types import SimpleNamespace

    from kava_ray.common.config import LossConfig
    from kava_ray.core.logit_kd import LogitTeacher
    from tiny_models import logit_term

    V, k = 10, 4
    g = torch.Generator().manual_seed(3)
    student = torch.randn(1, 3, V, generator=g)
    student[0, 1, 0] += 10.0  # the student's argmax at position 1 is id 0: a padded top-1 must not pass for it
    t_logits = torch.randn(1, 3, V + 2, generator=g)
    t_logits[0, 1, V:] += 6.0  # position 1: both padding ids lead the teacher's top-k
    t_logits[0, 2, V + 1] += 1.5  # position 2: one of them among the top-k
    t_logits[0, 2, V] -= 10.0
    t_logits[0, 0, V:] -= 10.0  # position 0: none
    p_t = t_logits.softmax(-1)
    logp, ids = p_t.log().topk(k, dim=-1)
    served = SimpleNamespace(topk_ids=ids, topk_logp=logp, topk_tail=torch.log1p(-logp.exp().sum(-1)))
    assert (ids[0, 1, :2] >= V).all() and (ids[0, 2] >= V).sum() == 1 and (ids[0, 0] < V).all()
    cfg = LossConfig(logit_weight=1.0, logit_top_k=k, logit_tail=tail)
    mask = torch.ones(1, 3)
    loss, m = logit_term(LogitTeacher("t", vocab_size=V + 2), student, served, {}, mask, cfg)

    p_s = student.softmax(-1)
    want = []
    for t in range(3):
        keep = [int(i) for i in ids[0, t] if i < V]
        q, s = p_t[0, t, keep], p_s[0, t, keep]
        if tail == "bucket":
            q, s = torch.cat([q, (1 - q.sum())[None]]), torch.cat([s, (1 - s.sum())[None]])
        else:
            q = q / q.sum()
        want.append(float((q * (q.log() - s.log())).sum()))
    assert float(loss) == pytest.approx(sum(want) / 3, rel=1e-5), (float(loss), want)
    agree = [int(student[0, t].argmax()) == int(ids[0, t, 0]) for t in range(3)]
    assert float(m["top1_agree"]) == pytest.approx(sum(agree) / 3) and not agree[1]
    if tail == "none":  # a position with no entry left has nothing to compare: it does not count
        only0 = torch.zeros(1, 3, k, dtype=torch.bool)
        only0[0, 0] = True
        got = topk_kl_loss(student, ids.clamp(max=V - 1), logp, mask, tail="none", valid=only0)
        assert float(got) == pytest.approx(want[0], rel=1e-5)


def test_heldout_eval_aggregates_the_logit_metrics(job_path):
    """evaluate_heldout end to end (in-process teachers serving top-k through the KVFeed): eval/logit_kl,
    eval/logit_kl/<t>, eval/top1_agree/<t>, token-weighted like the KV metrics."""
    from kava_ray.core.plans import student_geometry, teacher_plans
    from kava_ray.recipes.evaluate import evaluate_heldout
    from kava_ray.testing.inprocess_source import InProcessSource

    cfg = load_config(job_path, ["loss.logit_weight=1.0", "loss.logit_top_k=4", "fusion.kind=fixed"])
    tok, _ = student_tokenizer(cfg.student)
    _, val = load_splits(cfg.data, cfg.train, tok)
    teachers = {t.name: load_model(t.model, dtype=t.dtype, quantization=t.quantization) for t in cfg.teachers}
    geoms = {n: kv_geometry(m).to_dict() for n, m in teachers.items()}
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))
    student = load_student(cfg.student.model, dtype="float32")
    distiller = build_distiller(student, plans, kv_geometry(student), cfg)
    got = evaluate_heldout(distiller, InProcessSource(teachers), plans, val, cfg, "cpu", torch.float32)
    for t in ("qwen", "llama"):
        assert got[f"eval/logit_kl/{t}"] > 0 and 0 <= got[f"eval/top1_agree/{t}"] <= 1
    # fixed equal weights: the weighted KL is the mean of the teachers' (token weighting is linear)
    assert got["eval/logit_kl"] == pytest.approx((got["eval/logit_kl/qwen"] + got["eval/logit_kl/llama"]) / 2)
    plain = load_config(job_path)
    off = evaluate_heldout(build_distiller(student, plans, kv_geometry(student), plain), InProcessSource(teachers),
                           plans, val, plain, "cpu", torch.float32)
    assert not any("logit" in k or "top1" in k for k in off)


# ------------------------------------------------------------------ ULD: teachers of another vocabulary


def _uld_reference(p_t: torch.Tensor, p_s: torch.Tensor) -> float:
    """TRL GOLD's `ULDLoss` (non-hybrid) on full distributions [N, V_t], [N, V_s]: sorted descending, the shorter
    zero-padded, L1 summed over vocabulary and positions, divided by the number of positions."""
    n = max(p_t.shape[-1], p_s.shape[-1])
    t = torch.nn.functional.pad(p_t.sort(-1, descending=True).values, (0, n - p_t.shape[-1]))
    s = torch.nn.functional.pad(p_s.sort(-1, descending=True).values, (0, n - p_s.shape[-1]))
    return float((t - s).abs().sum() / p_t.shape[0])


def test_uld_is_zero_for_permuted_distributions_and_gold_s_value_otherwise():
    from kava_ray.core.losses import uld_loss

    g = torch.Generator().manual_seed(0)
    logits_t = torch.randn(2, 5, 40, generator=g) * 2
    logp_t = logits_t.log_softmax(-1)
    perm = torch.randperm(40, generator=g)
    # the student: the same shape over a larger vocabulary (24 ids it never predicts), in another order
    student = torch.cat([logits_t[..., perm], torch.full((2, 5, 24), -1e4)], dim=-1)
    assert float(uld_loss(student, logp_t)) == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(2, 5, 64, generator=g)
    got = float(uld_loss(other, logp_t))  # k = the teacher's whole vocabulary: GOLD's value exactly
    assert got == pytest.approx(_uld_reference(logp_t.exp().reshape(10, 40), other.softmax(-1).reshape(10, 64)),
                                rel=1e-5)


def test_uld_grows_with_the_difference_and_keeps_the_tail_as_one_bucket():
    from kava_ray.core.losses import uld_loss

    g = torch.Generator().manual_seed(1)
    p = torch.randn(1, 3, 32, generator=g).softmax(-1)
    values = []
    for alpha in (0.0, 0.25, 0.5, 1.0):  # the student drifts from the teacher's shape towards uniform
        q = (1 - alpha) * p + alpha / 32
        values.append(float(uld_loss(q.log(), p.log())))
    assert values[0] == pytest.approx(0.0, abs=1e-6) and values == sorted(values) and values[-1] > 0.1, values
    # top-2 of a teacher with 0.2 outside them, against a student [0.6, 0.2, 0.1, 0.1]: |0.5-0.6| + |0.3-0.2| + 0
    t = torch.tensor([[[0.5, 0.3]]]).log()
    s = torch.tensor([[[0.1, 0.6, 0.1, 0.2]]]).log()
    assert float(uld_loss(s, t, teacher_tail=torch.tensor([[0.2]]).log())) == pytest.approx(0.2, abs=1e-6)


def test_uld_ignores_masked_positions_even_nan_teacher_ones():
    from kava_ray.core.losses import uld_loss

    g = torch.Generator().manual_seed(2)
    student = torch.randn(1, 4, 16, generator=g, requires_grad=True)
    teacher = torch.randn(1, 4, 8, generator=g).log_softmax(-1)
    mask = torch.tensor([[True, True, False, True]])
    ref = uld_loss(student, teacher, mask)
    bad_t, bad_s = teacher.clone(), student.detach().clone()
    bad_t[0, 2], bad_s[0, 2] = float("nan"), 1e4  # a padded position: the teacher's rows are anything
    bad_s.requires_grad_(True)
    loss = uld_loss(bad_s, bad_t, mask)
    loss.backward()
    assert float(loss) == pytest.approx(float(ref)) and torch.isfinite(bad_s.grad).all()
    assert (bad_s.grad[0, 2] == 0).all()


# ------------------------------------------------------------------------- hybrid (GOLD) cross-vocabulary loss


def _hybrid(student, ids, logp, t2s, tail=None, mask=None, weight=None):
    from kava_ray.core.losses import hybrid_logit_loss

    t2s = torch.as_tensor(t2s)
    hit = torch.zeros(student.shape[-1], dtype=torch.bool)
    hit[t2s[t2s >= 0]] = True
    return hybrid_logit_loss(student, ids, logp, t2s, (~hit).nonzero()[:, 0], mask, teacher_tail=tail,
                             matched_weight=weight)


@pytest.mark.parametrize("k", [40, 6])
def test_hybrid_with_one_tokenizer_is_the_same_tokenizer_kd(k):
    """The identity map (one tokenizer: every id maps to itself) leaves nothing unmatched and weight 1 on the
    matched part: the hybrid loss IS the top-k KD, and with k = the whole vocabulary the full-vocabulary KL."""
    g = torch.Generator().manual_seed(3)
    student = torch.randn(2, 5, 40, generator=g, requires_grad=True)
    ids, logp, tail = teacher_topk(torch.randn(2, 5, 40, generator=g) * 2, k)
    loss, parts = _hybrid(student, ids, logp, torch.arange(40), tail)
    assert float(parts["uld"]) == 0.0
    assert torch.allclose(loss, topk_kl_loss(student, ids, logp, teacher_tail=tail), rtol=1e-6, atol=1e-7)
    if k == 40:
        p = logp.exp()
        full = (p * (logp - student.log_softmax(-1).gather(-1, ids))).sum(-1).mean()
        assert float(loss) == pytest.approx(float(full), rel=1e-5)


def test_hybrid_is_zero_when_the_student_predicts_the_same_strings_and_grows_otherwise():
    """Teacher vocabulary of 6, student of 7: teacher ids 0, 1, 3, 5 have student tokens of the same string
    (2, 0, 1, 6); 2 and 4 have none, the student's 3, 4 and 5 have no teacher token. A student giving each
    matched string the teacher's probability, and its unmatched tokens the teacher's unmatched probabilities in
    another order, scores 0 on both parts; moving mass off a matched string raises the matched part."""
    t2s = torch.tensor([2, 0, -1, 1, -1, 6])
    p_t = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.05, 0.2])
    p_s = torch.zeros(7)
    p_s[t2s[[0, 1, 3, 5]]] = p_t[[0, 1, 3, 5]]
    p_s[3], p_s[4], p_s[5] = 0.05, 0.15, 0.0  # the unmatched mass (0.15, 0.05), permuted
    logp, ids = p_t.log().sort(descending=True)
    ids, logp = ids.view(1, 1, 6), logp.view(1, 1, 6)
    student = p_s.clamp_min(1e-30).log().view(1, 1, 7).requires_grad_(True)
    loss, parts = _hybrid(student, ids, logp, t2s)
    assert float(parts["kl"]) == pytest.approx(0.0, abs=1e-6) and float(parts["uld"]) == pytest.approx(0.0, abs=1e-6)
    moved = p_s.clone()
    moved[2], moved[5] = moved[2] - 0.2, moved[5] + 0.2  # from the teacher's top string to an unmatched one
    loss2, parts2 = _hybrid(moved.clamp_min(1e-30).log().view(1, 1, 7), ids, logp, t2s)
    assert float(parts2["kl"]) > 0.1 and float(parts2["uld"]) > 0.1 and float(loss2) > float(loss) + 0.1
    # GOLD's default weights: 4 of the teacher's 6 ids map
    assert float(loss2) == pytest.approx(4 / 6 * float(parts2["kl"]) + 2 / 6 * float(parts2["uld"]), rel=1e-6)
    loss.backward()
    assert torch.isfinite(student.grad).all()


def test_hybrid_training_moves_the_student_onto_the_teacher_s_strings():
    """Gradient steps on the hybrid loss alone bring a random student's distribution to the teacher's through the
    map (the positive control of the cross-vocabulary loss): KL part, ULD part and the loss all fall."""
    g = torch.Generator().manual_seed(4)
    t2s = torch.randperm(30, generator=g)[:20]  # teacher ids 0..19 map somewhere, 20..29 do not
    t2s = torch.cat([t2s, torch.full((10,), -1)])
    ids, logp, tail = teacher_topk(torch.randn(3, 4, 30, generator=g) * 3, 12)
    z = torch.randn(3, 4, 30, generator=g, requires_grad=True)
    opt = torch.optim.Adam([z], lr=0.1)
    first = None
    for _ in range(60):
        loss, parts = _hybrid(z, ids, logp, t2s, tail)
        first = first or (float(loss), float(parts["kl"]), float(parts["uld"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.2 * first[0] and float(parts["kl"]) < 0.2 * first[1] and float(parts["uld"]) < first[2]


def test_hybrid_ignores_masked_positions_even_nan_teacher_ones():
    g = torch.Generator().manual_seed(5)
    ids, logp, tail = teacher_topk(torch.randn(1, 4, 12, generator=g), 5)
    t2s = torch.tensor([0, 1, 2, -1, 4, 5, -1, 7, 8, 9, 10, 11])
    student = torch.randn(1, 4, 12, generator=g)
    mask = torch.tensor([[True, False, True, True]])
    ref, _ = _hybrid(student, ids, logp, t2s, tail, mask)
    bad_ids, bad_logp, bad_tail = ids.clone(), logp.clone(), tail.clone()
    bad_ids[0, 1], bad_logp[0, 1], bad_tail[0, 1] = 10 ** 6, float("nan"), float("nan")
    bad_s = student.clone()
    bad_s[0, 1] = 1e4
    bad_s.requires_grad_(True)
    loss, _ = _hybrid(bad_s, bad_ids, bad_logp, t2s, bad_tail, mask)
    loss.backward()
    assert float(loss) == pytest.approx(float(ref)) and torch.isfinite(bad_s.grad).all()
    assert (bad_s.grad[0, 1] == 0).all()
