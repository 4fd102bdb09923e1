"""Alignment metrics that a constant cannot fake: the centred cosine, the shared-prefix token mask,
and the Distiller's cos_sim / cos_raw / cos/<t> / cos_raw/<t> (issue 10, items 2 and 3)."""

import pytest
import torch

from kava_ray.core.losses import contrast_gap, cos_metrics, drop_shared_prefix, kv_loss
from kava_ray.recipes.report import phase

L, B, H, T, D = 3, 4, 3, 12, 16


def _keys(seed=0):
    """Key-like data: a large per-layer mean + a per-(layer, head) offset + small per-token content,
    so one constant per (layer, head) — or even per layer — is a good *raw* fit (as on real keys)."""
    g = torch.Generator().manual_seed(seed)
    layer = 6 * torch.randn(L, 1, 1, 1, D, generator=g)
    head = 3 * torch.randn(L, 1, H, 1, D, generator=g)

    def sample():
        return layer + head + 2 * torch.randn(L, B, H, T, D, generator=g)

    return layer, head, sample


def _mask():
    m = torch.ones(B, T)
    m[1, 9:] = 0  # right padding
    m[3, 5:] = 0
    return m


@pytest.mark.parametrize("per", ["layer_head", "layer"])
def test_constant_projector_scores_zero_centred_but_high_raw(per):
    layer, head, sample = _keys()
    student, m = sample(), _mask()
    const = (layer + head if per == "layer_head" else layer).expand(L, B, H, T, D)  # ignores its input
    _, met = kv_loss("mercator", student, const, m)
    assert abs(float(met["cos_sim"])) < 0.05
    assert float(met["cos_raw"]) > 0.5
    assert all(abs(float(c)) < 0.05 for c in met["cos_per_layer"])
    assert phase(float(met["cos_sim"])) == "Adapting"
    assert phase(float(met["cos_raw"])) != "Adapting"  # what the raw cosine would have claimed
    # the same holds for the constant a projector bias would actually learn: the target's masked mean
    target = sample()
    w = m[None, :, None, :, None]
    learned = ((target * w).sum(dim=(1, 3), keepdim=True) / w.sum(dim=(1, 3), keepdim=True)).expand_as(target)
    assert abs(float(cos_metrics(student, learned, m)["cos_sim"])) < 0.05


def test_identical_student_scores_one_and_other_sample_zero():
    _, _, sample = _keys(1)
    target, m = sample(), _mask()
    assert float(cos_metrics(target.clone(), target, m)["cos_sim"]) > 0.99
    g = torch.Generator().manual_seed(2)
    student = target + 0.5 * torch.randn(target.shape, generator=g)
    own = cos_metrics(student, target, m)
    assert float(own["cos_sim"]) > 0.9
    both = (m.bool() & m.bool().roll(1, 0)).float()
    shuffled = cos_metrics(student, target.roll(1, dims=1), both)  # another sample's target
    assert abs(float(shuffled["cos_sim"])) < 0.1
    assert float(shuffled["cos_raw"]) > 0.5  # the raw cosine is flattered by the shared constant
    assert float(contrast_gap(student, target, m)) > 0.8


def test_padding_does_not_change_the_centred_metric():
    """Garbage at padded positions, and extra all-padding columns, leave cos_sim / cos_raw as they were."""
    _, _, sample = _keys(3)
    student, target, m = sample(), sample(), _mask()
    base = cos_metrics(student, target, m)
    g = torch.Generator().manual_seed(4)
    pad = 8
    ext = lambda x: torch.cat([x, 1e4 * torch.randn(L, B, H, pad, D, generator=g)], dim=3)  # noqa: E731
    m_ext = torch.cat([m, torch.zeros(B, pad)], dim=1)
    keep = m[None, :, None, :, None].bool()
    junk_s = torch.where(keep, student, 1e4 * torch.randn(student.shape, generator=g))
    for s, t, mask in ((ext(student), ext(target), m_ext), (junk_s, target, m)):
        got = cos_metrics(s, t, mask)
        for key in ("cos_sim", "cos_raw"):
            assert float(got[key]) == pytest.approx(float(base[key]), rel=1e-5), key


def test_bf16_constant_still_scores_zero():
    """Centring runs in float32: a bf16 constant leaves no rounding residue with a direction of its own."""
    layer, head, sample = _keys(5)
    student = sample().bfloat16()
    const = (layer + head).expand(L, B, H, T, D).bfloat16()
    met = cos_metrics(student, const)
    assert abs(float(met["cos_sim"])) < 0.05 and float(met["cos_raw"]) > 0.5


