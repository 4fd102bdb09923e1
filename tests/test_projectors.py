import pytest
import torch

from kava_ray.bench.projector import SCENARIOS, format_projector_ab, run_projector_ab
from kava_ray.common.errors import KavaError
from kava_ray.core.align.layers import ratio_map, teacher_layers_used, uniform_map
from kava_ray.core.losses import mercator_loss
from kava_ray.core.projectors import (
    ElasticBottleneck,
    HeadwiseProjector,
    LinearProjector,
    PerHeadElastic,
    PerHeadLinear,
    TeacherProjector,
    block_head_mix,
    make_head_projector,
    make_projector,
    matmul_weights,
    num_parameters,
)

META = torch.device("meta")


def _millions(n: int) -> float:
    return n / 1e6


def test_elastic_bottleneck_parameter_counts():
    with META:
        k = ElasticBottleneck(5120, 1536, mlp_ratio=1.0)
        v = ElasticBottleneck(5120, 1536, mlp_ratio=1.0)
    # LN 2*5120 + (5120*5120 + 5120) + (5120*1536 + 1536)
    assert num_parameters(k) == 34_095_616
    assert round(_millions(num_parameters(k)), 1) == 34.1
    assert abs(_millions(num_parameters(k) + num_parameters(v)) - 68.19) <= 0.01


def test_linear_projector_parameter_counts():
    with META:
        one = LinearProjector(5120, 1536)
        pair = [make_projector("linear", 5120, 1536), make_projector("linear", 5120, 1536)]
    assert num_parameters(one) == 5120 * 1536 + 1536
    assert round(_millions(num_parameters(one)), 2) == 7.87
    assert round(_millions(sum(num_parameters(p) for p in pair)), 2) == 15.73


def test_flat_teacher_projector_qwen_1p5b_to_0p5b_count():
    # Qwen2.5-1.5B (28 layers x 2 kv heads x 128) -> Qwen2.5-0.5B (24 x 2 x 64): 7168 -> 3072
    with META:
        tp = TeacherProjector(list(range(28)), 2, 128, 24, 2, 64, uniform_map(28, 24),
                              mode="flat", aggregation="concat", kind="elastic", mlp_ratio=1.0)
    assert tp.k_proj.net[1].in_features == 7168 and tp.k_proj.net[4].out_features == 3072
    assert tp.num_parameters() == 146_849_792
    # 146.849792M: "146.9M" as the predecessor rounded it (146.85 -> 146.9)
    assert round(_millions(tp.num_parameters()), 2) == 146.85
    assert abs(_millions(tp.num_parameters()) - 146.9) <= 0.051
    with META:
        st = TeacherProjector(list(range(28)), 2, 128, 24, 2, 64, uniform_map(28, 24),
                              mode="structured", kind="elastic")
    assert st.num_parameters() < tp.num_parameters() / 50


def test_elastic_bottleneck_structure_and_init():
    m = ElasticBottleneck(8, 4, mlp_ratio=2.0, dropout=0.1)
    kinds = [type(x).__name__ for x in m.net]
    assert kinds == ["LayerNorm", "Linear", "SiLU", "Dropout", "Linear"]
    assert m.net[1].out_features == 16
    assert all(torch.count_nonzero(m.net[i].bias) == 0 for i in (1, 4))
    bound = (6 / (8 + 16)) ** 0.5  # xavier-uniform bound
    assert m.net[1].weight.abs().max() <= bound and m.net[1].weight.std() > bound / 4
    assert m(torch.randn(3, 5, 8)).shape == (3, 5, 4)
    for bad in [dict(mlp_ratio=0.0), dict(dropout=1.0), dict(dropout=-0.1)]:
        with pytest.raises(KavaError, match=next(iter(bad))):
            ElasticBottleneck(8, 4, **bad)
    with pytest.raises(KavaError, match="'conv'"):
        make_projector("conv", 8, 4)


def test_block_head_mix():
    assert torch.equal(block_head_mix(4, 2), torch.tensor([[0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5]]))
    assert torch.equal(block_head_mix(2, 4), torch.tensor([[1.0, 0], [1, 0], [0, 1], [0, 1]]))
    m = block_head_mix(3, 2)
    assert torch.allclose(m.sum(1), torch.ones(2)) and (m > 0).sum() == 3


