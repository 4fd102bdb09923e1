import math

import pytest
import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.losses import (
    LOSSES,
    contrast_gap,
    hybrid_loss,
    kv_loss,
    masked_ce,
    mercator_loss,
    mse_loss,
    smooth_l1_loss,
)

SHAPE = (2, 3, 2, 5, 8)  # [L, B, H, T, D]


def _pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def _mask():
    m = torch.ones(3, 5)
    m[0, 3:] = 0
    m[2, :1] = 0
    m[2, 4] = 0
    return m


def test_mercator_parallel_is_zero_and_opposite_is_two():
    s, _ = _pair()
    scales = torch.rand(SHAPE[:-1] + (1,)) * 10 + 0.1  # different length per vector
    loss, metrics = mercator_loss(s, s * scales)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert metrics["cos_raw"] == pytest.approx(1.0, abs=1e-6)
    loss, metrics = mercator_loss(s, -s * scales)
    assert loss.item() == pytest.approx(2.0, abs=1e-6)
    assert metrics["cos_raw_per_layer"] == pytest.approx([-1.0, -1.0], abs=1e-6)
    # one scale for the whole batch keeps the centred cosine at +-1 too (per-vector scales would not)
    assert mercator_loss(s, 3 * s)[1]["cos_sim"] == pytest.approx(1.0, abs=1e-6)
    assert mercator_loss(s, -3 * s)[1]["cos_per_layer"] == pytest.approx([-1.0, -1.0], abs=1e-6)
    # alpha scales the direction term
    assert mercator_loss(s, -s, alpha=0.5)[0].item() == pytest.approx(1.0, abs=1e-6)


def test_mercator_beta_term_matches_hand_computation():
    # two tokens: |s| = 5, |t| = 10 (parallel) and |s| = 1, |t| = 1 (orthogonal)
    s = torch.zeros(1, 1, 1, 2, 2)
    t = torch.zeros(1, 1, 1, 2, 2)
    s[..., 0, :] = torch.tensor([3.0, 4.0])
    t[..., 0, :] = torch.tensor([6.0, 8.0])
    s[..., 1, :] = torch.tensor([1.0, 0.0])
    t[..., 1, :] = torch.tensor([0.0, 1.0])
    mag = (math.log(5.0) - math.log(10.0)) ** 2 / 2  # second token contributes 0
    cos_term = 1 - (1.0 + 0.0) / 2
    loss, metrics = mercator_loss(s, t, alpha=1.0, beta=0.3)
    assert metrics["mag_term"] == pytest.approx(mag, rel=1e-5)
    assert metrics["cos_term"] == pytest.approx(cos_term, abs=1e-6)
    assert loss.item() == pytest.approx(cos_term + 0.3 * mag, rel=1e-5)
    # beta=0 leaves the magnitude out of the loss (still reported)
    assert mercator_loss(s, t)[0].item() == pytest.approx(cos_term, abs=1e-6)


def test_mse_smooth_l1_hybrid_values():
    s, t = _pair()
    assert mse_loss(s, t)[0].item() == pytest.approx(((s - t) ** 2).mean().item(), rel=1e-5)
    d = s - t
    huber = torch.where(d.abs() < 1, 0.5 * d**2, d.abs() - 0.5).mean()
    assert smooth_l1_loss(s, t)[0].item() == pytest.approx(huber.item(), rel=1e-5)
    merc = mercator_loss(s, t, alpha=2.0, beta=0.1)[0].item()
    mse = mse_loss(s, t)[0].item()
    loss, metrics = hybrid_loss(s, t, weight=0.3, alpha=2.0, beta=0.1)
    assert loss.item() == pytest.approx(0.3 * merc + 0.7 * mse, rel=1e-5)
    assert metrics["mercator"] == pytest.approx(merc, rel=1e-5) and metrics["mse"] == pytest.approx(mse, rel=1e-5)


