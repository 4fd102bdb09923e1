"""Measured CKA layer maps: streamed linear CKA, the per-teacher JSON, `kava-ray align cka` end to end."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.align.layers import (
    CKAStats,
    build_layer_map,
    cka_matrix,
    layer_map_json,
    linear_cka,
    load_layer_map,
    plan_teacher_layers,
    save_layer_map,
    top_k_map,
)


def _planted(n=2048, d_s=16, d_t=24, L_s=5, L_t=9, seed=0):
    """Student layers with a shared residual-like component; teacher layer perm[s] = a random orthogonal
    map x scale of student layer s + noise (+ a large common offset, as biased K projections have); the
    other teacher layers are distractors (the shared component plus their own noise)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d_s, generator=g)
    student = [0.6 * base + torch.randn(n, d_s, generator=g) for _ in range(L_s)]
    perm = torch.randperm(L_t, generator=g)[:L_s].tolist()
    teacher = [0.6 * (base @ torch.randn(d_s, d_t, generator=g)) + torch.randn(n, d_t, generator=g)
               for _ in range(L_t)]
    for s, t in enumerate(perm):
        Q, _ = torch.linalg.qr(torch.randn(d_t, d_t, generator=g))
        teacher[t] = 3.0 * torch.cat([student[s], torch.zeros(n, d_t - d_s)], 1) @ Q \
            + 0.3 * torch.randn(n, d_t, generator=g) + 50.0
    return teacher, student, perm


def test_streamed_cka_recovers_a_planted_layer_correspondence():
    teacher, student, perm = _planted()
    stats = CKAStats()
    T, S = torch.stack(teacher), torch.stack(student)  # [L, n, d]
    for lo in range(0, T.shape[1], 300):  # uneven chunks, as batches of real tokens come
        stats.update(T[:, lo:lo + 300], S[:, lo:lo + 300])
    cka = stats.matrix()
    assert cka.shape == (len(student), len(teacher))
    assert torch.allclose(cka, cka_matrix(teacher, student), atol=1e-6)  # = CKA on all the features at once
    layer_map = top_k_map(cka, 1)
    assert [pairs[0][0] for _, pairs in layer_map] == perm
    planted = torch.tensor([cka[s, t] for s, t in enumerate(perm)])
    assert planted.min() > 0.95
    # shuffled-token baseline: the planted pair with its tokens out of correspondence is near 0
    rows = torch.randperm(T.shape[1], generator=torch.Generator().manual_seed(1))
    shuffled = [linear_cka(teacher[t][rows], student[s]) for s, t in enumerate(perm)]
    assert max(shuffled) < 0.05
    # top-2: the planted layer first, weights from CKA summing to 1; real teacher layer ids when given
    ids = [10 + i for i in range(len(teacher))]
    two = top_k_map(cka, 2, ids)
    for (s, pairs), t in zip(two, perm):
        assert pairs[0][0] == 10 + t and pairs[0][1] > pairs[1][1] > 0
        assert sum(w for _, w in pairs) == pytest.approx(1.0)
    with pytest.raises(KavaError, match="top_k"):
        top_k_map(cka, len(teacher) + 1)


def test_cka_stats_refuses_too_few_tokens_and_changing_shapes():
    stats = CKAStats()
    with pytest.raises(KavaError, match="at least 2"):
        stats.matrix()
    stats.update(torch.randn(3, 4, 8), torch.randn(2, 4, 6))
    with pytest.raises(KavaError, match="changed"):
        stats.update(torch.randn(3, 4, 9), torch.randn(2, 4, 6))
    with pytest.raises(KavaError, match=r"\[L_t, n, d_t\]"):
        stats.update(torch.randn(3, 4, 8), torch.randn(2, 5, 6))


def _multi(path, maps):
    path.write_text(json.dumps({"teachers": {n: {"layer_map": layer_map_json(m)} for n, m in maps.items()},
                                "features": "kv", "samples": 4, "config": "x"}))
    return path