def test_headwise_projector_mixes_heads_then_projects():
    hp = HeadwiseProjector(4, 8, 2, 6, kind="linear")
    x = torch.randn(3, 4, 5, 8)  # [B, H_t, T, D_t]
    out = hp(x)
    assert out.shape == (3, 2, 5, 6)
    averaged = torch.stack([x[:, :2].mean(1), x[:, 2:].mean(1)], dim=1)  # block-uniform init
    assert torch.allclose(out, hp.proj(averaged), atol=1e-6)
    up = HeadwiseProjector(2, 8, 4, 8, kind="elastic")
    assert up(torch.randn(1, 3, 2, 5, 8)).shape == (1, 3, 4, 5, 8)


def _run_and_check_grads(tp, n_layers, B=3, T=5):
    torch.manual_seed(0)
    keys = torch.randn(n_layers, B, 4, T, 32)
    values = torch.randn(n_layers, B, 4, T, 32)
    k, v = tp(keys, values)
    assert k.shape == (2, B, 2, T, 16) and v.shape == (2, B, 2, T, 16)
    assert tp.student_layout == (2, 2, 16)
    target_k, target_v = torch.randn_like(k), torch.randn_like(v)
    # the MSE terms on both K and V: with one source layer, a student layer's output is its (bias-free at init)
    # layer weight times a fixed map, so a scale-invariant cosine alone gives that weight a zero gradient
    loss = (mercator_loss(k, target_k)[0] + mercator_loss(v, target_v)[0] + ((k - target_k) ** 2).mean()
            + ((v - target_v) ** 2).mean())
    loss.backward()
    params = list(tp.named_parameters())
    assert params
    for name, p in params:
        assert p.grad is not None, name
        assert torch.count_nonzero(p.grad) > 0, name
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("aggregation", ["concat", "mean", "weighted"])
@pytest.mark.parametrize("kind", ["elastic", "linear"])
def test_flat_teacher_projector_shapes_and_grads(aggregation, kind):
    lm = uniform_map(4, 2)
    tp = TeacherProjector(teacher_layers_used(lm), 4, 32, 2, 2, 16, lm, mode="flat",
                          aggregation=aggregation, kind=kind)
    d_in = 4 * 4 * 32 if aggregation == "concat" else 4 * 32
    first = tp.k_proj.net[0] if kind == "elastic" else tp.k_proj.linear
    assert (first.normalized_shape[0] if kind == "elastic" else first.in_features) == d_in
    _run_and_check_grads(tp, 4)


def test_flat_output_keeps_every_student_layer():
    # the predecessor collapsed the layer axis; here student layer l is its own output slice
    lm = uniform_map(4, 2)
    tp = TeacherProjector([0, 1, 2, 3], 4, 32, 2, 2, 16, lm, mode="flat", kind="linear")
    keys = torch.randn(4, 1, 4, 3, 32)
    k, _ = tp(keys, keys)
    flat = tp.k_proj(keys.permute(1, 3, 0, 2, 4).reshape(1, 3, -1))  # [B, T, L_s*H_s*D_s]
    assert torch.allclose(k[1, 0, 1, 2], flat[0, 2, 16 * 3:16 * 4], atol=1e-6)  # layer 1, head 1, token 2
    assert not torch.allclose(k[0], k[1])


@pytest.mark.parametrize("kind", ["elastic", "linear"])
@pytest.mark.parametrize("mapping", ["uniform", "ratio"])
def test_structured_teacher_projector_shapes_and_grads(kind, mapping):
    lm = uniform_map(4, 2) if mapping == "uniform" else ratio_map(4, 2)
    shipped = teacher_layers_used(lm)  # ratio: [0, 3] only
    tp = TeacherProjector(shipped, 4, 32, 2, 2, 16, lm, mode="structured", kind=kind)
    _run_and_check_grads(tp, len(shipped))


