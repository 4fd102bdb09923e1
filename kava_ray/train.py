"""`kava-ray train`: teachers as Ray actors, the student on Ray Train.

Driver: connect to Ray (or start an embedded one), start/find the teacher pool, read the teachers'
geometry, plan layers, then `TorchTrainer(train_loop_per_worker, ScalingConfig, RunConfig)`.fit()
while a progress bar follows `metrics.jsonl`.

Worker (`train_loop_per_worker`): its data shard, a KVFeed to every teacher, the Distiller (student +
projectors + fusion, DDP when num_workers > 1), AdamW in two groups, warmup + cosine, accumulation,
clipping; `ray.train.report` every log step, a checkpoint every save_steps, evaluation on the
held-out split every eval_steps. Resume from `ray.train.get_checkpoint()` (after a failure) or from
`--resume PATH` continues the same curve: the data stream restarts at the saved position and the RNG
is reseeded every step from (seed, step, rank).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import ray
import torch

from kava_ray.config import JobConfig, validate_config
from kava_ray.errors import KavaError
from kava_ray.job import TeacherPlan
from kava_ray.models import KVGeometry

METRICS = "metrics.jsonl"


# ============================================================================== worker side


def _plans_from(config: dict) -> dict:
    return {n: TeacherPlan(n, KVGeometry.from_dict(p["geometry"]), [(s, [tuple(x) for x in pairs])
                                                                      for s, pairs in p["layer_map"]], p["layers"])
            for n, p in config["plans"].items()}


def _kv_source(cfg: JobConfig, plans: dict, plan_fingerprint: str):
    from actors.feed import ActorSource
    from actors.kv_cache import CacheSource, KVCache, cache_meta
    from actors.pool import find_pool

    if cfg.data.kv_source == "cache":
        return CacheSource(KVCache(cfg.data.kv_cache_dir, cache_meta(cfg, plans, plan_fingerprint)))
    return ActorSource(find_pool(cfg, list(plans)))


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


class MetricsLog:
    """Rank 0's metrics.jsonl; on resume, records past the resumed step are dropped first."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            path.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


@torch.no_grad()
def evaluate_heldout(distiller, source, plans: dict, split, cfg: JobConfig, device, dtype) -> dict:
    """Held-out CE, KV cos (overall and per teacher) and contrast gap, token-weighted over the split."""
    from actors.feed import KVFeed
    from kava_ray.data import BatchStream
    from kava_ray.job import feed_items

    was_training = distiller.training
    distiller.eval()
    stream = BatchStream(split, cfg.train.batch_size, cfg.train.seed, bucket=False)
    feed = KVFeed(source, feed_items(stream, stream.steps_per_epoch), {n: p.layers for n, p in plans.items()},
                  depth=cfg.align.prefetch_depth, wire_dtype=cfg.align.wire_dtype, device=device, dtype=dtype)
    sums: dict = {}
    weights = {"tokens": 0, "label_tokens": 0}
    for (_, _, _, batch), kv in feed:
        _, m = distiller(_to_device(batch, device), kv)
        for w in weights:
            weights[w] += m[w]
        sums["ce"] = sums.get("ce", 0.0) + m["ce"] * m["label_tokens"]  # CE: per answer token
        for k in ["cos_sim", "contrast_gap"] + [f"cos/{t}" for t in plans]:  # KV: per real token
            sums[k] = sums.get(k, 0.0) + m[k] * m["tokens"]
    distiller.train(was_training)
    return {f"eval/{k}": v / max(weights["label_tokens" if k == "ce" else "tokens"], 1) for k, v in sums.items()}


