import pytest
import torch

from kava_ray.errors import KavaError
from kava_ray.fusion import Fusion

SHAPE = (3, 2, 2, 5, 4)  # [L, B, H, T, D]


def _targets(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


def test_fixed_is_hand_weighted_mean():
    p = _targets(3)
    fused = Fusion("fixed", 3, weights=[1.0, 3.0, 4.0])(p)
    assert torch.allclose(fused, 0.125 * p[0] + 0.375 * p[1] + 0.5 * p[2], atol=1e-6)
    eq = Fusion("fixed", 3, names=["a", "b", "c"])
    assert torch.allclose(eq(p), (p[0] + p[1] + p[2]) / 3, atol=1e-6)
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
    assert torch.allclose(fused, 0.25 * p[0] + 0.75 * p[1], atol=1e-6)
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
    assert torch.allclose(fused[0], (p[0][0] + p[1][0]) / 2, atol=1e-5)
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
    expected = sum(w[b, t, i] * p[i][:, b, :, t] for i in range(3))
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
