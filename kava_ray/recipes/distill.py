"""The Ray Train worker, as a recipe: `setup`, `step`, `save` (torchtune's shape, Ray Train's idioms).

`DistillRecipe` holds one rank's state — the Distiller (student + projector bank + fusion, DDP when
there is more than one worker), the optimizer and schedule, the data stream — and does one
optimizer step over `optim.accumulation` micro-batches of (batch, teacher KV). It knows nothing of
where the KV comes from, so `kava-ray bench feed` times exactly this step.

`train_loop_per_worker` is the plain loop Ray Train runs: a KVFeed over the rank's shard, `step`,
metrics averaged over ranks on log steps, `ray.train.report` with a checkpoint every `save_steps`,
evaluation on the validation split (rank 0) every `eval_steps`, and the test split once at the end. Resume (after a worker failure, or `--resume`)
continues the same curve: the stream restarts at the saved position and the RNG is reseeded every
step from (seed, step, rank).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import record_function

from kava_ray.common.config import JobConfig, validate_config
from kava_ray.common.metrics_file import METRICS, MetricsLog
from kava_ray.core.precision import student_precision

SUMMED = ("tokens", "kv_tokens", "label_tokens", "skipped_batches")  # counts: summed over micro-batches and ranks; every other metric is a mean


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


class DistillRecipe:
    """One rank of a distillation run: `setup()`, then `step(step_no, micro_batches)`, `save(path)`."""

    def __init__(self, cfg: JobConfig, plans: dict, rank: int = 0, world: int = 1, device="cpu"):
        self.cfg, self.plans = cfg, plans
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        # student.precision on this device: the weight dtype the student loads in and the autocast of every
        # forward (auto: fp32 master weights + bf16 autocast on a CUDA GPU with bf16, plain fp32 on a CPU)
        self.precision = student_precision(cfg.student, self.device)
        self.autocast = self.precision.autocast

    def setup(self, checkpoint_dir: Optional[str] = None, wrap=None, run_changes: bool = False,
              data: bool = True, maps: Optional[dict] = None) -> Optional[dict]:
        """Build (or restore from `checkpoint_dir`) the Distiller, optimizer, schedule, tokenizer and stream.
        data=False: no tokenizer, splits or stream, and the vocabulary maps of teachers of another tokenizer are
        `maps` (`kava-ray bench gpu` and `bench step` feed their own batches; a GPU image
        may have no `datasets`).

        wrap: e.g. `ray.train.torch.prepare_model` for DDP when world > 1. run_changes (`--resume-override`):
        the config's optim.*/train.*/data.* may differ from the checkpoint's, and its learning rates, weight
        decay and schedule replace the checkpoint's. Returns the checkpoint's state.
        """
        from kava_ray.core.checkpoint import check_compatible, load_into
        from kava_ray.core.distiller import Distiller, build_optimizer, build_scheduler
        from kava_ray.core.models import kv_geometry, load_student, load_tokenizer
        from kava_ray.core.plans import data_seed, load_splits, teacher_tokenizers, vocab_maps
        from kava_ray.data import BatchStream

        cfg = self.cfg
        state = check_compatible(checkpoint_dir, cfg, allow_run_changes=run_changes) if checkpoint_dir else None
        source_model = str(Path(checkpoint_dir) / "student") if state else cfg.student.model
        student = load_student(source_model, dtype=self.precision.weight_dtype,
                               keep=None if state else cfg.student.keep_layers,
                               gradient_checkpointing=cfg.student.gradient_checkpointing)
        if data:
            self.tokenizer = load_tokenizer(cfg.student.model)
            self.teacher_toks = teacher_tokenizers(self.plans)  # teachers of another tokenizer (aligned by characters)
            maps = vocab_maps(cfg, self.plans, self.tokenizer, self.teacher_toks)  # for their logits (hybrid)
        torch.manual_seed(cfg.train.seed)  # projector init: the same on every rank and every run
        self.distiller = Distiller(student, self.plans, kv_geometry(student), cfg, maps).to(self.device)
        self.opt = build_optimizer(self.distiller, cfg.optim)
        self.sched = build_scheduler(self.opt, cfg.optim, cfg.train.steps)
        if state:
            load_into(checkpoint_dir, self.distiller, self.opt, self.sched)
            if run_changes:
                self._adopt_optim_settings()
        self.start_step = state["step"] if state else 0
        self.model = wrap(self.distiller) if wrap is not None and self.world > 1 else self.distiller
        self.params = [p for p in self.distiller.parameters() if p.requires_grad]
        if not data:
            return state
        self.train_split, self.val = load_splits(cfg, self.tokenizer, self.teacher_toks)  # test: only in `test()`
        self.stream = BatchStream(self.train_split, cfg.train.batch_size, data_seed(cfg), rank=self.rank,
                                  world_size=self.world, state=state["stream"] if state else None)
        self.skipped_before = skip_resumed(self.stream, state["stream"] if state else None)  # train.on_bad_kv
        return state

    def feed(self, source, until: Optional[int] = None, depth: Optional[int] = None):
        """The KVFeed over this rank's stream: exactly the batches of the steps up to `until` (train.steps),
        no read-ahead past the last step (wasted teacher forwards; a skipped batch, train.on_bad_kv=skip,
        extends the read by one)."""
        from actors.feed import KVFeed, feed_items
        from kava_ray.core.plans import teacher_logits_top_k

        cfg = self.cfg
        remaining = max(0, (until or cfg.train.steps) - self.start_step) * cfg.optim.accumulation
        return KVFeed(source, feed_items(self.stream), {n: p.layers for n, p in self.plans.items()},
                      depth=cfg.align.prefetch_depth if depth is None else depth, wire_dtype=cfg.align.wire_dtype,
                      device=self.device, logits_top_k=teacher_logits_top_k(self.cfg, self.plans),
                      on_bad_kv=cfg.train.on_bad_kv, limit=remaining)

    def _adopt_optim_settings(self) -> None:
        """The config's learning rates, weight decay and schedule replace a restored checkpoint's (Adam's
        moment estimates stay): loading an optimizer state would otherwise bring back the old values."""
        o = self.cfg.optim
        lrs = {"student": o.lr_student, "projector": o.lr_projector}
        for g in self.opt.param_groups:
            g["initial_lr"] = lrs.get(g.get("name"), g["initial_lr"])
            g["weight_decay"] = o.weight_decay
        self.sched.base_lrs = [g["initial_lr"] for g in self.opt.param_groups]
        for g, base, fn in zip(self.opt.param_groups, self.sched.base_lrs, self.sched.lr_lambdas):
            g["lr"] = base * fn(self.sched.last_epoch)  # the lambdas already follow the new train.steps / warmup

    def step(self, step_no: int, micro_batches) -> dict[str, torch.Tensor]:
        """One optimizer step over `micro_batches` (an iterable of (batch, {teacher: KVBatch})).

        Returns the step's metrics as float64 tensors on the device: means over micro-batches, counts
        summed, plus grad_norm. Nothing is converted to Python here (no GPU sync).
        """
        torch.manual_seed(self.cfg.train.seed * 1_000_003 + step_no * 7919 + self.rank)  # dropout identical on resume
        accum = self.cfg.optim.accumulation
        sums: dict[str, torch.Tensor] = {}
        for micro, (batch, kv) in enumerate(micro_batches):
            no_sync = self.world > 1 and micro < accum - 1
            with (self.model.no_sync() if no_sync else contextlib.nullcontext()), self.autocast():
                loss, m = self.model(_to_device(batch, self.device), kv)
            with record_function("kava/backward"):  # profiler scopes (`kava-ray bench step`): free without one
                (loss / accum).backward()
            for k, v in m.items():
                sums[k] = sums.get(k, 0) + v.detach().double()
        with record_function("kava/optimizer"):
            # clipped per group: the projectors' gradients (a KV loss's, large at first) never shrink the student's
            limit = self.cfg.optim.grad_clip or float("inf")
            norms = {g.get("name", str(i)): torch.nn.utils.clip_grad_norm_(g["params"], limit)
                     for i, g in enumerate(self.opt.param_groups)}
            self.last_lrs = [g["lr"] for g in self.opt.param_groups]  # this step's rates (before the schedule moves)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
        out = {k: v if k in SUMMED else v / accum for k, v in sums.items()}
        out["grad_norm"] = norms["student"].detach().double()  # the student's gradient norm (before clipping)
        if "projector" in norms:
            out["grad_norm_projector"] = norms["projector"].detach().double()
        return out

    def save(self, path, step: int, stream_state: dict, with_optimizer: bool = True,
             extra: Optional[dict] = None) -> Path:
        from kava_ray.core.checkpoint import save_checkpoint

        return save_checkpoint(path, self.distiller, self.tokenizer, self.opt if with_optimizer else None,
                               self.sched if with_optimizer else None, step, stream_state, self.cfg, extra=extra)

    def evaluate(self, source) -> dict[str, float]:
        """`eval/*` on the validation split: what checkpoint selection and Tune read."""
        from kava_ray.recipes.evaluate import evaluate_heldout

        return evaluate_heldout(self.distiller, source, self.plans, self.val, self.cfg, self.device, torch.float32,
                                autocast=self.autocast)

    def test(self, source) -> dict[str, float]:
        """`test/*` on the test split, once, after the last step (never used to select anything), in fp32
        without autocast: the numbers `kava-ray eval` computes for the same checkpoint."""
        from kava_ray.core.plans import load_test_split
        from kava_ray.recipes.evaluate import evaluate_heldout

        split = load_test_split(self.cfg, self.tokenizer, self.teacher_toks)
        return evaluate_heldout(self.distiller, source, self.plans, split, self.cfg, self.device, torch.float32,
                                prefix="test")


def reduce_metrics(values: dict[str, torch.Tensor], world: int) -> dict[str, float]:
    """Python numbers for logging: means over ranks (counts summed), one all-reduce for all of them."""
    keys = sorted(values)
    flat = torch.stack([values[k].reshape(()) for k in keys])
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(flat)
        scale = torch.tensor([1.0 if k in SUMMED else 1.0 / world for k in keys], dtype=flat.dtype,
                             device=flat.device)
        flat = flat * scale
    return dict(zip(keys, flat.tolist()))


def stream_state_after(stream, feed, skipped: Optional[list[int]] = None) -> dict:
    """The stream position just after the last batch the student trained on, with every rank's skips.

    The feed reads ahead by `depth` batches, so the stream itself is ahead: step back by the
    batches still in flight. Batches skipped for non-finite teacher KV (train.on_bad_kv=skip) differ
    between ranks (each rank reads its own shard), so the saved position counts only the batches trained
    on — the same on every rank — and `skipped` lists each rank's cumulative skips (`skipped_by_rank`);
    on resume each rank steps forward by its own count (`skip_resumed`).
    """
    s = stream.state()
    own = int(skipped[stream.rank]) if skipped else 0
    behind = feed.in_flight + own
    pos, epoch, step = s["position"] - behind, s["epoch"], s["step"] - behind
    while pos < 0:
        epoch -= 1
        pos += stream.steps_per_epoch
    out = dict(s, position=pos, epoch=epoch, step=step)
    if skipped and any(skipped):
        out["skipped"] = [int(n) for n in skipped]
    return out


def skip_resumed(stream, state: Optional[dict]) -> int:
    """Step a restored stream past the batches this rank had skipped (a `stream_state_after` state's
    `skipped`); returns that count, where this rank's cumulative `skipped_batches` continues from."""
    skipped = (state or {}).get("skipped") or []
    n = int(skipped[stream.rank]) if stream.rank < len(skipped) else 0
    stream.position += n
    stream.step += n
    while stream.position > stream.steps_per_epoch:  # position == steps_per_epoch: next() starts the next epoch
        stream.epoch += 1
        stream.position -= stream.steps_per_epoch
    return n