def test_structured_layer_weights_start_from_map():
    lm = [(0, [(0, 0.25), (2, 0.75)]), (1, [(3, 1.0)])]
    tp = TeacherProjector([0, 2, 3], 4, 32, 2, 2, 16, lm, mode="structured", kind="linear")
    assert torch.allclose(tp.k_layer_weights[0].data, torch.tensor([0.25, 0.75]))
    keys = torch.randn(3, 2, 4, 5, 32)
    k, _ = tp(keys, keys)
    expected = tp.k_heads[0](0.25 * keys[0] + 0.75 * keys[1])  # shipped order: layer 0 at 0, layer 2 at 1
    assert torch.allclose(k[0], expected, atol=1e-5)


def test_teacher_projector_rejects_bad_input():
    lm = ratio_map(4, 2)
    with pytest.raises(KavaError, match="teacher layer 3"):
        TeacherProjector([0, 1], 4, 32, 2, 2, 16, lm, mode="structured")
    with pytest.raises(KavaError, match="'stacked'"):
        TeacherProjector([0, 3], 4, 32, 2, 2, 16, lm, mode="stacked")
    with pytest.raises(KavaError, match="'max'"):
        TeacherProjector([0, 3], 4, 32, 2, 2, 16, lm, aggregation="max")
    with pytest.raises(KavaError, match="the student has 3"):
        TeacherProjector([0, 3], 4, 32, 3, 2, 16, lm)
    tp = TeacherProjector([0, 3], 4, 32, 2, 2, 16, lm, kind="linear")
    with pytest.raises(KavaError, match="keys must be"):
        tp(torch.randn(4, 1, 4, 3, 32), torch.randn(2, 1, 4, 3, 32))


def test_projector_ab_small_run():
    result = run_projector_ab(seeds=2, steps=5)
    assert [r["scenario"] for r in result["rows"]] == list(SCENARIOS)
    for r in result["rows"]:
        for key in ("linear_mean", "linear_std", "mlp_mean", "mlp_std"):
            assert torch.isfinite(torch.tensor(r[key])), key
        assert r["linear_mean"] > 0 and r["mlp_mean"] > 0
        assert r["winner"] == ("linear" if r["linear_mean"] <= r["mlp_mean"] else "mlp")
    # the outlier scenario lives on a much larger scale than the unit-variance ones
    rows = {r["scenario"]: r for r in result["rows"]}
    assert rows["shifted_outliers"]["linear_mean"] > 10 * rows["gaussian"]["linear_mean"]
    assert (rows["gaussian"]["reported_linear"], rows["gaussian"]["reported_mlp"]) == (0.0032, 0.0512)
    table = format_projector_ab(result)
    assert all(s in table for s in SCENARIOS) and "19.67 / 5.37" in table
    with pytest.raises(KavaError, match="seeds"):
        run_projector_ab(seeds=0)


# ------------------------------------------------------------------ head_proj: shared vs per_head


@pytest.mark.parametrize("kind", ["elastic", "linear"])
@pytest.mark.parametrize("head_proj", ["shared", "per_head"])
def test_headwise_head_proj_shapes(kind, head_proj):
    hp = HeadwiseProjector(4, 8, 2, 6, kind=kind, head_proj=head_proj)
    assert hp(torch.randn(3, 4, 5, 8)).shape == (3, 2, 5, 6)  # [B, H_t, T, D_t] -> [B, H_s, T, D_s]
    up = HeadwiseProjector(2, 8, 4, 8, kind=kind, head_proj=head_proj)
    assert up(torch.randn(1, 3, 2, 5, 8)).shape == (1, 3, 4, 5, 8)  # [L, B, H_t, T, D_t] -> [L, B, H_s, T, D_s]


