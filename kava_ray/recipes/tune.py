"""`kava-ray tune`: Ray Tune over projector and loss hyper-parameters, one shared teacher pool.

A trial is a function (`trial_fn`: Ray 2.60 runs Train V2) that builds a TorchTrainer for its
sampled config. The Tune driver starts the teacher pool once and every trial's workers find it by
name; all trials walk the same batches, so each teacher computes a batch's KV once for the whole
sweep. Outputs in `<storage>/<name>/`, `best.yaml` among them: docs/internals/runtime.md#tune.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import os
import signal
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import ray
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from actors.pool import pool_stats
from kava_ray.common import resources
from kava_ray.common.config import JobConfig, validate_config
from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_path, atomic_write, first_line, format_table
from kava_ray.common.run_lock import run_lock
from kava_ray.common.trackers import mlflow_uri
from kava_ray.core.metric_names import EVALS
from kava_ray.core.models import KVGeometry
from kava_ray.core.plans import student_geometry, teacher_plans
from kava_ray.recipes.step_records import evals_before_end
from kava_ray.recipes.train import build_trainer, fit, teachers_status
from kava_ray.runtime.connect import resolve_use_gpu
from kava_ray.runtime.console import status
from kava_ray.runtime.job import job_session, job_teachers
from kava_ray.runtime.preflight import preflight
from kava_ray.runtime.ray_private import wait_for_tune_reports
from kava_ray.runtime.tune_space import (
    apply_params,
    drop_inert,
    load_space,
    make_scheduler,
    make_search_alg,
    planned_trials,
    projector_kinds,
    to_param_space,
)

logger = logging.getLogger(__name__)


def trial_dir(cfg: JobConfig) -> Path:
    """This trial's dir in the experiment's storage (not Tune's local staging dir), shared by all nodes."""
    ctx = tune.get_context()
    path = (Path(cfg.ray.storage_path).expanduser().resolve() / ctx.get_experiment_name()
            / Path(ctx.get_trial_dir()).name)
    path.mkdir(parents=True, exist_ok=True)
    return path


def trial_fn(config: dict, setup: dict) -> None:
    """One Tune trial: the base job + this trial's params -> TorchTrainer.fit() reporting to Tune. `config` holds only
    the searched params (what Tune shows and records); `setup` the constant rest (base config, geometries), passed once
    through the object store by tune.with_parameters. The trial's workers find the shared teacher pool by name."""
    cfg = apply_params(validate_config(setup["base"]), config["params"])
    geoms = setup["geometries"]
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, KVGeometry.from_dict(setup["student_geometry"]),
                          tokenizer_dirs={n: g["tokenizer"] for n, g in geoms.items() if g.get("tokenizer")})
    run_dir = trial_dir(cfg) / "run"
    try:
        fit(build_trainer(cfg, plans, run_dir, setup["use_gpu"], callbacks=[TuneReportCallback()]), run_dir)
    finally:
        wait_for_tune_reports()  # every report handed to Tune before this function returns (a Ray 2.60 race)


def derive_max_concurrent(cfg: JobConfig, use_gpu: bool) -> int:
    """How many trials fit at once: free CPUs (and GPUs) after the shared teachers, per trial's workers."""
    total = ray.cluster_resources()
    teachers, per_trial = resources.pool(cfg), resources.run(cfg, use_gpu)
    fits = [math.floor((total.get(k, 0) - teachers[k]) / v + 1e-9) for k, v in per_trial.items() if v > 0]
    n = min(fits) if fits else 1
    if n < 1:
        raise KavaError(f"one trial needs {per_trial} besides the teachers, the cluster has {dict(total)}")
    return n


def experiment_dir(cfg: JobConfig, name: Optional[str] = None, resume: Optional[str] = None) -> Path:
    """Where a sweep lives: `resume` (a sweep dir, or a sweep name under ray.storage_path), else
    `<storage_path>/<name>` (a timestamped name when none is given)."""
    storage = Path(cfg.ray.storage_path).expanduser().resolve()
    if resume:
        given = Path(resume).expanduser()
        return given.resolve() if given.is_dir() or given.parent != Path(".") else storage / resume
    return storage / (name or f"{cfg.name}-tune-{datetime.now():%Y%m%d-%H%M%S}")