def test_masked_mean_counts_only_real_tokens():
    s, t = _pair()
    m = _mask()
    keep = m.bool()[None, :, None, :, None].expand(SHAPE)
    expected = ((s - t) ** 2)[keep].mean()
    assert mse_loss(s, t, m)[0].item() == pytest.approx(expected.item(), rel=1e-5)
    cos = torch.nn.functional.cosine_similarity(s, t, dim=-1)
    _, metrics = mercator_loss(s, t, m)
    assert metrics["cos_raw"] == pytest.approx(cos[keep[..., 0]].mean().item(), rel=1e-5)
    assert metrics["n_tokens"] == int(m.sum())


def _num(v):
    """Metrics are detached tensors (0-d, or a list of them per layer): plain numbers to compare."""
    return [float(x) for x in v] if isinstance(v, list) else float(v)


@pytest.mark.parametrize("center", [False, True], ids=["raw", "centred"])
@pytest.mark.parametrize("kind", list(LOSSES))
def test_padding_values_change_nothing(kind, center):
    s, t = _pair(1)
    m = _mask()
    pad = ~m.bool()[None, :, None, :, None].expand(SHAPE)
    g = torch.Generator().manual_seed(7)
    s2 = torch.where(pad, 1e30 * torch.randn(SHAPE, generator=g), s)
    t2 = torch.where(pad, -1e30 * torch.randn(SHAPE, generator=g), t)
    s3 = torch.where(pad, torch.zeros(()), s)  # zero vectors at padding
    s2.requires_grad_(True)
    s3.requires_grad_(True)
    kw = dict(alpha=1.0, beta=0.5, hybrid_weight=0.4, center=center)
    base_loss, base_metrics = kv_loss(kind, s, t, m, **kw)
    for student, target in ((s2, t2), (s3, t)):
        loss, metrics = kv_loss(kind, student, target, m, **kw)
        assert loss.item() == pytest.approx(base_loss.item(), rel=1e-6)
        assert metrics.keys() == base_metrics.keys()
        for key, value in base_metrics.items():
            assert _num(metrics[key]) == pytest.approx(_num(value), rel=1e-6), key
        loss.backward()
        assert torch.isfinite(student.grad).all()
        assert torch.count_nonzero(student.grad[pad]) == 0
        assert torch.count_nonzero(student.grad[~pad]) > 0
    # and with the mask removed the garbage does change the loss: the mask is doing the work
    assert kv_loss(kind, s2.detach(), t2, None, **kw)[0].item() != pytest.approx(base_loss.item(), rel=1e-3)


def test_nan_at_padding_is_ignored():
    s, t = _pair(2)
    m = _mask()
    pad = ~m.bool()[None, :, None, :, None].expand(SHAPE)
    s_nan = torch.where(pad, torch.full((), float("nan")), s).requires_grad_(True)
    loss, metrics = mercator_loss(s_nan, t, m, beta=1.0)
    assert loss.item() == pytest.approx(mercator_loss(s, t, m, beta=1.0)[0].item(), rel=1e-6)
    loss.backward()
    assert torch.isfinite(s_nan.grad).all()


def test_all_padding_gives_zero_loss():
    s, t = _pair()
    loss, metrics = mercator_loss(s, t, torch.zeros(3, 5))
    assert loss.item() == 0.0 and metrics["n_tokens"] == 0 and metrics["cos_sim"] == 0.0
    assert metrics["cos_raw"] == 0.0
    for kind in LOSSES:
        for center in (False, True):
            assert kv_loss(kind, s, t, torch.zeros(3, 5), beta=1.0, center=center)[0].item() == 0.0


