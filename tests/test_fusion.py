import pytest
import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.fusion import Fusion

SHAPE = (3, 2, 2, 5, 4)  # [L, B, H, T, D]


def _targets(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


def by_direction(ps, ws):
    """Hand-computed fusion by direction: unit(sum w_i unit(p_i)) * prod |p_i|^w_i (over the last dim)."""
    d = sum(w * p / p.norm(dim=-1, keepdim=True) for w, p in zip(ws, ps))
    mag = torch.exp(sum(w * p.norm(dim=-1, keepdim=True).log() for w, p in zip(ws, ps)))
    return d / d.norm(dim=-1, keepdim=True) * mag


def test_fixed_is_hand_weighted_direction():
    p = _targets(3)
    fused = Fusion("fixed", 3, weights=[1.0, 3.0, 4.0])(p)
    assert torch.allclose(fused, by_direction(p, [0.125, 0.375, 0.5]), atol=1e-5)
    eq = Fusion("fixed", 3, names=["a", "b", "c"])
    assert torch.allclose(eq(p), by_direction(p, [1 / 3] * 3), atol=1e-5)
    assert torch.allclose(Fusion("fixed", 1)(p[:1]), p[0], atol=1e-5)  # one teacher: its own target
    assert eq.current_weights() == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert list(eq.parameters()) == []


@pytest.mark.parametrize("per_layer", [False, True])
def test_gate_weights_sum_to_one_and_learn(per_layer):
    p = _targets(2)
    fusion = Fusion("gate", 2, n_layers=3, weights=[1.0, 3.0], per_layer=per_layer)
    w = fusion.weights()
    assert w.shape == ((3 if per_layer else 1), 2)
    assert torch.allclose(w.sum(-1), torch.ones(w.shape[0]))
    assert torch.allclose(w, torch.tensor([0.25, 0.75]).expand_as(w))  # init from weights
    fused = fusion(p)
    assert torch.allclose(fused, by_direction(p, [0.25, 0.75]), atol=1e-5)
    target = p[0].clone()  # loss prefers teacher 0
    ((fused - target) ** 2).mean().backward()
    grad = fusion.logits.grad
    assert grad is not None and torch.count_nonzero(grad) > 0
    opt = torch.optim.SGD(fusion.parameters(), lr=1.0)
    opt.step()
    assert fusion.current_weights()["teacher_0"] > 0.25


def test_gate_per_layer_weights_apply_per_layer():
    p = _targets(2)
    fusion = Fusion("gate", 2, n_layers=3, per_layer=True)
    with torch.no_grad():
        fusion.logits.copy_(torch.tensor([[0.0, 0.0], [10.0, -10.0], [-10.0, 10.0]]))
    fused = fusion(p)
    assert torch.allclose(fused[0], by_direction([p[0][0], p[1][0]], [0.5, 0.5]), atol=1e-5)
    assert torch.allclose(fused[1], p[0][1], atol=1e-5)
    assert torch.allclose(fused[2], p[1][2], atol=1e-5)
    with pytest.raises(KavaError, match="3 layers"):
        fusion([x[:2] for x in p])


def test_router_per_token_weights():
    p = _targets(3)
    fusion = Fusion("router", 3, weights=[2.0, 1.0, 1.0], feature_dim=6)
    feature = torch.randn(2, 5, 6)  # [B, T, F]
    w0 = fusion.weights(feature)
    assert torch.allclose(w0, torch.tensor([0.5, 0.25, 0.25]).expand(2, 5, 3), atol=1e-6)  # starts at prior
    torch.nn.init.normal_(fusion.router.weight)
    w = fusion.weights(feature)
    assert w.shape == (2, 5, 3)
    assert torch.allclose(w.sum(-1), torch.ones(2, 5), atol=1e-6)
    assert w[0, 0].sub(w[1, 3]).abs().max() > 1e-3  # weights differ per token
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    fused = fusion(p, feature, mask)
    b, t = 1, 2
    expected = by_direction([x[:, b, :, t] for x in p], [w[b, t, i] for i in range(3)])
    assert torch.allclose(fused[:, b, :, t], expected, atol=1e-5)
    logged = fusion.current_weights()
    keep = mask.bool()
    assert logged["teacher_0"] == pytest.approx(w[keep][:, 0].mean().item(), rel=1e-5)
    assert sum(logged.values()) == pytest.approx(1.0)
    fused.pow(2).mean().backward()
    assert torch.count_nonzero(fusion.router.weight.grad) > 0
    with pytest.raises(KavaError, match="feature"):
        fusion(p)


def test_sum_combines_losses():
    fusion = Fusion("sum", 2, weights=[1.0, 3.0])
    assert not fusion.fuses_targets
    assert Fusion("fixed", 2).fuses_targets
    assert fusion(_targets(2)) is None
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(4.0, requires_grad=True)
    total = fusion.combine_losses([a, b])
    assert total.item() == pytest.approx(0.25 * 2.0 + 0.75 * 4.0)
    total.backward()
    assert a.grad.item() == pytest.approx(0.25) and b.grad.item() == pytest.approx(0.75)
    assert fusion.current_weights() == pytest.approx({"teacher_0": 0.25, "teacher_1": 0.75})
    with pytest.raises(KavaError, match="'sum'"):
        Fusion("fixed", 2).combine_losses([a, b])


@pytest.mark.parametrize(
    "kwargs,word",
    [
        (dict(kind="mix", n_teachers=2), "'mix'"),
        (dict(kind="fixed", n_teachers=2, weights=[1.0]), "1 entries"),
        (dict(kind="fixed", n_teachers=2, weights=[1.0, -0.5]), "-0.5"),
        (dict(kind="gate", n_teachers=2, weights=[0.0, 0.0]), "sum to 0"),
        (dict(kind="router", n_teachers=2), "feature_dim"),
        (dict(kind="fixed", n_teachers=0), "n_teachers"),
    ],
)
def test_bad_fusion_config(kwargs, word):
    with pytest.raises(KavaError, match=word):
        Fusion(**kwargs)


def test_wrong_number_of_targets():
    with pytest.raises(KavaError, match="expected 3"):
        Fusion("fixed", 3)(_targets(2))


def _fusion_of(kind, n=2):
    fusion = Fusion(kind, n, n_layers=SHAPE[0], weights=[0.5, 0.5], feature_dim=6)
    if kind == "router":
        torch.nn.init.normal_(fusion.router.weight, std=0.3)  # weights that differ per token
    return fusion


@pytest.mark.parametrize("kind", ["fixed", "gate", "router"])
def test_projector_scale_does_not_buy_direction(kind):
    """x10 on one projector's output leaves the fused direction unchanged; the teachers keep their shares."""
    g = torch.Generator().manual_seed(5)
    p = [torch.randn(SHAPE, generator=g) for _ in range(2)]  # two unrelated teachers
    feature = torch.randn(SHAPE[1], SHAPE[3], 6, generator=g)
    fusion = _fusion_of(kind)
    fused = fusion(p, feature)
    scaled = fusion([p[0] * 10, p[1]], feature)
    assert torch.nn.functional.cosine_similarity(fused, scaled, dim=-1).min() > 0.999
    # the magnitude (for the beta term) moves by the teacher's log-norm share: x10 ** w_0 per token
    w0 = fusion.weights(feature)[..., 0]
    w0 = w0[None, :, None, :] if kind == "router" else w0.reshape(-1)[0]
    ratio = scaled.norm(dim=-1) / fused.norm(dim=-1)
    assert torch.allclose(ratio, (10 ** w0).expand_as(ratio), rtol=1e-4)
    if kind == "fixed":  # at 0.5 / 0.5 each teacher has its share of the direction (raw sums: 0.995 / 0.067)
        cos = [torch.nn.functional.cosine_similarity(scaled, x, dim=-1).mean().item() for x in p]
        assert cos[0] == pytest.approx(cos[1], abs=0.05) and min(cos) > 0.6


def test_fusion_by_direction_is_eps_safe_and_keeps_dtype():
    p = _targets(2)
    p[0][:, 0] = 0.0  # a zero vector has no direction: the other teacher's direction, a tiny magnitude
    p = [x.requires_grad_(True) for x in p]
    fused = Fusion("fixed", 2)(p)
    assert torch.isfinite(fused).all()
    fused.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in p)
    half = Fusion("fixed", 2)([x.detach().bfloat16() for x in p])
    assert half.dtype == torch.bfloat16 and torch.isfinite(half.float()).all()