def _quiet_train_logs() -> None:
    """Ray Train V2 logs every report at INFO from a logger named after its file; the progress bar
    and metrics.jsonl already carry those numbers."""
    import logging

    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker. `config`: job (JobConfig dict), plans, run_dir, resume (optional path)."""
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    from actors.feed import KVFeed
    from kava_ray.checkpoint import check_compatible, load_into, save_checkpoint
    from kava_ray.data import BatchStream
    from kava_ray.distill import Distiller, build_optimizer, build_scheduler
    from kava_ray.job import feed_items, load_splits
    from kava_ray.models import kv_geometry, load_student, load_tokenizer
    from kava_ray.report import phase

    cfg = validate_config(config["job"])
    _quiet_train_logs()
    plans = _plans_from(config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    run_dir = Path(config["run_dir"])
    (run_dir / "workers").mkdir(parents=True, exist_ok=True)
    (run_dir / "workers" / f"rank{rank}.pid").write_text(str(os.getpid()))

    ckpt = ray.train.get_checkpoint()
    with (ckpt.as_directory() if ckpt is not None else contextlib.nullcontext(config.get("resume"))) as ckdir:
        state = check_compatible(ckdir, cfg) if ckdir else None
        source_model = str(Path(ckdir) / "student") if state else cfg.student.model
        student = load_student(source_model, dtype=cfg.student.dtype, keep=None if state else cfg.student.keep_layers,
                               gradient_checkpointing=cfg.student.gradient_checkpointing)
        s_geom = kv_geometry(student)
        torch.manual_seed(cfg.train.seed)  # projector init: the same on every rank and every run
        distiller = Distiller(student, plans, s_geom, cfg).to(device)
        opt = build_optimizer(distiller, cfg.optim)
        sched = build_scheduler(opt, cfg.optim, cfg.train.steps)
        if state:
            load_into(ckdir, distiller, opt, sched)
    start_step = state["step"] if state else 0
    model = ray.train.torch.prepare_model(distiller) if world > 1 else distiller
    tokenizer = load_tokenizer(cfg.student.model)
    train_split, held = load_splits(cfg, tokenizer)
    stream = BatchStream(train_split, cfg.train.batch_size, cfg.train.seed, rank=rank, world_size=world,
                         state=state["stream"] if state else None)
    source = _kv_source(cfg, plans, stream.plan_fingerprint)
    use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    # exactly the batches this run still trains on: no read-ahead past the last step (wasted teacher forwards)
    remaining = max(0, cfg.train.steps - start_step) * cfg.optim.accumulation
    feed = KVFeed(source, feed_items(stream, remaining), {n: p.layers for n, p in plans.items()},
                  depth=cfg.align.prefetch_depth, wire_dtype=cfg.align.wire_dtype, device=device)
    log = MetricsLog(run_dir / METRICS, start_step) if rank == 0 else None
    t_cfg, accum = cfg.train, cfg.optim.accumulation
    params = [p for p in distiller.parameters() if p.requires_grad]

    last_eval: dict = {}  # carried in every report, so a Tune scheduler always sees its held-out metric
    if start_step == 0 and rank == 0:  # held-out numbers before any training
        last_eval = evaluate_heldout(distiller, source, plans, held, cfg, device, torch.float32)
        log.write({"step": 0, "kind": "eval", **last_eval})

    if state and start_step >= t_cfg.steps:  # restored after the last step: re-announce the final result
        ray.train.report(state.get("metrics", {"step": start_step}))

    for step in range(start_step + 1, t_cfg.steps + 1):
        torch.manual_seed(t_cfg.seed * 1_000_003 + step * 7919 + rank)  # dropout identical on resume
        t0 = time.perf_counter()
        wait, sums = 0.0, {}
        for micro in range(accum):
            (_, _, _, batch), kv = next(feed)
            wait += feed.last_wait_s
            sync = model.no_sync() if world > 1 and micro < accum - 1 else contextlib.nullcontext()
            with sync, autocast():
                loss, m = model(_to_device(batch, device), kv)
            (loss / accum).backward()
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        metrics = {k: (v if k.endswith("tokens") else v / accum) for k, v in sums.items()}
        metrics.pop("label_tokens")
        metrics.update(step=step, kind="train", grad_norm=float(grad_norm), teacher_wait_s=wait, time_s=dt,
                       tokens_per_s=metrics.pop("tokens") * world / dt, phase=phase(metrics["cos_sim"]),
                       lr_student=sched.get_last_lr()[0], lr_projector=sched.get_last_lr()[-1])
        is_save = step % t_cfg.save_steps == 0 or step == t_cfg.steps
        scored_by_eval = (t_cfg.checkpoint_score or "").startswith("eval/")  # a kept checkpoint needs its score
        is_eval = step % t_cfg.eval_steps == 0 or step == t_cfg.steps or (is_save and scored_by_eval)
        if rank == 0:
            log.write(metrics)
            if is_eval:
                last_eval = evaluate_heldout(distiller, source, plans, held, cfg, device, torch.float32)
                log.write({"step": step, "kind": "eval", **last_eval})
            metrics.update(last_eval)
        if not (is_save or step % t_cfg.log_steps == 0 or is_eval):
            continue
        report = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if is_save:
            stream_state = _stream_state_after(stream, feed)
            with tempfile.TemporaryDirectory() as tmp:
                ck = None
                if rank == 0:
                    save_checkpoint(Path(tmp) / "ckpt", distiller, tokenizer, opt, sched, step, stream_state, cfg,
                                    extra={"metrics": report})
                    ck = Checkpoint.from_directory(str(Path(tmp) / "ckpt"))
                ray.train.report(report, checkpoint=ck)
        else:
            ray.train.report(report)

    if rank == 0:  # the final outputs, outside Ray's checkpoint dirs
        save_checkpoint(run_dir / "final", distiller, tokenizer, None, None, t_cfg.steps,
                        _stream_state_after(stream, feed), cfg)


def _stream_state_after(stream, feed) -> dict:
    """The stream position just after the last batch the student trained on.

    The feed reads ahead by `depth` batches, so the stream itself is ahead: step back by the
    batches still in flight.
    """
    s = stream.state()
    behind = feed.in_flight
    pos, epoch, step = s["position"] - behind, s["epoch"], s["step"] - behind
    while pos < 0:
        epoch -= 1
        pos += stream.steps_per_epoch
    return dict(s, position=pos, epoch=epoch, step=step)


# ============================================================================== driver side


def plans_payload(plans: dict) -> dict:
    """TeacherPlans as plain data for train_loop_config."""
    return {n: {"geometry": p.geometry.to_dict(), "layer_map": p.layer_map, "layers": p.layers}
            for n, p in plans.items()}


def embedded_cpus(cfg: JobConfig) -> int:
    """Logical CPUs an embedded Ray needs: teachers + workers + the Train controller, plus one spare.

    Ray only counts logical CPUs, so this may exceed the machine's cores.
    """
    teachers = sum(t.num_cpus for t in cfg.teachers) if cfg.data.kv_source == "live" else 0
    return int(teachers + cfg.ray.num_workers * cfg.ray.cpus_per_worker + 2 + 0.999)


def setup_teachers(cfg: JobConfig):
    """(pool handles or None, teacher plans, started_here) — from live actors or the KV cache manifest."""
    from actors.kv_cache import KVCache
    from actors.pool import check_resources, find_pool, start_pool
    from kava_ray.job import check_tokenizers, student_geometry, student_tokenizer, teacher_plans

    s_geom = student_geometry(cfg)
    _, fp = student_tokenizer(cfg)
    if cfg.data.kv_source == "cache":
        meta = KVCache(cfg.data.kv_cache_dir).meta
        geoms = {n: dict(t["geometry"]) for n, t in meta["teachers"].items()}
        handles, started = None, False
    else:
        try:
            handles, started = find_pool(cfg), False
        except KavaError:
            check_resources(cfg)
            handles, started = start_pool(cfg), True
        geoms = dict(zip(handles, ray.get([h.geometry.remote() for h in handles.values()])))
        check_tokenizers(cfg, geoms, fp)
    missing = [t.name for t in cfg.teachers if t.name not in geoms]
    if missing:
        raise KavaError(f"KV cache {cfg.data.kv_cache_dir} has no teacher {missing[0]!r}")
    return handles, teacher_plans(cfg, geoms, s_geom), started


def _follow(path: Path, total: int, stop: threading.Event) -> None:
    """Progress bar over metrics.jsonl while fit() runs (works for any number of workers)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="train", unit="step", disable=None, dynamic_ncols=True)
    seen = 0
    while not stop.is_set():
        if path.exists():
            for line in path.read_text().splitlines()[seen:]:
                seen += 1
                r = json.loads(line)
                if r.get("kind") == "train":
                    bar.n = r["step"]
                    bar.set_postfix(loss=f"{r['loss']:.3f}", cos=f"{r['cos_sim']:.3f}",
                                    gap=f"{r['contrast_gap']:.3f}", wait=f"{r['teacher_wait_s']:.2f}s",
                                    phase=r["phase"], refresh=False)
                    bar.refresh()
        stop.wait(0.5)
    bar.close()