# ------------------------------------------------------------------------------------ shared prefix


def test_shared_prefix_is_excluded():
    ids = torch.tensor([[1, 2, 3, 7, 9, 5, 0, 0],
                        [1, 2, 3, 8, 9, 6, 6, 6],
                        [1, 2, 3, 7, 9, 5, 4, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 1, 1, 1, 0]])
    keep = drop_shared_prefix(ids, mask)
    assert keep.dtype == torch.bool and keep.shape == ids.shape
    expected = mask.bool().clone()
    expected[:, :3] = False  # the leading run identical in every sample; position 4 (all 9) is not leading
    assert torch.equal(keep, expected)
    # the padding id equal to a real token does not make padding "shared"
    ids2, mask2 = ids.clone(), mask.clone()
    ids2[:, 3] = 7
    mask2[0, 3:] = 0  # sample 0 ends inside the otherwise shared run: the run stops there
    keep2 = drop_shared_prefix(ids2, mask2)
    assert not keep2[:, :3].any() and torch.equal(keep2[:, 3:], mask2[:, 3:].bool())


def test_shared_prefix_edge_cases():
    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.ones(1, 4, dtype=torch.long)
    # B == 1: every position is trivially shared; dropping it would leave nothing, so nothing is dropped
    assert torch.equal(drop_shared_prefix(ids, mask), mask.bool())
    # identical samples: nothing tells template from content, nothing is dropped
    twins = ids.expand(3, 4)
    assert torch.equal(drop_shared_prefix(twins, torch.ones(3, 4)), torch.ones(3, 4, dtype=torch.bool))
    # left padding: position 0 is not real in every sample, so there is no shared prefix
    left = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 5]])
    lmask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(drop_shared_prefix(left, lmask), lmask.bool())
    # nothing shared at all
    diff = torch.tensor([[1, 2], [3, 4]])
    assert drop_shared_prefix(diff, torch.ones(2, 2)).all()


# ------------------------------------------------------------------------------------ the Distiller


@pytest.fixture(scope="module")
def distill_setup(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir):
    """A job over two fp32 tiny teachers, one batch, and the teachers' KV for it (no Ray)."""
    from jobs import write_job
    from kava_ray.common.config import load_config
    from kava_ray.core.models import load_model
    from kava_ray.core.plans import student_tokenizer
    from kava_ray.data import BatchStream
    from kava_ray.data.splits import load_splits

    path = write_job(tmp_path_factory.mktemp("align"), tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"},
                               {"name": "llama", "model": str(tiny_llama_dir), "dtype": "float32"}])
    cfg = load_config(path)
    tok, _ = student_tokenizer(cfg.student)
    train, _ = load_splits(cfg.data, cfg.train, tok)
    _, _, _, batch = BatchStream(train, 4, 0).next()
    teachers = {t.name: load_model(t.model, dtype="float32") for t in cfg.teachers}
    return path, batch, teachers


def _distiller(distill_setup, overrides):
    from kava_ray.common.config import load_config
    from kava_ray.core.align.layers import plan_teacher_layers
    from kava_ray.core.kv import teacher_forward_kv
    from kava_ray.core.models import kv_geometry, load_student
    from kava_ray.core.plans import TeacherPlan
    from kava_ray.recipes.build import build_distiller

    path, batch, teachers = distill_setup
    cfg = load_config(path, ["align.projector.kind=elastic", *overrides])
    torch.manual_seed(0)
    student = load_student(cfg.student.model, dtype="float32")
    s_geom = kv_geometry(student)
    plans, kv = {}, {}
    for name, model in teachers.items():
        g = kv_geometry(model)
        lm, layers = plan_teacher_layers("ratio", g.num_layers, s_geom.num_layers, mode=cfg.align.mode)
        plans[name] = TeacherPlan(name, g, lm, layers)
        kv[name] = teacher_forward_kv(model, batch.input_ids, batch.attention_mask, layers=layers)
    return build_distiller(student, plans, s_geom, cfg), batch, kv