def test_centred_fusion_fuses_the_centred_directions_and_keeps_the_means():
    """With loss.center, each teacher is centred per (layer, head) over the counted tokens, the centred vectors
    are fused by direction, and the weighted mean of the means is added back, so each teacher's weight is its
    share of the centred target the loss compares."""
    from kava_ray.core.losses import token_mean

    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(SHAPE, generator=g) for _ in range(2))
    a = a + 50.0  # teacher a: a huge constant direction on every token
    mask = torch.ones(SHAPE[1], SHAPE[3])
    mask[1, -2:] = 0
    m = (mask != 0)[None, :, None, :]
    w = [0.5, 0.5]
    fused = Fusion("fixed", 2, center=True)([a, b], mask=mask)
    mus = [token_mean(x, m) for x in (a, b)]
    want = by_direction([a - mus[0], b - mus[1]], w) + 0.5 * (mus[0] + mus[1])
    assert torch.allclose(fused, want, atol=1e-4)
    # the fused centred direction weighs both teachers equally: its cosine with each centred teacher is the same
    fc = fused - 0.5 * (mus[0] + mus[1])
    def mean_cos(x, y):
        c = torch.nn.functional.cosine_similarity(x, y, dim=-1)  # [L, B, H, T]
        return (c * m).sum() / m.expand_as(c).sum()

    cos = [mean_cos(fc, x - mu) for x, mu in zip((a, b), mus)]
    assert abs(float(cos[0] - cos[1])) < 0.02, cos
    # raw fusion at the same weights: teacher a's unit vectors are nearly its constant mean, which centring
    # removes, so what is trained follows teacher b alone -- its logged 0.5 is not its share
    raw = Fusion("fixed", 2)([a, b])
    rc = raw - token_mean(raw, m)
    raw_cos = [mean_cos(rc, x - mu) for x, mu in zip((a, b), mus)]
    assert float(raw_cos[1] - raw_cos[0]) > 0.5, (raw_cos, cos)
    assert torch.allclose(Fusion("fixed", 1, center=True)([a], mask=mask), a)  # one teacher: its own target