def worker_resources(cfg: JobConfig, use_gpu: bool) -> dict:
    return {"CPU": cfg.ray.cpus_per_worker, **({"GPU": cfg.ray.gpus_per_worker} if use_gpu else {})}


def build_trainer(cfg: JobConfig, plans: dict, run_dir: Path, use_gpu: bool, resume: Optional[str] = None,
                  callbacks: Optional[list] = None):
    """The TorchTrainer of one run; its outputs and Ray's checkpoints go to `run_dir`."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"job": cfg.to_dict(), "plans": plans_payload(plans), "run_dir": str(run_dir),
                           "resume": str(Path(resume).resolve()) if resume else None},
        scaling_config=ScalingConfig(num_workers=cfg.ray.num_workers, use_gpu=use_gpu,
                                     resources_per_worker=worker_resources(cfg, use_gpu)),
        run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir.parent), callbacks=callbacks,
                             checkpoint_config=CheckpointConfig(
                                 num_to_keep=cfg.train.num_to_keep,
                                 checkpoint_score_attribute=cfg.train.checkpoint_score,
                                 checkpoint_score_order=cfg.train.checkpoint_mode),
                             failure_config=FailureConfig(max_failures=cfg.train.max_failures)),
    )


def fit(trainer):
    """trainer.fit(), with a failed run turned into one line."""
    try:
        return trainer.fit()
    except ray.train.TrainingFailedError as e:
        raise KavaError(f"training failed: {_root_cause(e)}") from None


def check_memory(cfg: JobConfig) -> None:
    """Refuse a config the planner says cannot fit the cluster's smallest GPU (one line + the fix)."""
    from kava_ray.plan import check_fits

    @ray.remote(num_gpus=0.001, num_cpus=0)
    def gpu_memory() -> int:  # runs on a GPU node: the driver may be a CPU-only head
        import torch

        return torch.cuda.get_device_properties(0).total_memory

    check_fits(cfg, int(ray.get(gpu_memory.remote(), timeout=120)))