@pytest.mark.parametrize("fusion", ["fixed", "sum"])
def test_distiller_reports_centred_and_raw_cosines(distill_setup, fusion):
    distiller, batch, kv = _distiller(distill_setup, [f"fusion.kind={fusion}"])
    m = distiller(batch, kv).metrics
    names = {"cos_sim", "cos_raw", "contrast_gap", "cos_layer/first", "cos/qwen", "cos_raw/qwen", "cos/llama",
             "cos_raw/llama"}
    assert set(m) >= names
    for k in names:  # detached 0-d tensors: the worker converts them once per log step
        assert isinstance(m[k], torch.Tensor) and m[k].dim() == 0 and not m[k].requires_grad, k
        assert -1.0 <= float(m[k]) <= 1.0 or k == "contrast_gap", k

    # a projector that ignores its input (a constant per (layer, head): what its bias alone gives)
    real = {n: distiller.projectors[n](kv[n].keys, kv[n].values) for n in distiller.names}
    for n, proj in distiller.projectors.items():
        consts = [x.detach().mean(dim=(1, 3), keepdim=True).expand_as(x) for x in real[n]]
        proj.forward = lambda k, v, c=consts: tuple(c)
    m = distiller(batch, kv).metrics
    for k in ("cos_sim", "cos/qwen", "cos/llama"):
        assert abs(float(m[k])) < 0.05, (k, float(m[k]))
    assert phase(float(m["cos_sim"])) == "Adapting"
    # (tiny random students have no large per-head constant, so their raw cosine is low here too:
    # the raw-vs-centred gap is shown on key-like data above)
    assert abs(float(m["contrast_gap"])) < 0.05


def test_the_distiller_returns_its_kv_term_and_student_kv_when_asked_and_keeps_nothing(distill_setup):
    """`Distiller.forward` returns a `DistillOutput`: the KV term (the recipe's grad/kv_share) and the student's own
    KV (evaluation's projector-free cosine) only when asked, nothing left on the module for a later reader."""
    from kava_ray.core.kv import KVBatch

    distiller, batch, kv = _distiller(distill_setup, ["align.projector.dropout=0.0"])
    before = set(vars(distiller))
    plain = distiller(batch, kv)
    assert plain.kv_term is None and plain.student_kv is None
    out = distiller(batch, kv, output_kv_term=True, output_student_kv=True)
    assert set(vars(distiller)) == before
    assert torch.equal(out.loss, plain.loss) and out.loss.requires_grad
    kv_weight = distiller.loss_cfg.kv_weight
    assert out.kv_term.requires_grad and torch.equal(out.kv_term.detach(), kv_weight * out.metrics["kv_loss"])
    grads = torch.autograd.grad(out.kv_term, list(distiller.student.parameters()), allow_unused=True)
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads)  # it reaches the student
    skv = out.student_kv
    assert isinstance(skv, KVBatch) and skv.keys.shape[1] == batch.input_ids.shape[0]
    assert skv.keys.shape[3] == batch.input_ids.shape[1] and skv.keys.shape == skv.values.shape


@pytest.mark.parametrize("kind", ["mercator", "hybrid"])
def test_center_loss_trains(distill_setup, kind):
    """loss.center=true: the centred KV loss falls and the centred cosine rises over a few steps."""
    from kava_ray.common.config import load_config
    from tiny_models import train_on_one_batch

    distiller, batch, kv = _distiller(distill_setup, ["loss.center=true", f"loss.kind={kind}", "fusion.kind=gate"])
    assert distiller.loss_cfg.center is True
    history = [{k: float(v) for k, v in m.items() if isinstance(v, torch.Tensor)}
               for m in train_on_one_batch(distiller, load_config(distill_setup[0]).optim, batch, kv, steps=5)]
    assert history[-1]["kv_loss"] < history[0]["kv_loss"]
    assert history[-1]["cos_sim"] > history[0]["cos_sim"]


def test_no_shared_prefix_masks_the_template(distill_setup):
    distiller, batch, kv = _distiller(distill_setup, ["loss.loss_tokens=no_shared_prefix"])
    keep = drop_shared_prefix(batch.input_ids, batch.attention_mask)
    assert keep.sum() < batch.attention_mask.sum()  # the chat template's system prompt is shared
    assert not keep[:, 0].any()
    torch.manual_seed(0)
    m = distiller(batch, kv).metrics
    full, _, _ = _distiller(distill_setup, ["loss.loss_tokens=all"])
    torch.manual_seed(0)
    m_all = full(batch, kv).metrics
    assert float(m["kv_loss"]) != pytest.approx(float(m_all["kv_loss"]), rel=1e-4)
    assert float(m["ce"]) == pytest.approx(float(m_all["ce"]), rel=1e-5)  # CE is not a KV loss
