import json

import pytest
import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.align.layers import (
    build_layer_map,
    cka_map,
    explicit_map,
    linear_cka,
    load_layer_map,
    ratio_map,
    save_layer_map,
    teacher_layers_used,
    uniform_map,
)


def _check_well_formed(layer_map, n_teacher, n_student):
    assert [s for s, _ in layer_map] == list(range(n_student))
    for _, pairs in layer_map:
        assert pairs
        assert abs(sum(w for _, w in pairs) - 1.0) < 1e-9
        assert all(0 <= t < n_teacher for t, _ in pairs)


@pytest.mark.parametrize("n_t,n_s", [(28, 24), (4, 2), (30, 6), (5, 5), (3, 7)])
def test_ratio_map_covers_first_and_last(n_t, n_s):
    m = ratio_map(n_t, n_s)
    _check_well_formed(m, n_t, n_s)
    assert m[0][1] == [(0, 1.0)]
    assert m[-1][1] == [(n_t - 1, 1.0)]
    teachers = [pairs[0][0] for _, pairs in m]
    assert teachers == sorted(teachers)


def test_ratio_map_values_and_single_student_layer():
    # s * 27 / 23: 0, 1.17->1, 2.35->2, 3.52->4 ...
    assert [p[0][0] for _, p in ratio_map(28, 24)][:4] == [0, 1, 2, 4]
    assert ratio_map(4, 3) == [(0, [(0, 1.0)]), (1, [(2, 1.0)]), (2, [(3, 1.0)])]  # 1.5 rounds up
    assert ratio_map(28, 1) == [(0, [(27, 1.0)])]


@pytest.mark.parametrize("n_t,n_s", [(28, 24), (4, 2), (30, 6), (7, 3), (3, 7)])
def test_uniform_map_uses_every_teacher_layer(n_t, n_s):
    m = uniform_map(n_t, n_s)
    _check_well_formed(m, n_t, n_s)
    assert teacher_layers_used(m) == list(range(n_t))
    if n_t >= n_s:  # contiguous disjoint groups, each layer exactly once, equal weights
        flat = [t for _, pairs in m for t, _ in pairs]
        assert flat == list(range(n_t))
        for _, pairs in m:
            assert len({w for _, w in pairs}) == 1


def test_uniform_map_groups():
    assert uniform_map(4, 2) == [(0, [(0, 0.5), (1, 0.5)]), (1, [(2, 0.5), (3, 0.5)])]


def test_explicit_map_lists_dicts_and_string_keys():
    m = explicit_map({"0": [0, 1], 1: {3: 3.0, 2: 1.0}}, n_teacher=4, n_student=2)
    assert m == [(0, [(0, 0.5), (1, 0.5)]), (1, [(3, 0.75), (2, 0.25)])]
    assert teacher_layers_used(m) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "spec,word",
    [
        ({0: [0], 1: [4]}, "teacher layer 4"),
        ({0: [-1], 1: [0]}, "teacher layer -1"),
        ({0: [0], 2: [1]}, "student layer 2"),
        ({0: [0]}, "student layer 1"),
        ({0: {0: -1.0, 1: 2.0}, 1: [1]}, "weight -1.0"),
        ({0: ["a"], 1: [1]}, "'a'"),
    ],
)
def test_explicit_map_rejects_bad_layers(spec, word):
    with pytest.raises(KavaError, match=word) as err:
        explicit_map(spec, n_teacher=4, n_student=2)
    assert "\n" not in str(err.value)


def test_linear_cka_properties():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 16, generator=g)
    Q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g))
    assert linear_cka(X, X) == pytest.approx(1.0, abs=1e-9)
    assert linear_cka(X, 3.0 * X @ Q + 5.0) == pytest.approx(1.0, abs=1e-9)  # rotation, scale, shift
    Y = torch.randn(200, 24, generator=g)
    v = linear_cka(X, Y)
    assert 0.0 <= v < 0.3
    assert linear_cka(X, Y) == pytest.approx(linear_cka(Y, X))


def test_cka_map_recovers_planted_correspondence():
    g = torch.Generator().manual_seed(1)
    n, d_t, d_s, L_t = 256, 32, 24, 6
    base = torch.randn(n, d_t, generator=g)
    # teacher layers share some structure (like a residual stream) but differ
    teacher = [0.5 * base + torch.randn(n, d_t, generator=g) for _ in range(L_t)]
    perm = [4, 0, 5, 2]
    student = []
    for t in perm:
        Q, _ = torch.linalg.qr(torch.randn(d_t, d_t, generator=g))
        student.append(teacher[t] @ Q[:, :d_s] + 0.1 * torch.randn(n, d_s, generator=g))
    m = cka_map(teacher, student, top_k=1)
    assert [pairs[0][0] for _, pairs in m] == perm
    m2 = cka_map(teacher, student, top_k=2)
    for (s, pairs), t in zip(m2, perm):
        assert pairs[0][0] == t and len(pairs) == 2
        assert pairs[0][1] > pairs[1][1] > 0
        assert sum(w for _, w in pairs) == pytest.approx(1.0)
    with pytest.raises(KavaError, match="top_k"):
        cka_map(teacher, student, top_k=7)


