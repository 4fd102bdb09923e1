"""`kava-ray train`, the driver: Ray, the teacher pool, a TorchTrainer over `distill.train_loop_per_worker`.

Connect to Ray (or start an embedded one sized for the job), start or find the teacher pool, read
the teachers' geometry and plan their layers (all through `kava_ray.runtime.job`), then
`TorchTrainer(train_loop_per_worker, ScalingConfig, RunConfig)`.fit() while a progress bar follows
`metrics.jsonl`. `build_trainer` and `fit` are shared with Tune's trials.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from kava_ray.common import resources
from kava_ray.common.config import JobConfig, load_config
from kava_ray.common.errors import KavaError, root_cause
from kava_ray.common.metrics_file import METRICS, SAMPLING, add_session, last, last_values, stopped_by
from kava_ray.common.run_lock import LOCK, run_lock
from kava_ray.core.checkpoint import checkpoint_config, find_checkpoint, read_state
from kava_ray.core.divergences import topk_divergence_warning
from kava_ray.core.plans import cross_vocab_lines, onpolicy_writer, plans_payload, student_geometry
from kava_ray.recipes.distill import LoopConfig, train_loop_per_worker
from kava_ray.runtime.console import quiet, status, with_logs
from kava_ray.runtime.job import job_teachers
from kava_ray.runtime.preflight import check_prompts, preflight, prepare_data
from kava_ray.runtime.process_group import LoopbackTorchConfig
from kava_ray.runtime.progress import follow_metrics
from kava_ray.runtime.ray_private import drop_train_sigint_handler, trim_train_callbacks


def build_trainer(cfg: JobConfig, plans: dict, run_dir: Path, use_gpu: bool, resume: Optional[str] = None,
                  callbacks: Optional[list] = None, resume_override: bool = False):
    """The TorchTrainer of one run; its outputs and Ray's checkpoints go to `run_dir`."""
    return TorchTrainer(
        train_loop_per_worker,
        torch_config=LoopbackTorchConfig(),  # the group's store on 127.0.0.1 when the run is on one machine
        train_loop_config=LoopConfig(cfg.to_dict(), plans_payload(plans), str(run_dir),
                                     str(Path(resume).resolve()) if resume else None, resume_override).to_dict(),
        scaling_config=ScalingConfig(num_workers=cfg.ray.num_workers, use_gpu=use_gpu,
                                     resources_per_worker=resources.worker(cfg, use_gpu),
                                     label_selector=dict(cfg.ray.worker_label_selector or {}) or None),
        run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir.parent), callbacks=callbacks,
                             checkpoint_config=CheckpointConfig(
                                 num_to_keep=cfg.train.num_to_keep,
                                 checkpoint_score_attribute=cfg.train.checkpoint_score,
                                 checkpoint_score_order=cfg.train.checkpoint_mode),
                             failure_config=FailureConfig(max_failures=cfg.train.max_failures)),
    )


def fit(trainer, run_dir: Optional[Path] = None):
    """trainer.fit(), with a failed run turned into one line (plus the logs dir while
    `console.quiet` is on); a run that stopped itself (a non-finite loss: its metrics' last record,
    `metrics_file.stopped_by`) too."""
    # Ctrl-C: KeyboardInterrupt here (the CLI exits 130 in one line; the driver's exit takes the
    # controller, its workers, the teachers and an embedded Ray with it) instead of Ray Train's own
    # handler, a "graceful" abort that waits ~15 s, prints a traceback and exits 1
    drop_train_sigint_handler(trainer)
    trim_train_callbacks(trainer)  # Ray's placement-group cleaner swapped; no DatasetManager actor (no Ray Dataset)
    with _interruptible(), _metrics_for(trainer.run_config.name):
        try:
            result = trainer.fit()
        except ray.train.TrainingFailedError as e:
            raise KavaError(with_logs(f"training failed: {root_cause(e)}")) from None
    stopped = stopped_by(run_dir / METRICS) if run_dir is not None else None
    if stopped:
        raise KavaError(stopped)
    return result