def test_contrast_gap():
    g = torch.Generator().manual_seed(3)
    shared = torch.randn(2, 1, 2, 5, 8, generator=g).expand(SHAPE)  # same target for every sample
    student = torch.randn(SHAPE, generator=g)
    m = _mask()
    assert contrast_gap(student, shared, m) == pytest.approx(0.0, abs=1e-6)
    assert contrast_gap(shared + 0.1 * torch.randn(SHAPE, generator=g), shared, m) == pytest.approx(0.0, abs=1e-6)
    specific = torch.randn(SHAPE, generator=g)
    gap = contrast_gap(specific + 0.3 * torch.randn(SHAPE, generator=g), specific, m)
    assert gap > 0.5
    assert contrast_gap(specific[:, :1], specific[:, :1]) == 0.0  # B == 1: nothing to compare with
    # padded positions (of the sample or of the rolled one) are excluded: garbage there changes nothing
    pad = ~m.bool()[None, :, None, :, None].expand(SHAPE)
    noisy = specific + 0.3 * torch.randn(SHAPE, generator=g)
    garbage_t = torch.where(pad, 1e6 * torch.randn(SHAPE, generator=g), specific)
    garbage_s = torch.where(pad, 1e6 * torch.randn(SHAPE, generator=g), noisy)
    assert contrast_gap(garbage_s, garbage_t, m) == pytest.approx(float(contrast_gap(noisy, specific, m)), rel=1e-6)
    assert contrast_gap(garbage_s, garbage_t) != pytest.approx(float(contrast_gap(noisy, specific)), rel=1e-3)
    assert contrast_gap(noisy, specific, torch.eye(3, 5)) == 0.0  # no token real in both samples


def test_masked_ce_matches_manual_shifted_ce():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, :3] = -100
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
    assert masked_ce(logits, labels).item() == pytest.approx(expected.item(), rel=1e-6)
    keep = labels[:, 1:] != -100
    manual = -torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp_min(0)[..., None])[..., 0][keep]
    assert masked_ce(logits, labels).item() == pytest.approx(manual.mean().item(), rel=1e-5)
    none = torch.full((2, 6), -100)
    out = masked_ce(logits, none)
    assert out.item() == 0.0 and out.requires_grad


def test_bad_inputs():
    s, t = _pair()
    with pytest.raises(KavaError, match="'cosine'"):
        kv_loss("cosine", s, t)
    with pytest.raises(KavaError, match="mask"):
        mercator_loss(s, t, torch.ones(3, 4))
    with pytest.raises(KavaError, match="one shape"):
        mse_loss(s, t[:1])
    with pytest.raises(KavaError, match="hybrid weight"):
        hybrid_loss(s, t, weight=1.5)


def test_center_option_uses_centred_cosine_and_keeps_magnitude_term():
    """loss.center: the cosine term is 1 - centred cos; the beta (log-norm) term stays on raw norms."""
    s, t = _pair(5)
    m = _mask()
    raw_loss, raw_m = mercator_loss(s, t, m, beta=0.3)
    loss, met = mercator_loss(s, t, m, beta=0.3, center=True)
    assert met["cos_term"] == pytest.approx(1 - float(met["cos_sim"]), abs=1e-6)
    assert raw_m["cos_term"] == pytest.approx(1 - float(raw_m["cos_raw"]), abs=1e-6)
    assert met["mag_term"] == pytest.approx(float(raw_m["mag_term"]), rel=1e-6)
    for key in ("cos_sim", "cos_raw"):  # the metrics do not depend on which cosine the loss uses
        assert float(met[key]) == pytest.approx(float(raw_m[key]), rel=1e-6)
    # a constant target per (layer, head): the raw cosine can be fitted, the centred term cannot (~1)
    const = t.mean(dim=(1, 3), keepdim=True).expand(SHAPE) + 3.0
    assert mercator_loss(s, const, m, center=True)[1]["cos_term"] == pytest.approx(1.0, abs=1e-3)
    # hybrid forwards center to its mercator part
    h, hm = hybrid_loss(s, t, m, weight=0.5, beta=0.3, center=True)
    assert hm["mercator"] == pytest.approx(loss.item(), rel=1e-6)
    # gradients flow (through the centring means too) and stay finite
    s_req = s.clone().requires_grad_(True)
    mercator_loss(s_req, t, m, center=True)[0].backward()
    assert torch.isfinite(s_req.grad).all() and torch.count_nonzero(s_req.grad) > 0