def tracker_callbacks(cfg: JobConfig, exp_dir: Path) -> list:
    """train.loggers as Tune's own logger callbacks: one entry per trial (its searched params, every
    reported result at Tune's training_iteration) beside each trial's own rank-0 tracking of its
    metrics.jsonl (kava_ray.common.trackers, in the trial's run dir). TensorBoard:
    TBXLoggerCallback, event files in each trial dir; MLflow: one experiment named after the sweep,
    $MLFLOW_TRACKING_URI or file:<sweep>/mlruns; W&B: project = the job's name, group = the sweep,
    WANDB_MODE offline unless set."""
    out = []
    if "tensorboard" in cfg.train.loggers:
        # each tracker's callback where it is asked for: the mlflow and wandb ones import those (heavy, optional)
        from ray.tune.logger import TBXLoggerCallback

        out.append(TBXLoggerCallback())
    if "mlflow" in cfg.train.loggers:
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        out.append(MLflowLoggerCallback(tracking_uri=mlflow_uri(exp_dir), experiment_name=exp_dir.name))
    if "wandb" in cfg.train.loggers:
        from ray.air.integrations.wandb import WandbLoggerCallback

        os.environ.setdefault("WANDB_MODE", "offline")  # its setup() reads it (no API key asked for offline)
        out.append(WandbLoggerCallback(project=cfg.name, group=exp_dir.name, mode=os.environ["WANDB_MODE"]))
    return out


DEFAULT_EMBEDDED_TRIALS = 2  # concurrent trials an embedded Ray is sized for when none is asked for


def run_tune(cfg: JobConfig, space: str, num_samples: Optional[int] = None, max_concurrent: Optional[int] = None,
             resume: Optional[str] = None, name: Optional[str] = None, address: Optional[str] = None,
             trial=None, restart_teachers: bool = False) -> dict:
    """Run (or, with `resume` = a sweep dir or name, continue) a sweep; returns the experiment dir,
    the result rows and the best config path.

    trial: a trial function to use instead of `trial_fn`; it then brings its own teachers (the
    shared pool is not started). `kava-ray bench tune-share` passes one that starts teachers per
    trial.
    """
    preflight(cfg, "tune", resume=resume, space=space, address=address, name=name)  # the space first, then data...
    spec = load_space(space, base=cfg)  # every space error before anything starts
    exp_dir = experiment_dir(cfg, name, resume)
    with run_lock(exp_dir, "kava-ray tune" + (" --resume" if resume else ""), say=status):  # one writer, before Ray
        return _tune(cfg, spec, exp_dir, resume, num_samples, max_concurrent, address, trial, restart_teachers)


def _tune(cfg: JobConfig, spec, exp_dir: Path, resume, num_samples, max_concurrent, address, trial,
          restart_teachers: bool) -> dict:
    if resume and not tune.Tuner.can_restore(str(exp_dir)):
        raise KavaError(f"nothing to resume at {exp_dir} (pass the directory of an earlier sweep)")
    runs = max_concurrent or spec.max_concurrent or DEFAULT_EMBEDDED_TRIALS
    if trial is not None:  # the trials bring their own teachers: only Ray here
        with job_session(cfg, address, concurrent_runs=runs):
            return _sweep(cfg, spec, exp_dir, resume, num_samples, max_concurrent, trial, None, {})
    with job_teachers(cfg, address, restart=restart_teachers, concurrent_runs=runs, command="tune") as job:
        teachers_status(job)
        # a dimension this job makes inert (an elastic projector's knobs where the projector is identity): one line
        spec, dropped = drop_inert(spec, cfg, projector_kinds(cfg, job.plans, student_geometry(cfg.student)))
        if dropped:
            status(dropped)
        # with how each teacher's tokens meet the student's (one to one, or by characters) for the trials' plans
        geoms = {n: dict(p.geometry.to_dict(), tokenizer_fingerprint=p.tokenizer_fingerprint,
                         tokenizer=p.tokenizer) for n, p in job.plans.items()}
        return _sweep(cfg, spec, exp_dir, resume, num_samples, max_concurrent, trial_fn, job.handles, geoms)