@pytest.mark.parametrize("kind", ["elastic", "linear"])
def test_per_head_parameter_count_is_h_s_times_shared(kind):
    h_t, d_t, h_s, d_s = 3, 64, 5, 32
    shared = HeadwiseProjector(h_t, d_t, h_s, d_s, kind=kind)
    per = HeadwiseProjector(h_t, d_t, h_s, d_s, kind=kind, head_proj="per_head")
    one = num_parameters(make_projector(kind, d_t, d_s))
    assert num_parameters(shared) == h_s * h_t + one
    assert num_parameters(per) == h_s * h_t + h_s * one
    assert num_parameters(per.proj) == h_s * num_parameters(shared.proj)
    # demo geometry (SmolLM2-135M -> same): 3 kv heads x 64, 30 layers, K and V
    with META:
        st = {hp: TeacherProjector(list(range(30)), 3, 64, 30, 3, 64, uniform_map(30, 30), mode="structured",
                                   kind=kind, head_proj=hp) for hp in ("shared", "per_head")}
    mix_and_weights = 2 * 30 * (3 * 3 + 1)  # K and V: per student layer a [3, 3] mix and 1 layer weight
    proj = st["shared"].num_parameters() - mix_and_weights
    assert proj == 2 * 30 * num_parameters(make_projector(kind, 64, 64))
    assert st["per_head"].num_parameters() == mix_and_weights + 3 * proj


def test_per_head_linear_is_one_batched_weight_with_xavier_init():
    m = make_head_projector("linear", 3, 16, 8)
    assert isinstance(m, PerHeadLinear)
    assert m.weight.shape == (3, 16, 8) and m.bias.shape == (3, 8)
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias"]
    assert torch.count_nonzero(m.bias) == 0
    bound = (6 / (16 + 8)) ** 0.5  # per head: the bound of nn.Linear(16, 8)
    for w in m.weight:
        assert w.abs().max() <= bound and w.std() > bound / 4
    assert not torch.equal(m.weight[0], m.weight[1])  # heads start independent
    x = torch.randn(2, 3, 5, 16)  # [B, H, T, D_in]
    looped = torch.stack([x[:, h] @ m.weight[h] + m.bias[h] for h in range(3)], dim=1)
    assert torch.allclose(m(x), looped, atol=1e-6)
    assert [w.shape for w in matmul_weights(m)] == [(3, 16, 8)]
    e = make_head_projector("elastic", 3, 16, 8, mlp_ratio=2.0)
    assert isinstance(e, PerHeadElastic) and len(e.heads) == 3
    assert all(isinstance(h, ElasticBottleneck) and h.net[1].out_features == 32 for h in e.heads)
    assert len(matmul_weights(e)) == 6
    with pytest.raises(KavaError, match="'conv'"):
        make_head_projector("conv", 3, 16, 8)


@pytest.mark.parametrize("kind", ["elastic", "linear"])
def test_per_head_heads_are_independent(kind):
    """The gradient of student head j's output reaches head j's projector and no other."""
    hp = HeadwiseProjector(2, 8, 3, 6, kind=kind, head_proj="per_head", dropout=0.0)
    out = hp(torch.randn(2, 2, 5, 8))  # [B, H_s=3, T, D_s]
    j = 1
    out[:, j].pow(2).sum().backward()
    if kind == "linear":
        g = hp.proj.weight.grad  # [H_s, D_t, D_s]
        assert torch.count_nonzero(g[j]) > 0
        assert torch.count_nonzero(g[0]) == 0 and torch.count_nonzero(g[2]) == 0
        assert torch.count_nonzero(hp.proj.bias.grad[j]) > 0
        assert torch.count_nonzero(hp.proj.bias.grad[[0, 2]]) == 0
    else:
        for h, head in enumerate(hp.proj.heads):
            grads = [p.grad for p in head.parameters()]
            if h == j:
                assert all(g is not None and torch.count_nonzero(g) > 0 for g in grads)
            else:
                assert all(g is None or torch.count_nonzero(g) == 0 for g in grads)
    # the mix: only student head j's row
    assert torch.count_nonzero(hp.mix.grad[j]) > 0 and torch.count_nonzero(hp.mix.grad[[0, 2]]) == 0


