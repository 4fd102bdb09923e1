"""Job configs over the tiny test models, written as YAML the way a user would."""

from __future__ import annotations

import json
from pathlib import Path

import yaml


def job_dict(qwen_dir, llama_dir, student_dir, storage) -> dict:
    return {
        "name": "tiny",
        "teachers": [
            {"name": "qwen", "model": str(qwen_dir), "dtype": "float32"},
            {"name": "llama", "model": str(llama_dir), "dtype": "float32", "quantization": "4bit"},
        ],
        "student": {"model": str(student_dir), "dtype": "float32"},
        "data": {"source": "synthetic", "num_train": 64, "num_test": 8, "num_val": 8},
        "align": {"mode": "structured", "projector": {"kind": "linear", "dropout": 0.0}, "prefetch_depth": 2},
        "loss": {"kind": "mercator", "beta": 0.01},
        "optim": {"lr_student": 1e-3, "lr_projector": 3e-3, "warmup_steps": 0},
        "train": {"steps": 4, "batch_size": 4, "max_length": 288, "log_steps": 1, "eval_steps": 2, "save_steps": 2},
        "ray": {"namespace": "kava-test", "storage_path": str(storage), "num_workers": 1, "use_gpu": False},
    }


def write_job(tmp: Path, qwen_dir, llama_dir, student_dir, **sections) -> Path:
    """YAML file of `job_dict`, with whole sections replaced/merged from `sections`."""
    d = job_dict(qwen_dir, llama_dir, student_dir, Path(tmp) / "runs")
    for k, v in sections.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    path = Path(tmp) / "job.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


# ------------------------------------------------------------------ the worker loop in process, and its curves


def run_recipe(cfg, plans: dict, source, steps: int, ckpt_dir=None, resume=None, save_at=None, grad_share=False):
    """What a Ray Train worker does (one rank), in this process: the production DistillRecipe and its step source,
    from the checkpoint `resume` (or step 0) to `steps`; after step `save_at`, a checkpoint into `ckpt_dir`.
    Returns ({step: metrics as floats, with the cumulative `skipped`}, recipe, step source)."""
    from kava_ray.recipes.distill import DistillRecipe
    from kava_ray.recipes.fit_maps import fit_maps

    recipe = DistillRecipe(cfg, plans)
    state = recipe.setup(resume)
    fit_maps(recipe, source)
    data = recipe.data(source, until=steps, state=state["data"] if state else None)
    out = {}
    for step in range(recipe.start_step + 1, steps + 1):
        values = recipe.step(step, data.next_step(step), grad_share)
        out[step] = {k: float(v) for k, v in values.items()} | {"skipped": data.skipped}
        if step == save_at:
            recipe.save(ckpt_dir, step, data.state_dict())
    return out, recipe, data


def pool_beside(job_path):
    """A module fixture's body: the job's teachers missing from the session's pool started for the module, held (Ray
    ends a non-detached actor once no handle to it is left), then stopped -- only those."""
    from actors.pool import start_missing, stop_pool
    from kava_ray.common.config import load_config

    cfg = load_config(job_path)
    handles, started = start_missing(cfg)
    yield handles
    stop_pool(cfg, only=started)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_steps(run_dir) -> dict[int, dict]:
    """{step: record} of a run's train records (metrics.jsonl)."""
    return {r["step"]: r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r["kind"] == "train"}


def train_records_so_far(run_dir) -> list[dict]:
    """The train records of a run still writing its metrics.jsonl, in order: only complete lines (a poll may read a
    line half written); [] before the file exists."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()[:text.count("\n")]  # a last line without its newline is still being written
    return [r for r in map(json.loads, filter(str.strip, lines)) if r["kind"] == "train"]


def train_steps_so_far(run_dir) -> dict[int, dict]:
    """`train_steps` of a run still writing (`train_records_so_far`); {} before the file exists."""
    return {r["step"]: r for r in train_records_so_far(run_dir)}


def assert_same_curve(got: dict, want: dict, steps, keys=("loss", "ce", "kv_loss", "cos_sim"), tol=1e-5) -> None:
    """Every `keys` metric of every step in `steps` equal within `tol` (runs that must be one curve)."""
    import pytest

    for step in steps:
        for key in keys:
            assert got[step][key] == pytest.approx(want[step][key], abs=tol), (step, key)


def padded_rows(tok):
    """Three short texts as `tok`'s ids [3, T] and mask: two right-padded rows and a left-padded one (a teacher's
    forward must read both paddings)."""
    import torch

    rows = [tok(x)["input_ids"][:16] for x in ("The quick brown fox jumps over the lazy dog, again and again.",
                                               "Sorted: 15 43 59 63 75", "def f(x): return x")]
    T = max(map(len, rows))
    ids, mask = torch.zeros((3, T), dtype=torch.long), torch.zeros((3, T), dtype=torch.long)
    for b, r in enumerate(rows):
        pos = slice(T - len(r), T) if b == 2 else slice(0, len(r))  # the last row left-padded
        ids[b, pos], mask[b, pos] = torch.tensor(r), 1
    return ids, mask