def _sweep(cfg: JobConfig, spec, exp_dir: Path, resume, num_samples, max_concurrent, trial, handles, geoms) -> dict:
    """The Tuner over `trial` (Ray is up; the shared pool, if any, is `handles`)."""
    use_gpu = resolve_use_gpu(cfg.ray.use_gpu)
    limit = max_concurrent or spec.max_concurrent or derive_max_concurrent(cfg, use_gpu)
    setup = {"base": cfg.to_dict(), "geometries": geoms, "student_geometry": student_geometry(cfg.student).to_dict(),
             "use_gpu": use_gpu}
    # the trial function only drives; its Train workers and teachers ask for their own resources
    trainable = tune.with_resources(tune.with_parameters(trial, setup=setup), {"CPU": resources.TRIAL_CPUS})
    param_space = {"params": to_param_space(spec)}
    if resume:  # Tune restores the sweep's own TuneConfig (its size and concurrency), not this command's
        status(f"tune: continuing the sweep in {exp_dir}")
        tuner = tune.Tuner.restore(str(exp_dir), trainable=trainable, param_space=param_space,
                                   resume_unfinished=True, resume_errored=True)
    else:
        planned = planned_trials(spec, num_samples)
        size = f"{planned} trial{'s' if planned != 1 else ''}" if planned > 0 else "trials without a limit"
        status(f"tune: {size}, up to {limit} at a time -> {exp_dir}")
        tuner = tune.Tuner(
            trainable, param_space=param_space,
            tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.mode, num_samples=num_samples or spec.num_samples,
                                        scheduler=make_scheduler(spec.scheduler, evals_before_end(cfg.train)),
                                        search_alg=make_search_alg(spec.search), max_concurrent_trials=limit,
                                        trial_name_creator=short_name, trial_dirname_creator=short_name),
            run_config=tune.RunConfig(name=exp_dir.name, storage_path=str(exp_dir.parent), verbose=1,
                                      callbacks=[*tracker_callbacks(cfg, exp_dir),
                                                 SweepStatus(spec.metric, spec.mode, cfg.train.steps, planned)]))
    before = pool_stats(handles) if handles else {}  # a pool found running has served other runs
    with ctrl_c_saves_the_sweep() as interrupted:
        grid = tuner.fit()
    if interrupted():
        raise KeyboardInterrupt(f"the sweep's state is saved in {exp_dir}: --resume {exp_dir} continues it")
    teacher_stats = pool_stats(handles, since=before) if handles else {}
    return dict(summarize(grid, cfg, spec, exp_dir), teacher_stats=teacher_stats)


def short_name(trial) -> str:
    """`trial_<id>`: a trial's name and directory (Tune's default, `trial_fn_<id>_<n>_<every
    param=value>_<date>`, runs past 100 characters; the values are in results.csv and the plot's
    legend)."""
    return f"trial_{trial.trial_id}"