def test_shared_default_keeps_the_state_dict_keys_old_checkpoints_have():
    lm = uniform_map(4, 2)
    for kind, proj_keys in [("linear", ["proj.linear.weight", "proj.linear.bias"]),
                            ("elastic", [f"proj.net.{i}.{p}" for i in (0, 1, 4) for p in ("weight", "bias")])]:
        hp = HeadwiseProjector(4, 32, 2, 16, kind=kind)
        assert hp.head_proj == "shared"
        assert set(hp.state_dict()) == {"mix", *proj_keys}
        assert set(HeadwiseProjector(4, 32, 2, 16, kind=kind, head_proj="shared").state_dict()) == set(hp.state_dict())
        tp = TeacherProjector([0, 1, 2, 3], 4, 32, 2, 2, 16, lm, mode="structured", kind=kind)
        want = {f"{w}_layer_weights.{s}" for w in "kv" for s in range(2)}
        want |= {f"{w}_heads.{s}.{k}" for w in "kv" for s in range(2) for k in ("mix", *proj_keys)}
        assert set(tp.state_dict()) == want
        # a default-built projector loads a state dict saved by another default-built one, strictly
        fresh = TeacherProjector([0, 1, 2, 3], 4, 32, 2, 2, 16, lm, mode="structured", kind=kind)
        fresh.load_state_dict(tp.state_dict())
        per = TeacherProjector([0, 1, 2, 3], 4, 32, 2, 2, 16, lm, mode="structured", kind=kind, head_proj="per_head")
        assert not set(per.state_dict()) & {k for k in want if ".proj." in k}  # never confused with shared
        with pytest.raises(RuntimeError):
            per.load_state_dict(tp.state_dict())


@pytest.mark.parametrize("kind", ["elastic", "linear"])
def test_structured_per_head_shapes_and_grads(kind):
    lm = uniform_map(4, 2)
    tp = TeacherProjector(teacher_layers_used(lm), 4, 32, 2, 2, 16, lm, mode="structured", kind=kind,
                          head_proj="per_head")
    assert tp.head_proj == "per_head"
    _run_and_check_grads(tp, 4)


def test_flat_ignores_head_proj_and_unknown_values_fail():
    lm = uniform_map(4, 2)
    torch.manual_seed(0)
    a = TeacherProjector([0, 1, 2, 3], 4, 32, 2, 2, 16, lm, mode="flat", kind="linear")
    torch.manual_seed(0)
    b = TeacherProjector([0, 1, 2, 3], 4, 32, 2, 2, 16, lm, mode="flat", kind="linear", head_proj="per_head")
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    for bad in (lambda: TeacherProjector([0, 3], 4, 32, 2, 2, 16, ratio_map(4, 2), head_proj="per_layer"),
                lambda: TeacherProjector([0, 3], 4, 32, 2, 2, 16, ratio_map(4, 2), mode="structured",
                                         head_proj="per_layer"),
                lambda: HeadwiseProjector(4, 8, 2, 6, head_proj="per_layer")):
        with pytest.raises(KavaError, match="unknown head_proj 'per_layer'") as e:
            bad()
        assert "\n" not in str(e.value)


def _fit(head_proj: str, x: torch.Tensor, target: torch.Tensor, steps: int) -> float:
    torch.manual_seed(0)
    hp = HeadwiseProjector(1, x.shape[-1], target.shape[1], target.shape[-1], kind="linear", head_proj=head_proj)
    opt = torch.optim.Adam(hp.parameters(), lr=0.02)
    for _ in range(steps):
        loss = ((hp(x) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(((hp(x) - target) ** 2).mean())


def test_per_head_fits_heads_that_read_different_maps_of_one_teacher_head():
    """Why per_head exists: student head j = A_j (teacher head), a different linear map per head.

    One shared projector can only fit the average map (mixing one teacher head gives every student
    head the same input); per_head fits each A_j.
    """
    gen = torch.Generator().manual_seed(0)
    h_s, d = 3, 8
    x = torch.randn(4, 1, 32, d, generator=gen)  # [B, H_t=1, T, D_t]
    maps = torch.randn(h_s, d, d, generator=gen) / d ** 0.5  # A_j: [H_s, D_t, D_s]
    target = torch.einsum("btd,jde->bjte", x[:, 0], maps)  # [B, H_s, T, D_s]
    shared = _fit("shared", x, target, steps=300)
    per = _fit("per_head", x, target, steps=300)
    assert per < 1e-3 < 0.1 < shared, (per, shared)  # per_head fits; shared keeps the maps' spread
    assert per < shared / 100