def test_json_round_trip_and_cka_kind(tmp_path):
    m = [(0, [(4, 0.7), (1, 0.3)]), (1, [(5, 1.0)])]
    path = tmp_path / "map.json"
    save_layer_map(m, path)
    assert load_layer_map(path) == m
    assert build_layer_map("cka", 6, 2, cka_path=path) == m
    with pytest.raises(KavaError, match="teacher layer 5"):
        build_layer_map("cka", 5, 2, cka_path=path)
    with pytest.raises(KavaError, match="2 student layers"):
        build_layer_map("cka", 6, 3, cka_path=path)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(KavaError, match="not a saved layer map"):
        load_layer_map(bad)


def test_build_layer_map_dispatch():
    assert build_layer_map("ratio", 28, 24) == ratio_map(28, 24)
    assert build_layer_map("uniform", 28, 24) == uniform_map(28, 24)
    assert build_layer_map("explicit", 4, 1, explicit={0: [1, 2]}) == [(0, [(1, 0.5), (2, 0.5)])]
    with pytest.raises(KavaError, match="'nearest'"):
        build_layer_map("nearest", 4, 2)
    with pytest.raises(KavaError, match="explicit"):
        build_layer_map("explicit", 4, 2)
    with pytest.raises(KavaError, match="n_student"):
        build_layer_map("ratio", 4, 0)


def test_teacher_layers_used():
    assert teacher_layers_used(ratio_map(28, 6)) == [0, 5, 11, 16, 22, 27]
    assert teacher_layers_used([(0, [(3, 0.5), (1, 0.5)]), (1, [(3, 1.0)])]) == [1, 3]


def test_plan_teacher_layers_respects_selection_and_mode():
    from kava_ray.core.align.layers import plan_teacher_layers

    lm, shipped = plan_teacher_layers("ratio", 28, 4, mode="structured", selected=[3, 9, 15, 21, 27])
    assert shipped == sorted({t for _, pairs in lm for t, _ in pairs}) and set(shipped) <= {3, 9, 15, 21, 27}
    assert lm[0][1][0][0] == 3 and lm[-1][1][0][0] == 27  # ends of the selection, not of the model
    _, flat = plan_teacher_layers("ratio", 6, 2, mode="flat")
    assert flat == list(range(6))  # flat aggregates the whole stack
    with pytest.raises(KavaError, match="outside the selected"):
        plan_teacher_layers("explicit", 6, 2, selected=[0, 1], explicit={0: [0], 1: [5]})
    with pytest.raises(KavaError, match="only 6 layers"):
        plan_teacher_layers("ratio", 6, 2, selected=[2, 7])


def test_identity_map_of_a_layer_dropped_student(tmp_path):
    """student.keep_layers from the teacher's own model: `auto` maps student layer i to the teacher layer it was
    copied from (identity); `ratio` stays available; another teacher model gets ratio."""
    from kava_ray.common.config import validate_config
    from kava_ray.core.align.layers import identity_map
    from kava_ray.core.plans import copied_layers, layer_plan

    assert identity_map(30, 6, [0, 5, 10, 15, 20, 25]) == [(i, [(5 * i, 1.0)]) for i in range(6)]
    assert identity_map(4, 3) == [(0, [(0, 1.0)]), (1, [(1, 1.0)]), (2, [(2, 1.0)])]
    with pytest.raises(KavaError, match="out of range"):
        identity_map(20, 6, [0, 5, 10, 15, 20, 25])
    job = {"teachers": [{"name": "same", "model": "m"}, {"name": "other", "model": "o"}],
           "student": {"model": "m", "keep_layers": [0, 5, 10, 15, 20, 25]}}
    cfg = validate_config(job)
    assert cfg.align.layer_map == "auto"
    assert copied_layers(cfg.student, cfg.teacher("same")) == [0, 5, 10, 15, 20, 25]
    assert copied_layers(cfg.student, cfg.teacher("other")) is None
    lm, shipped = layer_plan(cfg.align, cfg.student, cfg.teacher("same"), 30, 6)
    assert lm == identity_map(30, 6, [0, 5, 10, 15, 20, 25]) and shipped == [0, 5, 10, 15, 20, 25]
    other = layer_plan(cfg.align, cfg.student, cfg.teacher("other"), 30, 6)
    assert other[0] == ratio_map(30, 6)  # not copied from it: ratio
    ratio = validate_config({**job, "align": {"layer_map": "ratio"}})
    assert layer_plan(ratio.align, ratio.student, ratio.teacher("same"), 30, 6)[0] == ratio_map(30, 6) != lm
    selected = validate_config({**job, "teachers": [{"name": "same", "model": "m", "layers": [0, 5, 10]}]})
    with pytest.raises(KavaError, match="outside the selected layers"):
        layer_plan(selected.align, selected.student, selected.teacher("same"), 30, 6)

    # a saved copy of that student (a warm start, a checkpoint's student/): no keep_layers in the job, the
    # provenance in its config.json -- `auto` and `identity` both map to the source layers, not to 0..5
    saved = tmp_path / "warm_start"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps({"model_type": "llama", "kava_copied_from": {
        "model": "m", "layers": [0, 5, 10, 15, 20, 25]}}))
    for kind in ("auto", "identity"):
        warm = validate_config({**job, "student": {"model": str(saved)}, "align": {"layer_map": kind}})
        assert copied_layers(warm.student, warm.teacher("same")) == [0, 5, 10, 15, 20, 25]
        assert layer_plan(warm.align, warm.student, warm.teacher("same"), 30, 6) == (lm, shipped), kind