def skipped_by_rank(own: int, rank: int, world: int, device) -> list[int]:
    """Every rank's cumulative skipped-batch count (one all-reduce; every rank calls it at save steps)."""
    if world == 1:
        return [int(own)]
    import torch.distributed as dist

    counts = torch.zeros(world, dtype=torch.float64, device=device)
    counts[rank] = own
    dist.all_reduce(counts)
    return [int(round(c)) for c in counts.tolist()]


def micro_batches(feed, accum: int, step: int, wait: list):
    """The step's `accum` (batch, {teacher: KVBatch}) from the feed; a batch of non-finite teacher KV with
    train.on_bad_kv=stop becomes one line naming the teacher, batch key and step."""
    from actors.feed import BadKV
    from kava_ray.common.errors import KavaError

    for _ in range(accum):
        try:
            (_, _, _, batch), kv = next(feed)
        except BadKV as e:
            raise KavaError(f"{e} at step {step} (train.on_bad_kv=stop)") from None
        wait.append(feed.last_wait_s)
        yield batch, kv


def _quiet_train_logs() -> None:
    """Ray Train V2 logs every report at INFO from a logger named after its source file (so its own
    `LoggingConfig`, which filters `ray.train*` names, does not reach it); metrics.jsonl and the
    progress bar already carry those numbers. Found by name, without importing Ray internals."""
    import ray.train

    name = os.path.join(os.path.dirname(ray.train.__file__), "v2", "_internal", "execution", "context.py")
    logging.getLogger(name).setLevel(logging.WARNING)


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker. `config`: job (JobConfig dict), plans (payload), run_dir, resume (optional path)."""
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    from kava_ray.common.trackers import open_trackers
    from kava_ray.core.plans import plans_from_payload
    from kava_ray.recipes.report import phase
    from kava_ray.runtime.job import kv_source

    cfg = validate_config(config["job"])
    _quiet_train_logs()
    plans = plans_from_payload(config["plans"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    recipe = DistillRecipe(cfg, plans, rank, world, ray.train.torch.get_device())
    run_dir = Path(config["run_dir"])

    ckpt = ray.train.get_checkpoint()
    with (ckpt.as_directory() if ckpt is not None else contextlib.nullcontext(config.get("resume"))) as ckdir:
        state = recipe.setup(ckdir, wrap=ray.train.torch.prepare_model, run_changes=config.get("resume_override", False))
    t_cfg, accum = cfg.train, cfg.optim.accumulation
    stream = recipe.stream
    source = kv_source(cfg, plans, stream.split.fingerprint)
    feed = recipe.feed(source)
    log = MetricsLog(run_dir / METRICS, recipe.start_step,
                     open_trackers(t_cfg.loggers, run_dir, cfg.to_dict(), recipe.start_step)) if rank == 0 else None

    last_eval: dict = {}  # carried in every report, so a Tune scheduler always sees its held-out metric
    if recipe.start_step == 0 and rank == 0:  # held-out numbers before any training
        last_eval = recipe.evaluate(source)
        log.write({"step": 0, "kind": "eval", **last_eval})

    if state and recipe.start_step >= t_cfg.steps:  # restored after the last step: re-announce the final result
        ray.train.report(state.get("metrics", {"step": recipe.start_step}))

    skips = [recipe.skipped_before] * world  # every rank's cumulative skips at the last save (final/ reuses them)
    for step in range(recipe.start_step + 1, t_cfg.steps + 1):
        t0 = time.perf_counter()
        waits: list = []
        values = recipe.step(step, micro_batches(feed, accum, step, waits))
        values["teacher_wait_s"] = torch.tensor(sum(waits), dtype=torch.float64, device=values["grad_norm"].device)
        values["skipped_batches"] = torch.tensor(float(recipe.skipped_before + feed.skipped), dtype=torch.float64,
                                                 device=values["grad_norm"].device)  # cumulative, summed over ranks
        dt = time.perf_counter() - t0
        lr_student, lr_projector = recipe.last_lrs[0], recipe.last_lrs[-1]
        is_save = step % t_cfg.save_steps == 0 or step == t_cfg.steps
        scored_by_eval = (t_cfg.checkpoint_score or "").startswith("eval/")  # a kept checkpoint needs its score
        is_eval = step % t_cfg.eval_steps == 0 or step == t_cfg.steps or (is_save and scored_by_eval)
        is_log = is_save or is_eval or step % t_cfg.log_steps == 0
        if not is_log:
            continue
        metrics = reduce_metrics(values, world)  # every rank joins the all-reduce
        metrics.pop("label_tokens")
        metrics.pop("kv_tokens")
        metrics["skipped_batches"] = int(metrics["skipped_batches"])
        metrics.update(step=step, kind="train", time_s=dt, tokens_per_s=metrics.pop("tokens") / dt,
                       phase=phase(metrics["cos_sim"]), lr_student=lr_student, lr_projector=lr_projector)
        if rank == 0:
            log.write(metrics)
            if is_eval:
                last_eval = recipe.evaluate(source)
                log.write({"step": step, "kind": "eval", **last_eval})
            metrics.update(last_eval)
        report = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if is_save:
            skips = skipped_by_rank(recipe.skipped_before + feed.skipped, rank, world, values["grad_norm"].device)
            with tempfile.TemporaryDirectory() as tmp:
                ck = None
                if rank == 0:
                    recipe.save(Path(tmp) / "ckpt", step, stream_state_after(stream, feed, skips),
                                extra={"metrics": report})
                    ck = Checkpoint.from_directory(str(Path(tmp) / "ckpt"))
                ray.train.report(report, checkpoint=ck)
        else:
            ray.train.report(report)

    if rank == 0 and recipe.start_step < t_cfg.steps:  # the final outputs, outside Ray's checkpoint dirs
        test = recipe.test(source)  # the test split, read once, after every selection decision
        log.write({"step": t_cfg.steps, "kind": "test", **test})
        recipe.save(run_dir / "final", t_cfg.steps, stream_state_after(stream, feed, skips), with_optimizer=False,
                    extra={"test": test})
        log.trackers.log_artifact(run_dir / "final")  # the final student (MLflow, W&B; TensorBoard has none)
    if rank == 0:
        log.trackers.close()