def test_multi_teacher_json_is_read_by_teacher_name(tmp_path):
    a = [(0, [(4, 0.7), (1, 0.3)]), (1, [(5, 1.0)])]
    b = [(0, [(0, 1.0)]), (1, [(2, 1.0)])]
    path = _multi(tmp_path / "maps.json", {"a": a, "b": b})
    assert load_layer_map(path, "a") == a and load_layer_map(path, "b") == b
    assert build_layer_map("cka", 6, 2, cka_path=path, teacher="a") == a
    lm, shipped = plan_teacher_layers("cka", 3, 2, cka_path=path, teacher="b")
    assert lm == b and shipped == [0, 2]
    for call in (lambda: load_layer_map(path, "c"),
                 lambda: plan_teacher_layers("cka", 6, 2, cka_path=path, teacher="c")):
        with pytest.raises(KavaError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and str(path) in msg and "'c'" in msg and "a, b" in msg
    with pytest.raises(KavaError, match="say which teacher"):
        load_layer_map(path)
    with pytest.raises(KavaError, match=r"teacher 'a'.*teacher layer 5"):  # the file's map does not fit the teacher
        build_layer_map("cka", 5, 2, cka_path=path, teacher="a")
    only = _multi(tmp_path / "one.json", {"a": a})
    assert load_layer_map(only) == a  # one teacher: no name needed


def test_single_map_format_still_loads_for_any_teacher(tmp_path):
    m = [(0, [(1, 1.0)]), (1, [(3, 0.5), (2, 0.5)])]
    path = tmp_path / "single.json"
    save_layer_map(m, path)
    assert load_layer_map(path) == m == load_layer_map(path, "whoever")
    assert plan_teacher_layers("cka", 4, 2, cka_path=path, teacher="qwen")[0] == m
    for bad in ({"teachers": {}}, {"teachers": {"a": {}}}, [1, 2]):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(KavaError, match="not a saved layer map"):
            load_layer_map(tmp_path / "bad.json", "a")


def test_teacher_features_use_real_tokens_and_the_alignment_when_present():
    from kava_ray.core.kv import KVBatch
    from kava_ray.data import Batch, TeacherInputs
    from kava_ray.recipes.cka import _layer_features, _teacher_features

    L, B, H, T, D = 2, 2, 3, 5, 4
    keys, values = torch.randn(L, B, H, T, D), torch.randn(L, B, H, T, D)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    kv = KVBatch(keys=keys, values=values, mask=mask, layer_ids=[0, 1], key_space="pre_rope")
    plain = Batch(mask, mask, mask, mask)  # only the attention mask matters here
    k, v, keep = _teacher_features(plain, kv, "t", "mean")
    assert k is keys and keep.sum() == 8
    feats = _layer_features(k, keep)
    assert feats.shape == (L, 8, H * D)
    assert torch.equal(feats[1, 3], keys[1, 1, :, 0, :].reshape(-1))  # example 1, token 0: after example 0's 3
    # another tokenizer: 3 teacher tokens; student token i <- teacher tokens lo:hi; (1, 4) has none
    lo = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 2, 3]])
    hi = torch.tensor([[1, 3, 3, 0, 0], [1, 1, 2, 3, 3]])
    t_kv = KVBatch(keys=keys[:, :, :, :3], values=values[:, :, :, :3], mask=torch.ones(B, 3, dtype=torch.long),
                   layer_ids=[0, 1], key_space="pre_rope")
    none = torch.zeros(B, 3, dtype=torch.long)
    batch = dataclasses.replace(plain, teachers={"t": TeacherInputs(none, none, lo, hi, logit_pair=lo)})
    k, v, keep = _teacher_features(batch, t_kv, "t", "mean")
    assert k.shape == (L, B, H, T, D)
    assert keep.tolist() == [[True, True, True, False, False], [True, True, True, True, False]]
    assert torch.allclose(k[:, 0, :, 1], keys[:, 0, :, 1:3].mean(2))
    with pytest.raises(KavaError, match="no alignment"):
        _teacher_features(plain, t_kv, "t", "mean")


