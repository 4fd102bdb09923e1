"""`kava-ray bench recipes` on the tiny models: four recipes over one precomputed teacher cache, every student
scored alike, paired against `ce`; and the paired statistics on numbers worked by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jobs import write_job


def test_bench_recipes_tiny(tiny_pool, tmp_path, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir, capsys):
    from kava_ray.bench.recipes import format_recipes, run_recipes_bench
    from kava_ray.cli.shared import print_json_last

    job = write_job(tmp_path, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir)
    # 1 seed and two of the four recipes (`--recipes`: the base and the one with both losses, so every loss
    # term runs) keep the test near a minute on 2 cores: each TorchTrainer run costs ~15 s
    out = run_recipes_bench(str(job), steps=2, seeds=1, out=str(tmp_path / "bench"), limit=2, max_new_tokens=4,
                            num_test=8, eval_steps=1, progress=False, recipes=["ce", "ce+kv+logits"])
    assert list(out["summary"]) == ["ce", "ce+kv+logits"]
    for name, runs in out["arms"].items():
        (run,) = runs
        f = run["figures"]
        assert math.isfinite(f["test_ce"]) and f["kl"] > 0 and 0 <= f["top1"] <= 1, name  # the ce arm scored too
        assert run["eval_ce"] and run["score"]["tokens"] == out["test_tokens"] > 0, name
        assert -1 <= f["kv_cos_free"] <= 1 and f["exact"] is not None, name
        if name != "ce":  # one seed: a difference, no interval
            d = out["summary"][name]["vs_base"]["test_ce"]
            assert d["n"] == 1 and d["lo"] is None and d["mean"] == pytest.approx(f["test_ce"] - out["arms"]["ce"][0]
                                                                                  ["figures"]["test_ce"])
    assert out["teacher_forwards_per_sample"] == 1.0 and out["cached_examples"] > out["train_examples"]
    assert set(out["teacher_rows"]) == {"qwen", "llama"} and all(math.isfinite(r["test_ce"])
                                                                  for r in out["teacher_rows"].values())
    assert Path(out["plot"]).is_file() and Path(out["plot"]).stat().st_size > 0
    text = format_recipes(out)
    assert "ce+kv+logits" in text and "teacher forwards per training sample: 1.00" in text and "teacher qwen" in text
    capsys.readouterr()
    print_json_last(out)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["summary"].keys() == out["summary"].keys()


def test_paired_intervals_by_hand():
    from kava_ray.bench.recipes import summarize
    from kava_ray.bench.stats import fmt_interval, paired, t_quantile

    assert t_quantile(0.975, 2) == pytest.approx(4.3027, abs=1e-4)
    assert t_quantile(0.975, 9) == pytest.approx(2.2622, abs=1e-4)
    p = paired([3.0, 3.2, 3.1], [3.5, 3.6, 3.7])  # differences -0.5, -0.4, -0.6: mean -0.5, sd 0.1
    half = 4.3027 * 0.1 / math.sqrt(3)
    assert p["mean"] == pytest.approx(-0.5) and p["hi"] == pytest.approx(-0.5 + half, abs=1e-4) and p["excludes_zero"]
    assert fmt_interval(p, 2).endswith("*")
    noisy = paired([3.0, 3.9, 3.1], [3.5, 3.6, 3.7])
    assert not noisy["excludes_zero"] and not fmt_interval(noisy).endswith("*")
    # a seed's difference is paired with the same seed's baseline, not pooled: the shared seed effect cancels
    arms = {"ce": [{"figures": {"test_ce": 3.0 + s}} for s in (0.0, 1.0, 2.0)],
            "kd": [{"figures": {"test_ce": 2.9 + s}} for s in (0.0, 1.0, 2.0)]}
    d = summarize(arms)["kd"]["vs_base"]["test_ce"]
    assert d["mean"] == pytest.approx(-0.1) and d["hi"] == pytest.approx(-0.1) and d["excludes_zero"]


def test_mean_sd_over_the_values_that_exist():
    from kava_ray.bench.stats import mean_sd

    assert mean_sd([1.0, None, 3.0]) == {"mean": 2.0, "sd": pytest.approx(math.sqrt(2)), "n": 2}
    assert mean_sd([4.0]) == {"mean": 4.0, "sd": 0.0, "n": 1} and mean_sd([None]) is None
