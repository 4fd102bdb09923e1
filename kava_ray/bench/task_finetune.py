"""`bench task`'s fine-tunes: the teachers (until held-out exact match plateaus) and the student's
SFT warm start, each the production step on CE alone (`bench.inprocess.train_in_process`), kept by
content.

A fine-tune is named by what defines it (the base model, its layers, the records' content, the sizes
and rate): the same inputs find the saved model under the cache directory
(`<cache>/bench-task/<name>-<key>/`) and its curve beside it, whatever the bench's --out, so the
teachers are fine-tuned once per records file.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from kava_ray.bench.inprocess import run_key, train_in_process
from kava_ray.bench.task_records import ArmSizes, score
from kava_ray.common.config import JobConfig, derive
from kava_ray.common.files import default_cache_dir, write_json
from kava_ray.core.models import load_model
from kava_ray.runtime.console import quiet, status
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans


@dataclass
class ArmContext:
    """What every arm's run of a records bench (`bench task`, `bench scarce`) reads: the job, the
    bench's sizes (`p`), the output dir, the tokenizer, the warm start's dir, the scorer of a
    student, the validation rows and split (what the rate grid selects by) and the progress line."""

    base: JobConfig
    p: ArmSizes
    root: Path
    tok: Any
    warm: str
    evaluate: Callable
    val: list
    val_split: Any
    say: Callable

    @property
    def done(self) -> Path:  # finished runs, read back by a re-run with the same --out
        return self.root / "runs_done"


def bench_dirs(base: JobConfig, name: str, out: Optional[str], cache: Optional[str], quick: bool) -> tuple[Path, Path]:
    """(the bench's output dir, made: `out`, else <ray.storage_path>/bench-<name>-<time>; where its
    fine-tunes are kept: `cache`, else OUT/cache with `quick`, else the kava-ray cache's
    bench-task/, which `bench task` and `bench scarce` share)."""
    from datetime import datetime

    root = Path(out or Path(base.ray.storage_path) / f"bench-{name}-{datetime.now():%Y%m%d-%H%M%S}")
    root = root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    keep = Path(cache).expanduser().resolve() if cache else (root / "cache" if quick else
                                                             default_cache_dir() / "bench-task")
    return root, keep


@contextlib.contextmanager
def bench_run(base: JobConfig, name: str, out: Optional[str], cache: Optional[str], quick: bool,
              verbose: bool = True) -> Iterator[tuple[Path, Path]]:
    """`bench_dirs` for the block, its console quiet unless `verbose`: the `[bench ...]` lines on
    the terminal, the libraries' (weights' progress bars, deprecations) in OUT/logs/driver.log
    (`runtime.console.quiet`)."""
    root, keep = bench_dirs(base, name, out, cache, quick)
    with quiet(root / "logs", verbose, ray_logs=False):
        yield root, keep


def reporter(name: str, progress: bool) -> Callable[[str], None]:
    """`say`: one progress line on the console (`[bench <name>] ...`), or nothing without `progress`."""
    def say(msg: str) -> None:
        if progress:
            status(f"[bench {name}] {msg}")
    return say


def records_job(base: JobConfig, records: Path, teachers: list, student: str, keep: Optional[list], p: ArmSizes,
                root: Path) -> JobConfig:
    """The bench's job on the gsm8k records under `records` ({split}.jsonl): `teachers` [(name,
    model dir)], `student` (layer-dropped to `keep`), CE + logit KD (weight 1) and nothing else (no
    KV: a linear projector, not fitted before step 1 as `auto` would, teacher forwards for nothing),
    teachers live in process, a constant rate after 2 warm-up steps, completions sampled at
    temperature 1 (top_p 1) up to p.max_new."""
    return derive(base, {
        "teachers": [{"name": n, "model": str(m), "dtype": "float32"} for n, m in teachers], "fusion.weights": None,
        "student.model": str(student), "student.keep_layers": keep, "student.dtype": "float32",
        "data.source": f"{records}/{{split}}.jsonl", "data.format": "gsm8k", "data.val_split": "validation",
        "data.num_train": None, "data.num_val": None, "data.num_test": None, "data.packing": None,
        "data.kv_source": "live", "data.kv_cache_dir": None, "train.max_length": p.max_length,
        "train.batch_size": p.batch_size, "onpolicy.max_new_tokens": p.max_new, "onpolicy.temperature": 1.0,
        "onpolicy.top_p": 1.0, "align.projector.kind": "linear", "loss.kv_weight": 0.0, "loss.logit_weight": 1.0,
        "loss.relation_weight": 0.0,
        "loss.hidden_weight": 0.0, "loss.ce_weight": 1.0, "optim.schedule": "constant", "optim.warmup_steps": 2,
        "ray.storage_path": str(root / "runs")})


def plateaued(curve: list, patience: int, delta: float, min_step: int = 0) -> bool:
    """The held-out exact match has plateaued: past `min_step` (a model that has not learnt the
    format yet sits flat at 0 %), the best of the last `patience` evaluations is not `delta` above
    the best before them (curve: [(step, {"em": ...})])."""
    if len(curve) <= patience or curve[-1][0] < min_step:
        return False
    ems = [c[1]["em"] for c in curve]
    return max(ems[-patience:]) <= max(ems[:-patience]) + delta


def finetune(base: JobConfig, name: str, records: Path, content: str, student: str, keep: Optional[list],
             val_rows: list, checker: str, p: ArmSizes, steps: int, lr: float, cache: Path, root: Path, tok,
             say: Callable[[str], None], plateau: bool, reach: Optional[float] = None) -> dict:
    """CE fine-tune of `student` (layers `keep`) on `records` at rate `lr`, evaluated every
    p.ft_every steps: at most `steps` steps, with `plateau` until the validation exact match
    plateaus (past p.ft_min), with `reach` until it is at least `reach` (a warm start that writes
    the answer format and gets some right). Returns {"path", "curve" [(step, {em, ...})], "steps",
    "wall_s", "kept"}; read back from the cache."""
    sizes = ("max_length", "batch_size", "max_new", "ft_every", "ft_patience", "ft_delta", "ft_min")
    key = run_key({"name": name, "student": str(student), "keep": keep, "records": content, "steps": steps,
                   "lr": lr, "plateau": plateau, **({} if reach is None else {"reach": reach}),
                   **{k: getattr(p, k) for k in sizes}})
    out = cache / f"{name}-{key}"
    meta_path = out / "finetune.json"
    if meta_path.is_file() and (out / "config.json").is_file():
        meta = json.loads(meta_path.read_text())
        say(f"{name}: kept from {out} ({meta['steps']} steps, validation exact match "
            f"{100 * meta['curve'][-1][1]['em']:.1f} %)")
        return {**meta, "kept": True}
    cfg = derive(records_job(base, records, [("base", student)], student, keep, p, root),
                 {"loss.logit_weight": 0.0, "optim.lr_student": lr, "train.steps": steps, "train.seed": 0})
    models = {"base": load_model(str(student), dtype="float32")}
    t0 = time.time()

    every = p.ft_every  # the curve of a fixed-length fine-tune too
    evals = [0]

    def evaluate(recipe) -> dict:
        r = score(recipe.distiller.student, tok, val_rows, checker, p)
        say(f"{name}: step {min(evals[0] * every, steps)}, validation exact match {100 * r['em']:.1f} % "
            f"({r['correct']}/{r['n']}, {time.time() - t0:.0f} s)")
        evals[0] += 1
        return {"em": r["em"]}

    def flat(curve) -> bool:
        return plateaued(curve, p.ft_patience, p.ft_delta, p.ft_min)

    def reached(curve) -> bool:
        return reach is not None and curve[-1][1]["em"] >= reach

    def stop(curve) -> bool:
        return reached(curve) or (plateau and flat(curve))

    run = train_in_process(cfg, in_process_plans(cfg, models), InProcessSource(models), steps, every, evaluate,
                           stop=stop)
    run["recipe"].distiller.student.save_pretrained(out)
    tok.save_pretrained(out)
    meta = {"path": str(out), "curve": run["curve"], "steps": run["curve"][-1][0], "wall_s": time.time() - t0,
            "plateaued": flat(run["curve"]) if plateau else None, "reached": reached(run["curve"]) if reach else None}
    write_json(meta_path, meta)
    return {**meta, "kept": False}