def test_cli_typo_in_a_config_key_exits_2_with_one_line(tiny_job, capsys):
    from kava_ray.cli import main

    assert main(["align", "cka", "--config", str(tiny_job), "align.layer_mapp=cka"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "layer_mapp" in err
    assert main(["align", "cka", "--config", str(tiny_job), "--samples", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_calibration_reads_only_training_examples_and_plans_without_the_map(tiny_job, tmp_path):
    from kava_ray.common.config import load_config
    from kava_ray.recipes.cka import calibration_config, default_out

    cfg = load_config(tiny_job, ["align.layer_map=cka", f"align.cka_path={tmp_path / 'missing.json'}",
                                 "data.kv_source=cache", f"data.kv_cache_dir={tmp_path}"])
    cal = calibration_config(cfg, 8)
    assert cal.align.layer_map == "ratio" and cal.data.kv_source == "live" and cal.data.num_train == 8
    assert cal.data.num_val == cfg.data.num_val and cfg.align.layer_map == "cka"  # the job's config untouched
    from kava_ray.core.plans import student_tokenizer
    from kava_ray.data.splits import load_splits

    tok = student_tokenizer(cfg.student)[0]
    train, val = load_splits(cfg.data, cfg.train, tok)
    cal_train = load_splits(cal.data, cal.train, tok)[0]
    assert [x["input_ids"] for x in cal_train.items] == [x["input_ids"] for x in train.items[:8]]  # its first 8
    assert not {tuple(x["input_ids"]) for x in cal_train.items} & {tuple(x["input_ids"]) for x in val.items}
    with pytest.raises(KavaError, match="exceeds data.num_train=64"):
        calibration_config(cfg, 65)
    out = default_out(cfg)
    assert out.is_absolute() and out.parts[-2:] == ("cka", "tiny.json")


# ------------------------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def measured(tiny_pool, tiny_job, tmp_path_factory):
    from kava_ray.common.config import load_config
    from kava_ray.recipes.cka import measure_cka

    out = tmp_path_factory.mktemp("cka") / "maps.json"
    # the config already names the map this measures (not there yet): the calibration plans with ratio
    cfg = load_config(tiny_job, ["align.layer_map=cka", f"align.cka_path={out}"])
    return cfg, measure_cka(cfg, samples=8, top_k=2, features="kv", out=out, progress=False)


def test_align_cka_writes_one_json_of_every_teacher_and_a_heat_map_each(measured):
    from kava_ray.recipes.cka import format_cka

    cfg, res = measured
    path = Path(res["path"])
    data = json.loads(path.read_text())
    assert data["features"] == "kv" and data["samples"] == 8 and data["config"] == cfg.name
    assert set(data["teachers"]) == {t.name for t in cfg.teachers}
    n_layers = {"qwen": 4, "llama": 3}
    for name, e in data["teachers"].items():
        cka = torch.tensor(e["cka"])
        assert cka.shape == (2, n_layers[name]) and e["teacher_layers"] == list(range(n_layers[name]))
        assert ((cka >= 0) & (cka <= 1)).all() and e["tokens"] > 8 * 10
        assert torch.allclose(cka, (torch.tensor(e["cka_k"]) + torch.tensor(e["cka_v"])) / 2)
        lm = load_layer_map(path, name)
        assert [s for s, _ in lm] == [0, 1] and all(len(p) == 2 for _, p in lm)
        assert all(p[0][0] == int(cka[s].argmax()) for s, p in lm)  # best first
        png = path.with_name(f"maps.{name}.png")
        assert str(png) in res["plots"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = format_cka(res, "job.yaml")
    assert str(path) in text and f"align.cka_path={path}" in text.splitlines()[-1]


def test_training_runs_on_the_measured_map(measured, tiny_job):
    """A 2-step training with align.layer_map=cka align.cka_path=<the JSON>: each teacher plans its own map
    (the worker's recipe in process: the plans are what is tested, not Ray Train, which test_train covers)."""
    from jobs import run_recipe
    from kava_ray.common.config import load_config
    from kava_ray.core.models import load_model
    from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans

    _, res = measured
    cfg = load_config(tiny_job, ["align.layer_map=cka", f"align.cka_path={res['path']}"])
    models = {t.name: load_model(t.model, dtype=t.dtype, quantization=t.quantization) for t in cfg.teachers}
    planned = in_process_plans(cfg, models)
    curve, _, _ = run_recipe(cfg, planned, InProcessSource(models), 2)
    assert sorted(curve) == [1, 2] and all(torch.isfinite(torch.tensor(v["loss"])) for v in curve.values())
    measured_maps = json.loads(Path(res["path"]).read_text())["teachers"]
    assert set(planned) == set(measured_maps)
    for name, plan in planned.items():
        want = measured_maps[name]["layer_map"]
        assert [[t for t, _ in pairs] for _, pairs in plan.layer_map] == [[t for t, _ in p] for _, p in want]
        assert [[w for _, w in pairs] for _, pairs in plan.layer_map] == \
            [pytest.approx([w for _, w in p]) for _, p in want]


def test_align_cka_with_a_teacher_of_another_tokenizer(tiny_pool, tmp_path, tiny_qwen2_dir, tiny_llama_dir,
                                                      tiny_student_dir, qtok_teacher_dir):
    """The teacher of another tokenizer gets its own ids; its KV is compared in student time, at the real
    student positions that have a teacher token (fewer than the same-tokenizer teacher's)."""
    from jobs import write_job
    from kava_ray.common.config import load_config
    from kava_ray.recipes.cka import measure_cka

    job = write_job(tmp_path, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                    teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"},
                              {"name": "qtok", "model": str(qtok_teacher_dir), "dtype": "float32"}])
    res = measure_cka(load_config(job), samples=4, features="k", out=tmp_path / "x.json", progress=False)
    same, other = res["teachers"]["qwen"], res["teachers"]["qtok"]
    assert torch.tensor(other["cka"]).shape == (2, 3) and "cka_k" not in other
    assert 0 < other["tokens"] <= same["tokens"]
    assert load_layer_map(res["path"], "qtok")[0][1][0][0] in (0, 1, 2)