def test_centred_contrast_gap_vs_raw():
    """A shared per-head constant compresses the raw gap; the centred gap reads on cos_sim's scale."""
    g = torch.Generator().manual_seed(11)
    base = 10 * torch.randn(2, 1, 2, 1, 8, generator=g)  # per (layer, head), shared by every sample
    target = base + torch.randn(SHAPE, generator=g)
    student = target + 0.3 * torch.randn(SHAPE, generator=g)
    centred, raw = contrast_gap(student, target), contrast_gap(student, target, centered=False)
    assert centred > 0.8 and 0 < raw < 0.1
    cos = mercator_loss(student, target)[1]["cos_sim"]
    assert float(centred) == pytest.approx(float(cos), abs=0.15)


# ------------------------------------------------------------------------------ MiniLMv2 relation loss (issue 39)


def _relation_by_hand(s, t, lengths, heads):
    """bloomberg/minilmv2.bb `_get_kl_loss`, one sequence at a time (rows and columns sliced to its length n),
    with the decoder's causal mask: sum of KL(R_T || R_S) over keys, / (heads * n), mean over sequences, layers."""
    def rel(x, layer, b, n):  # [heads, n, n]
        H, T, D = x.shape[2], x.shape[3], x.shape[4]
        d_r = H * D // heads
        r = x[layer, b].permute(1, 0, 2).reshape(T, H * D)[:n].double().reshape(n, heads, d_r).transpose(0, 1)
        return r @ r.transpose(-1, -2) / math.sqrt(d_r)

    total, (L, B) = 0.0, s.shape[:2]
    for layer in range(L):
        for b, n in enumerate(lengths):
            rs, rt = rel(s, layer, b, n), rel(t, layer, b, n)
            kl = 0.0
            for h in range(heads):
                for i in range(n):
                    ps, pt = torch.log_softmax(rs[h, i, : i + 1], -1), torch.log_softmax(rt[h, i, : i + 1], -1)
                    kl += float((pt.exp() * (pt - ps)).sum())
            total += kl / (heads * n)
    return total / (L * B)


def test_relation_loss_matches_minilmv2_by_hand_across_head_counts():
    from kava_ray.core.losses import relation_loss

    torch.manual_seed(0)
    s = torch.randn(2, 3, 2, 7, 8)  # [L, B, H_s=2, T, D=8]
    t = torch.randn(2, 3, 4, 7, 4)  # [L, B, H_t=4, T, D=4]: another head count, the same 32 features
    lengths = [7, 5, 3]  # right padding
    mask = torch.zeros(3, 7)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    for heads in (1, 2, 4):
        got = float(relation_loss(s, t, mask, heads))
        assert got == pytest.approx(_relation_by_hand(s, t, lengths, heads), rel=1e-5)
    assert float(relation_loss(t, t, mask, 2)) == pytest.approx(0.0, abs=1e-6)  # its own relations: no loss


def test_relation_loss_trains_the_student_side_only():
    from kava_ray.core.losses import relation_loss

    torch.manual_seed(1)
    s = torch.randn(1, 2, 2, 5, 8, requires_grad=True)
    t = torch.randn(1, 2, 2, 5, 8, requires_grad=True)
    relation_loss(s, t, torch.ones(2, 5), 2).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and t.grad is None


def test_hidden_cosine_loss_matches_modelopt_by_hand():
    """ModelOpt's HiddenStateCosineLoss per token (1 - cos, no reduction), Megatron's masked mean over tokens, the
    mean over layer pairs; the teacher side gets no gradient."""
    import torch.nn.functional as F

    from kava_ray.core.losses import hidden_cosine_loss

    torch.manual_seed(0)
    s = torch.randn(3, 2, 5, 8, requires_grad=True)  # [L, B, T, h]
    t = torch.randn(3, 2, 5, 8, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    by_hand = []
    for layer in range(3):
        terms = [1 - float(F.cosine_similarity(s[layer, b, i], t[layer, b, i], dim=0))
                 for b in range(2) for i in range(5) if mask[b, i]]
        by_hand.append(sum(terms) / len(terms))
    loss = hidden_cosine_loss(s, t, mask)
    assert float(loss) == pytest.approx(sum(by_hand) / 3, rel=1e-5)
    loss.backward()
    assert s.grad.abs().sum() > 0 and t.grad is None
    assert float(hidden_cosine_loss(t, 2.0 * t, mask)) == pytest.approx(0.0, abs=1e-6)  # scale-free