@contextlib.contextmanager
def _metrics_for(run_name: str):
    """Ray Train's own Prometheus metrics (its controller's and workers') are tagged with the run's
    name, which Ray encodes as ASCII: a run named with other letters (`modèle-v1`) failed in the
    controller's first metric. Such a run trains without them (RAY_TRAIN_METRICS_ENABLED=0, read as
    the trainer builds its callbacks); kava-ray's own metrics (metrics.jsonl, the trackers) are
    unaffected."""
    if run_name.isascii():
        yield
        return
    before = os.environ.get("RAY_TRAIN_METRICS_ENABLED")
    os.environ["RAY_TRAIN_METRICS_ENABLED"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_TRAIN_METRICS_ENABLED")
        else:
            os.environ["RAY_TRAIN_METRICS_ENABLED"] = before


@contextlib.contextmanager
def _interruptible():
    """A Ctrl-C during the block always ends in KeyboardInterrupt, even one that arrives as
    `ray.get` returns: Ray checks signals inside `ray.get` and a KeyboardInterrupt raised there just
    as the result lands is dropped (the run then finished and exited 0). The handler records the
    signal before raising; a recorded signal is raised again once the block has returned. Main
    thread only (a Tune trial's fit runs in another)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen = []

    def on_sigint(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if seen:
        raise KeyboardInterrupt


def run_training(cfg: JobConfig, resume: Optional[str] = None, name: Optional[str] = None,
                 address: Optional[str] = None, progress: bool = True, resume_override: bool = False,
                 restart_teachers: bool = False, verbose: bool = False) -> dict:
    """Run one distillation job end to end; returns run_dir, the last metrics (the last report;
    last_measured: every train metric's last value and its step) and the checkpoint path.

    resume: a checkpoint dir or a run dir (its latest checkpoint) to continue from, in that run's
    directory unless `name` names another (a finished one: `NothingToDo`, before Ray starts);
    resume_override: let optim.*/train.*/data.*/loss.*/onpolicy.* differ from the checkpoint's (the
    new values win); restart_teachers: replace a running pool that was started for another config
    instead of refusing it. The run dir is named before Ray starts: the console stays quiet (status
    lines + the progress bar; every other line in `RUN_DIR/logs/`, `kava_ray.runtime.console`)
    unless `verbose`.
    """
    given = resume  # (what the user named: the preflight's lines say it)
    if resume:
        resume = str(find_checkpoint(resume, for_resume=True))  # the checkpoint dir (the preflight checks it)
    run_dir = resumed_run_dir(resume) if resume and name is None else None  # --resume RUN continues in RUN
    if run_dir is None:
        name = name or f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
        run_dir = Path(cfg.ray.storage_path).expanduser().resolve() / name
    started = time.time()
    # before anything is written or Ray starts; for --resume this also checks the checkpoint is complete and compatible
    preflight(cfg, "train", resume=given, resume_override=resume_override, address=address, name=name)
    with run_lock(run_dir, "kava-ray train" + (" --resume" if resume else ""), say=status) as made:  # one writer
        if not resume and [p for p in run_dir.iterdir() if p.name != LOCK]:
            raise KavaError(f"{run_dir.name} exists: `--resume` it or pick another `--name`")
        # a refusal before Ray started removes the run dir this command made (`quiet`), lock and all
        with quiet(run_dir / "logs", verbose, made_above=run_dir if made else None):
            _data(cfg)  # refused before Ray starts: one line, and `quiet` removes the run dir it made
            try:
                return _run(cfg, run_dir, resume, address, progress, resume_override, restart_teachers, verbose)
            except KavaError as e:
                if "(logs: " in str(e):
                    raise
                raise KavaError(with_logs(str(e))) from None
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`common.signals`): the line says how the run goes on
                raise KeyboardInterrupt(resume_hint(run_dir, resume, address)) from None
            finally:
                # rank 0's `sampling...` flag: a worker ended mid-sample (a SIGTERM to the whole group) leaves it
                (run_dir / SAMPLING).unlink(missing_ok=True)
                add_session(run_dir, started, time.time())  # the run's wall time (`kava-ray report`), every session


def resume_hint(run_dir: Path, resume: Optional[str] = None, address: Optional[str] = None) -> str:
    """What an interrupted run's line ends with: the command that continues it, `kava-ray train
    --resume RUN_DIR` (its saved config; `--address` as given), and the step it continues from --
    where RUN_DIR holds a complete checkpoint (else the one this run resumed from) -- or that none
    was saved yet."""
    for where in (run_dir, resume):
        if where is None:
            continue
        try:
            step = read_state(find_checkpoint(where, for_resume=True), verify=False)["step"]
        except KavaError:
            continue
        at = f" --address {address}" if address else ""
        return f"`kava-ray train --resume {where}{at}` continues it (from step {step})"
    return "no checkpoint was saved yet: nothing to resume"


def resume_config(resume: str, overrides: Optional[list[str]] = None) -> JobConfig:
    """`train --resume RUN_DIR` without `--config`: the job its latest complete checkpoint saved
    (the config file and the KEY=VALUE overrides it started with), with `overrides` on top
    (run-changing keys still need `--resume-override`: `checkpoint.check_compatible`)."""
    return load_config(checkpoint_config(find_checkpoint(resume, for_resume=True))[2], overrides)


def resumed_run_dir(ckpt: str) -> Optional[Path]:
    """The run a checkpoint belongs to (the directory holding it and the run's metrics.jsonl), else None."""
    run = Path(ckpt).resolve().parent
    return run if (run / METRICS).is_file() else None


def _data(cfg: JobConfig) -> None:
    """The job's splits tokenized (and packed) once, cached, and checked (rows shared between
    splits, no loss tokens, fewer rows than one batch of every worker): a bad record deep in the
    data stops us here."""
    t0 = time.time()
    prepared = prepare_data(cfg)
    check_prompts(cfg, prepared["format"])  # a hub dataset's format is known only now (a local one's at preflight)
    need = cfg.train.batch_size * cfg.ray.num_workers
    if prepared["train"] < need:
        raise KavaError(f"train.batch_size={cfg.train.batch_size} x ray.num_workers={cfg.ray.num_workers}: the "
                        f"training split has {prepared['train']} rows ({cfg.data.source}), fewer than one batch of "
                        f"every worker")
    carved = " (validation and test carved from it)" if prepared["carved"] else ""
    status(f"data: {prepared['train']} training, {prepared['validation']} validation, {prepared['test']} test rows "
           f"({cfg.data.source}{carved}) in {time.time() - t0:.0f} s")
    if prepared["warning"]:
        status(prepared["warning"])


def teachers_status(job) -> None:
    """The `teachers:` line of a command that runs on them (`train`, `tune`): how many, from where, how long."""
    cfg, names = job.cfg, ", ".join(job.plans)
    if job.handles is None:
        status(f"teachers: {len(job.plans)} from the KV cache {cfg.data.kv_cache_dir} ({names})")
    else:
        status(f"teachers: {len(job.plans)} {'ready' if job.started else 'already running'} ({names}) "
               f"in {job.setup_s:.0f} s")
    for line in cross_vocab_lines(cfg.loss, cfg.student, job.plans):
        status(line)


def run_lines(cfg: JobConfig) -> list[str]:
    """What the run trains on, under its `training:` line: the loss's terms (those with a weight),
    and with `onpolicy.fraction` > 0 the sampling (`loss: ce 1 + kv 1 (mercator, fusion fixed) +
    logit 0.5 (forward_kl, top-64)`, `on-policy: ...`)."""
    c, o = cfg.loss, cfg.onpolicy
    terms = [f"ce {c.ce_weight:g}" + (" (off on the student's samples)" if o.fraction > 0 and o.source == "student"
                                      else "")] if c.ce_weight > 0 else []
    if c.kv_weight > 0:
        terms.append(f"kv {c.kv_weight:g} ({c.kind}, fusion {cfg.fusion.kind})")
    if c.logit_weight > 0:
        terms.append(f"logit {c.logit_weight:g} ({c.logit_divergence}, top-{c.logit_top_k})")
    terms += [f"{name} {w:g}" for name, w in (("relation", c.relation_weight), ("hidden", c.hidden_weight)) if w > 0]
    lines = [f"loss: {' + '.join(terms)}"]
    if o.fraction > 0:
        who = (("the student" + (" through vLLM" if o.engine == "vllm" else "")) if o.source == "student"
               else f"teacher '{onpolicy_writer(cfg.onpolicy, cfg.teachers)}'")
        lines.append(f"on-policy: fraction {o.fraction:g} of the batches completed by {who} (up to {o.max_new_tokens} "
                     f"new tokens, temperature {o.temperature:g}, top_p {o.top_p:g}), lag {o.lag}")
    return lines


def topk_warning(cfg: JobConfig, plans: dict) -> Optional[str]:
    """`divergences.topk_divergence_warning` for the job, where a teacher shares the student's
    tokenizer (the others' logit terms are the hybrid / ULD losses, not `topk_divergence`)."""
    if not any(not p.aligned for p in plans.values()):
        return None
    return topk_divergence_warning(cfg.loss, student_geometry(cfg.student).vocab_size, cfg.onpolicy.fraction)


def _run(cfg: JobConfig, run_dir: Path, resume, address, progress: bool, resume_override: bool,
         restart_teachers: bool, verbose: bool) -> dict:
    with job_teachers(cfg, address, restart=restart_teachers, command="train") as job:
        teachers_status(job)
        trainer = build_trainer(cfg, job.plans, run_dir, job.use_gpu, resume, resume_override=resume_override)
        workers = cfg.ray.num_workers
        status(f"training: {cfg.train.steps} steps, {workers} worker{'s' if workers != 1 else ''} -> {run_dir}")
        for line in run_lines(cfg):
            status(line)
        warning = topk_warning(cfg, job.plans)
        if warning:
            status(warning)
        t0 = time.time()
        with follow_metrics(run_dir / METRICS, cfg.train.steps, enabled=progress):
            result = fit(trainer, run_dir)
    test = _test_line(run_dir / METRICS)
    if test:
        status(test)
    if not verbose:
        status(f"logs: {run_dir / 'logs'}")
    return {"run_dir": str(run_dir), "wall_s": time.time() - t0, "metrics": dict(result.metrics or {}),
            "last_measured": last_values(run_dir / METRICS),  # {metric: (step, value)}: the last step may lack one
            "checkpoint": result.checkpoint.path if result.checkpoint else None}


def _test_line(metrics_path: Path) -> Optional[str]:
    """`test: CE 4.77, KV cos to the fused teachers 0.25 (centred), gap 0.21` from the run's test
    record (None when there is none): the cosine is the student's projected KV against the fused
    target every teacher makes, not a single teacher's (those are `test/cos/<teacher>`, the demo's
    table)."""
    test = last(metrics_path, "test")
    if not test or "test/ce" not in test:
        return None
    out = f"test: CE {test['test/ce']:.2f}"
    if "test/cos_sim" in test:
        out += f", KV cos to the fused teachers {test['test/cos_sim']:.2f} (centred)"
    if "test/contrast_gap" in test:
        out += f", gap {test['test/contrast_gap']:.2f}"
    return out
