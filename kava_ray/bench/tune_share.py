"""`kava-ray bench tune-share`: one shared teacher pool vs teachers per trial, in one invocation.

The same tiny sweep (FIFO, `trials` trials of `steps` steps, tiny Qwen2 + NF4 Llama teachers) runs
twice: every trial's workers asking one pool started by the Tune driver, then each trial starting
its own teachers (what a naive sweep does). Reported: teacher forwards per training sample — a
forward covers one batch, so this is forwards per distinct batch the sweep trained or evaluated on
(1.0 = each batch's KV computed once for the whole sweep) — and the sweep's wall time.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import ray
import yaml
from ray import tune

from actors.pool import pool_stats
from kava_ray.common.config import derive, load_config, validate_config
from kava_ray.common.files import format_table, write_json
from kava_ray.recipes.tune import run_tune, trial_dir, trial_fn
from kava_ray.runtime.connect import disconnect
from kava_ray.runtime.job import job_teachers, teacher_geometries
from kava_ray.testing.tiny import build_tiny_model

SPACE = {"metric": "eval/cos_sim", "mode": "max", "scheduler": {"kind": "fifo"}, "search": {"kind": "random"},
         "params": {"optim.lr_projector": {"choice": [1e-3, 3e-3, 1e-2]}, "loss.beta": {"choice": [0.0, 0.01]}}}


def tiny_job(root: Path, steps: int) -> Path:
    q = build_tiny_model(root / "qwen", "qwen2", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, seed=0)
    ll = build_tiny_model(root / "llama", "llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2,
                          head_dim=32, seed=1)
    s = build_tiny_model(root / "student", "qwen2", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=1, seed=2)
    job = {
        "name": "tune-share",
        "teachers": [{"name": "qwen", "model": str(q), "dtype": "float32"},
                     {"name": "llama", "model": str(ll), "dtype": "float32", "quantization": "4bit"}],
        "student": {"model": str(s), "dtype": "float32"},
        "data": {"num_train": 64, "num_test": 8, "num_val": 8},
        "align": {"projector": {"kind": "linear", "dropout": 0.0}},
        "train": {"steps": steps, "batch_size": 4, "max_length": 256, "eval_steps": steps, "save_steps": steps},
        # per-trial teachers need room for 2 trials x (2 teachers + 1 worker + Train's controller)
        "ray": {"storage_path": str(root / "runs"), "num_workers": 1, "use_gpu": False, "num_cpus": 8},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    (root / "space.yaml").write_text(yaml.safe_dump(SPACE))
    return root / "job.yaml"


def forwards_per_batch(stats: list[dict], distinct_batches: int) -> float:
    """Mean over teachers of forwards / distinct batches."""
    per_teacher: dict = {}
    for s in stats:
        for name, st in s.items():
            per_teacher[name] = per_teacher.get(name, 0) + st["forwards"]
    return sum(per_teacher.values()) / len(per_teacher) / distinct_batches


def own_teachers_trial(config: dict, setup: dict) -> None:
    """The naive sweep this bench compares against: each trial starts (and stops) its own teachers
    in a namespace of its own (`job_teachers` in the trial's Ray), then runs the production trial
    (`kava_ray.recipes.tune.trial_fn`) against them."""
    cfg = derive(validate_config(setup["base"]), {"ray.namespace": f"kava-{tune.get_context().get_trial_id()}"})
    with job_teachers(cfg) as job:
        try:
            trial_fn(config, dict(setup, base=cfg.to_dict(), geometries=teacher_geometries(job.handles)))
        finally:
            write_json(trial_dir(cfg) / "teacher_stats.json", pool_stats(job.handles), indent=None)


def run_tune_share(trials: int = 4, steps: int = 6) -> dict:
    """Both sweeps over one tiny job; teacher forwards per distinct batch and wall time of each."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = load_config(tiny_job(root, steps))
        # the sweep trains on `steps` batches, validates on the validation batches and tests once on
        # the test batches at the end (the same keys in every trial)
        distinct = (steps * cfg.optim.accumulation * cfg.ray.num_workers
                    + cfg.data.num_val // cfg.train.batch_size + cfg.data.num_test // cfg.train.batch_size)
        started = not ray.is_initialized()
        out = {"trials": trials, "steps": steps, "distinct_batches": distinct}
        try:
            for mode, trial in (("shared", None), ("per_trial", own_teachers_trial)):
                t0 = time.time()
                res = run_tune(cfg, str(root / "space.yaml"), num_samples=trials, max_concurrent=2,
                               name=f"sweep-{mode}", trial=trial)
                wall = time.time() - t0
                if trial is not None:
                    stats = [json.loads(p.read_text()) for p in Path(res["exp_dir"]).glob("*/teacher_stats.json")]
                else:
                    stats = [res["teacher_stats"]]
                out[mode] = {"wall_s": wall, "forwards_per_batch": forwards_per_batch(stats, distinct),
                             "trials_finished": sum(1 for r in res["rows"] if not r["error"])}
        finally:
            if started:
                disconnect()
    out["wall_ratio_per_trial_over_shared"] = out["per_trial"]["wall_s"] / out["shared"]["wall_s"]
    return out


def format_tune_share(out: dict) -> str:
    rows = [[mode, f"{out[mode]['forwards_per_batch']:.2f}", f"{out[mode]['wall_s']:.0f} s",
             out[mode]["trials_finished"]] for mode in ("shared", "per_trial")]
    return "\n".join([
        f"tune-share bench: {out['trials']} trials x {out['steps']} steps, 2 concurrent, "
        f"{out['distinct_batches']} distinct batches (train + held-out)",
        format_table(["teachers", "teacher forwards per training sample", "sweep wall", "trials ok"], rows),
        f"per-trial teachers take {out['wall_ratio_per_trial_over_shared']:.2f}x the wall time of one shared pool"])
