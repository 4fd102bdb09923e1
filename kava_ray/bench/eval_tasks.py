"""`kava-ray bench eval-tasks`: what `train.eval_tasks` costs a run, the same job trained twice in one invocation.

The job (default: the demo's) runs through `run_training` (Ray Train, as `kava-ray train` runs it)
without harness tasks, then with `train.eval_tasks` at every evaluation (step 0, every
`train.eval_steps`, the last). Reported: each run's wall time (the driver's clock,
`metrics_file.wall_seconds`: Ray's start and the teachers' included, as a user waits for them),
their ratio, and the harness's own seconds in the second run (`eval/tasks_s` summed over its
evaluations: what the tasks cost exactly, free of the box's noise), with the figures of its last
evaluation.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

from kava_ray.common.config import derive, load_config
from kava_ray.common.files import format_table
from kava_ray.common.metrics_file import METRICS, read_metrics, wall_seconds
from kava_ray.core.metric_names import EVAL_TASKS_S, TASK_PREFIX
from kava_ray.recipes.train import run_training

DEFAULT_TASKS = ("kava_gsm8k", "kava_pydoc_ppl")


def _run(cfg, name: str) -> dict:
    t0 = time.perf_counter()
    out = run_training(cfg, name=name, progress=False)
    run_dir = Path(out["run_dir"])
    _, evals = read_metrics(run_dir / METRICS)
    return {"run_dir": str(run_dir), "wall_s": wall_seconds(run_dir) or time.perf_counter() - t0,
            "evaluations": len(evals), "tasks_s": sum(r.get(EVAL_TASKS_S, 0.0) for r in evals),
            "last": {k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith(TASK_PREFIX)}}


def run_eval_tasks_bench(config: str = "demo_cpu", overrides: Optional[Sequence[str]] = None,
                         tasks: Sequence[str] = DEFAULT_TASKS, limit: Optional[int] = 16,
                         out: Optional[str] = None) -> dict:
    """Both runs of `config` (+ `overrides`), the second with `train.eval_tasks` = `tasks` at `limit` documents."""
    base = load_config(config, list(overrides or []))
    storage = str(Path(out or Path(base.ray.storage_path) / "bench-eval-tasks").expanduser().resolve())
    base = derive(base, {"ray.storage_path": storage, "train.eval_tasks": []})
    with_tasks = derive(base, {"train.eval_tasks": list(tasks), "train.eval_tasks_limit": limit})
    off = _run(base, "without-tasks")
    on = _run(with_tasks, "with-tasks")
    return {"config": config, "tasks": list(tasks), "limit": limit, "steps": base.train.steps,
            "eval_steps": base.train.eval_steps, "without": off, "with": on,
            "wall_ratio": on["wall_s"] / off["wall_s"], "tasks_share": on["tasks_s"] / on["wall_s"]}


def format_eval_tasks_bench(r: dict) -> str:
    rows = [["without train.eval_tasks", f"{r['without']['wall_s']:.1f}", r["without"]["evaluations"], "—"],
            [f"with {','.join(r['tasks'])} (limit {r['limit']})", f"{r['with']['wall_s']:.1f}",
             r["with"]["evaluations"], f"{r['with']['tasks_s']:.1f}"]]
    text = format_table(["run", "wall s", "evaluations", "harness s"], rows)
    text += (f"\n\n{r['steps']} steps, an evaluation every {r['eval_steps']} (and at steps 0 and {r['steps']}); wall "
             f"ratio with / without: {r['wall_ratio']:.2f}x; the harness's own share of the run with it: "
             f"{r['tasks_share']:.1%}")
    last = r["with"]["last"]
    if last:
        text += "\nlast evaluation: " + ", ".join(f"{k[len(TASK_PREFIX):]} {v:.4g}" for k, v in last.items())
    return text