class SweepStatus(tune.Callback):
    """Status lines while a sweep runs (`kava-ray tune` is otherwise silent for minutes): each time
    a trial ends, and at most every 30 s as results arrive -- trials done / running / stopped early,
    and the best so far. Its state (best values, last steps) is saved with the sweep's and restored
    by `--resume` (Tune's callback state)."""

    total = 0  # the sweep's size (`planned_trials`); a class default for a callback pickled before it existed

    def __init__(self, metric: str, mode: str, steps: int, total: int = 0, every_s: float = 30.0):
        self.metric, self.mode, self.steps, self.total, self.every_s = metric, mode, steps, total, every_s
        self.best: dict = {}  # trial name -> its best metric so far
        self.last_step: dict = {}
        self.said = 0.0

    def get_state(self) -> dict:
        return {"best": dict(self.best), "last_step": dict(self.last_step)}

    def set_state(self, state: dict) -> None:
        self.best, self.last_step = dict(state.get("best", {})), dict(state.get("last_step", {}))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        v = result.get(self.metric)
        if isinstance(v, (int, float)) and v == v and result.get(EVALS, 0) > 0:  # judged after training began
            old = self.best.get(str(trial))
            self.best[str(trial)] = v if old is None else (max if self.mode == "max" else min)(old, v)
        self.last_step[str(trial)] = result.get("step", 0)
        if time.monotonic() - self.said >= self.every_s:
            self._say(trials)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._say(trials, ending=trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._say(trials, ending=trial, failed=True)

    def _say(self, trials, ending=None, failed: bool = False) -> None:
        """`ending`: the trial whose end calls this, counted as ended (Tune calls
        `on_trial_complete` before it marks the trial TERMINATED: the last trial's line read "2/3
        done, 1 running"). Never raises: an exception in a callback would turn the finished trial
        into an error (`TuneController._schedule_trial_stop`)."""
        try:
            self._line(trials, ending, failed)
        except Exception:  # noqa: BLE001 - a status line must not fail a trial (e.g. a closed terminal)
            logger.debug("tune status line failed", exc_info=True)

    def _line(self, trials, ending, failed: bool) -> None:
        self.said = time.monotonic()
        status_of = {str(t): t.status for t in trials}
        if ending is not None:
            status_of[str(ending)] = "ERROR" if failed else "TERMINATED"
        ended = [t for t, st in status_of.items() if st in ("TERMINATED", "ERROR")]
        early = sum(1 for t in ended if status_of[t] == "TERMINATED" and self.last_step.get(t, 0) < self.steps)
        n_failed = sum(1 for t in ended if status_of[t] == "ERROR")
        running = sum(1 for st in status_of.values() if st == "RUNNING")
        line = (f"tune: {len(ended)}/{max(self.total, len(status_of))} trials done ({early} stopped early, "
                f"{n_failed} failed), {running} running")
        if self.best:
            pick = max if self.mode == "max" else min
            name = pick(self.best, key=self.best.get)
            line += f"; best {self.metric} {self.best[name]:.4g} ({name})"
        status(line)


@contextlib.contextmanager
def ctrl_c_saves_the_sweep():
    """Around `Tuner.fit()`: a Ctrl+C stops the sweep as Tune's own handler does (Tune saves the
    experiment's state and fit() returns), and the caller learns that it happened (`interrupted()`),
    which the returned grid does not say: Tune marks the trials it stopped TERMINATED, like finished
    ones. Tune's documented switches: with TUNE_DISABLE_SIGINT_HANDLER=1 it leaves SIGINT to us, and
    its SIGUSR1 handler is the same graceful stop. A second Ctrl+C (or one before Tune is listening)
    raises KeyboardInterrupt at once."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield lambda: False
        return
    hits = []
    usr1 = signal.getsignal(signal.SIGUSR1)  # Tune is listening once fit() has put its own handler there

    def on_sigint(sig, frame):
        listening = signal.getsignal(signal.SIGUSR1) not in (usr1, signal.SIG_DFL, signal.SIG_IGN, None)
        if hits or not listening:
            raise KeyboardInterrupt
        hits.append(sig)
        os.kill(os.getpid(), signal.SIGUSR1)

    before = signal.signal(signal.SIGINT, on_sigint)
    env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    try:
        yield lambda: bool(hits)
    finally:
        signal.signal(signal.SIGINT, before)
        if usr1 is not None:
            signal.signal(signal.SIGUSR1, usr1)
        if env is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER")
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = env


def summarize(grid, cfg: JobConfig, spec, exp_dir: Path) -> dict:
    """results.csv, trials.png and best.yaml from a ResultGrid."""
    rows, curves = [], {}
    better = max if spec.mode == "max" else min
    for r in grid:
        df = r.metrics_dataframe
        trial = Path(r.path).name
        hist = [] if df is None or spec.metric not in df else [
            (int(s), float(v)) for s, v in zip(df["step"], df[spec.metric]) if v == v]
        curves[trial] = hist
        steps = int(df["step"].max()) if df is not None and "step" in df else 0
        rows.append({"trial": trial, **{k: r.config["params"][k] for k in sorted(r.config["params"])},
                     f"best {spec.metric}": better((v for _, v in hist), default=float("nan")),
                     "steps": steps, "stopped_early": steps < cfg.train.steps and r.error is None,
                     "error": "" if r.error is None else first_line(r.error)[:120]})
    ok = [row for row in rows if not row["error"] and not math.isnan(row[f"best {spec.metric}"])]
    if not ok:
        raise KavaError(f"no trial reported {spec.metric}; see {exp_dir}")
    best = better(ok, key=lambda row: row[f"best {spec.metric}"])
    best_params = next(r.config["params"] for r in grid if Path(r.path).name == best["trial"])
    exp_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(exp_dir / "best.yaml", apply_params(cfg, best_params).to_yaml())
    with atomic_path(exp_dir / "results.csv") as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    varied = [k for k in sorted(spec.params)]
    labels = {row["trial"]: ", ".join(f"{k.rsplit('.', 1)[-1]}={_short(row[k])}" for k in varied) for row in rows}
    _plot(curves, labels, spec.metric, exp_dir / "trials.png")
    return {"exp_dir": str(exp_dir), "rows": rows, "best": best, "best_config": str(exp_dir / "best.yaml")}


def _short(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _plot(curves: dict, labels: dict, metric: str, path: Path) -> None:
    """Each trial's metric over steps, labelled with the values it searched (`lr_student=3e-05, dropout=0.1`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # matplotlib: heavy, loaded for plots only
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for trial, hist in curves.items():
        if hist:
            ax.plot([s for s, _ in hist], [v for _, v in hist], marker="o", label=labels.get(trial, trial))
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.legend(fontsize=6)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def format_results(out: dict) -> str:
    rows = out["rows"]
    header = [k for k in rows[0] if k != "error" or any(r["error"] for r in rows)]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join([format_table(header, [[fmt(r[k]) for k in header] for r in rows]),
                      f"best: {out['best']['trial']} -> {out['best_config']}  "
                      f"(kava-ray train --config {out['best_config']})"])
