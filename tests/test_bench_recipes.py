"""`kava-ray bench recipes` on the tiny models: four recipes over one precomputed teacher cache."""

from __future__ import annotations

import json
import math
from pathlib import Path

from jobs import write_job


def test_bench_recipes_tiny(ray_session, tmp_path, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir, capsys):
    from kava_ray.bench.recipes import RECIPES, format_recipes, run_recipes_bench
    from kava_ray.cli import _print_json_last

    job = write_job(tmp_path, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                    loss={"logit_top_k": 8})
    # 1 seed keeps the test near a minute on 2 cores (each TorchTrainer run costs ~15 s); the bench defaults to 3
    out = run_recipes_bench(str(job), steps=2, seeds=1, out=str(tmp_path / "bench"), limit=2, max_new_tokens=4,
                            eval_steps=1, progress=False)
    assert list(out["recipes"]) == list(RECIPES)
    for name, r in out["recipes"].items():
        assert math.isfinite(r["test_ce"]["mean"]), name
        assert len(r["runs"]) == 1 and r["eval_ce_curve"], name
        has_logits = RECIPES[name][1] > 0
        assert all((r["top1_agree"][t] is not None) == has_logits for t in ("qwen", "llama")), name
    assert 0 < out["teacher_forwards_per_sample"] <= 1.0
    assert Path(out["plot"]).is_file() and Path(out["plot"]).stat().st_size > 0
    text = format_recipes(out)
    assert "ce+kv+logits" in text and "teacher forwards per training sample" in text
    capsys.readouterr()
    _print_json_last(out)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["recipes"].keys() == out["recipes"].keys()