def run_training(cfg: JobConfig, resume: Optional[str] = None, run_name: Optional[str] = None,
                 address: Optional[str] = None, progress: bool = True) -> dict:
    """Run one distillation job end to end; returns run_dir, the last metrics and the checkpoint path."""
    from actors.pool import check_resources, stop_pool
    from kava_ray.checkpoint import check_compatible
    from kava_ray.connect import connect, resolve_use_gpu

    if resume:
        check_compatible(resume, cfg)  # fail before anything starts
    connect(address or cfg.ray.address, cfg.ray.namespace, num_cpus=cfg.ray.num_cpus or embedded_cpus(cfg))
    use_gpu = resolve_use_gpu(cfg.ray.use_gpu)
    check_resources(cfg, extra={k: v * cfg.ray.num_workers for k, v in worker_resources(cfg, use_gpu).items()})
    if use_gpu:
        check_memory(cfg)
    handles, plans, started = setup_teachers(cfg)
    run_name = run_name or f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = Path(cfg.ray.storage_path).expanduser().resolve() / run_name
    trainer = build_trainer(cfg, plans, run_dir, use_gpu, resume)
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(run_dir / METRICS, cfg.train.steps, stop), daemon=True)
    if progress:
        follower.start()
    t0 = time.time()
    try:
        result = fit(trainer)
    finally:
        stop.set()
        if progress:
            follower.join()
        if started:
            stop_pool(cfg)
    return {"run_dir": str(run_dir), "wall_s": time.time() - t0, "metrics": dict(result.metrics or {}),
            "checkpoint": result.checkpoint.path if result.checkpoint else None}


def _root_cause(e: BaseException) -> str:
    """The innermost error message, one line (a KavaError raised in a worker keeps its text)."""
    text = str(e)
    for line in reversed(text.splitlines()):
        if "KavaError:" in line:
            return line.split("KavaError:", 1)[1].strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(e).__name__
