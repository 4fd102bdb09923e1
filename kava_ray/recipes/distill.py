"""The student's recipe: `DistillRecipe.setup`, `step`, `save`, and the Ray Train loop that runs it.

`DistillRecipe` holds one rank's model state (the Distiller, the optimizer and schedule, the splits)
and does one optimizer step over `optim.accumulation` micro-batches of (Batch, {teacher: KVBatch});
it knows nothing of where they come from: `data()` gives the rank's `rollout.step_source.StepSource`
(the stream, the teachers' feed, the skips; on-policy:
`kava_ray.rollout.onpolicy_source.OnPolicyStepSource`), whose `state_dict()` the checkpoint keeps.
`kava-ray bench feed` times exactly this step. `train_loop_per_worker` is the plain loop Ray Train
runs; what it does and how a resume continues the same curve: docs/internals/step.md#recipe.

Ray (and `actors`, which needs it) is imported inside the functions that use it: `kava-ray bench
gpu` builds this recipe on images without Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.utils import get_total_norm
from torch.profiler import record_function

from kava_ray.common.config import JobConfig, validate_config
from kava_ray.common.errors import KavaError
from kava_ray.common.metrics_file import ERROR, METRICS, SAMPLING, MetricsLog
from kava_ray.common.trackers import open_trackers
from kava_ray.core import fsdp
from kava_ray.core.checkpoint import (
    check_compatible,
    is_sharded_checkpoint,
    load_data_state,
    load_into,
    save_checkpoint,
)
from kava_ray.core.distiller import Distiller, build_optimizer, build_scheduler
from kava_ray.core.metric_names import EVAL_TASKS_S, EVALS, GRAD_KV_RATIO, GRAD_KV_SHARE, summed
from kava_ray.core.models import kv_geometry, load_tokenizer
from kava_ray.core.plans import plans_from_payload, teacher_tokenizers, vocab_maps
from kava_ray.core.precision import student_precision
from kava_ray.core.student import job_student
from kava_ray.data.splits import load_splits, load_test_split
from kava_ray.data.tasks import resolve_tasks
from kava_ray.recipes.build import build_distiller
from kava_ray.recipes.evaluate import evaluate_heldout
from kava_ray.recipes.fit_maps import fit_maps
from kava_ray.recipes.harness import run_tasks, task_metrics
from kava_ray.recipes.rank_wait import rank_zero_wait
from kava_ray.recipes.step_records import evals_through, step_kind
from kava_ray.recipes.steps import NonFinite, run_steps


@dataclass
class LoopConfig:
    """What the driver hands each Ray Train worker (as a dict: `to_dict` / `from_dict`, Ray Train's
    train_loop_config). job: `JobConfig.to_dict()`; plans: `plans.plans_payload`; resume: a
    checkpoint dir; resume_override: `--resume-override` (the config's
    optim.*/train.*/data.*/loss.*/onpolicy.* replace the checkpoint's)."""

    job: dict
    plans: dict
    run_dir: str
    resume: Optional[str] = None
    resume_override: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoopConfig":
        return cls(**d)


class DistillRecipe:
    """One rank of a distillation run: `setup()`, then `step(step_no, micro_batches)` over
    `data(source)`'s steps, `save(path, step, data_state)`."""

    def __init__(self, cfg: JobConfig, plans: dict, rank: int = 0, world: int = 1, device="cpu"):
        self.cfg, self.plans = cfg, plans
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        # student.precision here: the student's weight dtype and every forward's autocast
        self.precision = student_precision(cfg.student, self.device)
        self.autocast = self.precision.autocast
        # ray.strategy fsdp, several workers: FSDP2 shards the Distiller; every rank evaluates and saves
        self.sharded = cfg.ray.strategy == "fsdp" and world > 1
        # set by `build_model` (`model`: the Distiller or its DDP wrapper) and `setup` (tokenizers, splits)
        self.distiller: Optional[Distiller] = None
        self.model = None
        self.opt: Optional[torch.optim.Optimizer] = None
        self.sched = None
        self.start_step = 0
        self.tokenizer, self.teacher_toks = None, {}
        self.train_split, self.val = None, None
        # the last step's learning rates (before the schedule moves) and micro-batches per metric
        self.last_lrs: list = []
        self.measured: dict[str, int] = {}
        self._tasks = None  # train.eval_tasks, resolved at the first evaluation (kava_ray.data.tasks)

    def setup(self, checkpoint_dir: Optional[str] = None, wrap=None, run_changes: bool = False) -> Optional[dict]:
        """Build (or restore from `checkpoint_dir`) the model and optimizer (`build_model`), the
        tokenizers and the splits. Returns the checkpoint's state, its data side's under "data"
        (None from scratch)."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.student.model)
        self.teacher_toks = teacher_tokenizers(self.plans)  # teachers of another tokenizer (aligned by characters)
        maps = vocab_maps(cfg.loss, cfg.student, self.plans, self.tokenizer, self.teacher_toks)  # their logits
        state = self.build_model(maps, checkpoint_dir, wrap, run_changes)
        self.train_split, self.val = load_splits(cfg.data, cfg.train, self.tokenizer, self.teacher_toks)
        if state:
            state["data"] = load_data_state(checkpoint_dir)
        return state

    def build_model(self, maps: Optional[dict] = None, checkpoint_dir: Optional[str] = None, wrap=None,
                    run_changes: bool = False) -> Optional[dict]:
        """The Distiller, optimizer and schedule alone, restored from `checkpoint_dir` (its state, else
        None): for callers that bring their own batches (`bench gpu`, `bench step`). maps: `plans.vocab_maps`;
        wrap: DDP's `prepare_model` when world > 1; run_changes (`--resume-override`): the config's rates win."""
        cfg = self.cfg
        state = check_compatible(checkpoint_dir, cfg, allow_run_changes=run_changes) if checkpoint_dir else None
        whole = state is not None and not is_sharded_checkpoint(checkpoint_dir)  # else FSDP2 shards, loaded below
        student = job_student(cfg.student, self.precision.weight_dtype, cfg.train.seed,
                              saved=str(Path(checkpoint_dir) / "student") if whole else None)
        torch.manual_seed(cfg.train.seed)  # projector init: the same on every rank and every run
        # sharded: the job's (the projector kind's one rule, `projectors.job_kind`), also in one process
        self.distiller = build_distiller(student, self.plans, kv_geometry(student), cfg, maps,
                                   sharded=cfg.ray.sharded).to(self.device)
        if self.sharded:  # before the optimizer: it holds the shards
            fsdp.shard(self.distiller, self.precision, self.device)
        self.opt = build_optimizer(self.distiller, cfg.optim)
        self.sched = build_scheduler(self.opt, cfg.optim, cfg.train.steps)
        if state:
            load_into(checkpoint_dir, self.distiller, self.opt, self.sched)
            if run_changes:
                self._adopt_optim_settings()
        self.start_step = state["step"] if state else 0
        self.model = wrap(self.distiller) if wrap is not None and self.world > 1 and not self.sharded \
            else self.distiller
        return state

    def _adopt_optim_settings(self) -> None:
        """The config's learning rates, weight decay and schedule replace a restored checkpoint's
        (Adam's moment estimates stay): loading an optimizer state would otherwise bring back the
        old values."""
        o = self.cfg.optim
        lrs = {"student": o.lr_student, "projector": o.lr_projector}
        for g in self.opt.param_groups:
            g["initial_lr"] = lrs.get(g.get("name"), g["initial_lr"])
            g["weight_decay"] = o.weight_decay
        self.sched.base_lrs = [g["initial_lr"] for g in self.opt.param_groups]
        for g, base, fn in zip(self.opt.param_groups, self.sched.base_lrs, self.sched.lr_lambdas):
            g["lr"] = base * fn(self.sched.last_epoch)  # the lambdas already follow the new train.steps / warmup

    def data(self, source, until: Optional[int] = None, depth: Optional[int] = None, flag: Optional[Path] = None,
             state: Optional[dict] = None):
        """This rank's step source over the training split (`rollout.step_source`; on-policy, an
        `OnPolicyStepSource` sampling with the job's engine): teachers' answers from `source`, the steps after
        `start_step` up to `until`, `depth` ahead, continuing from `state`; `flag` exists while it samples."""
        from kava_ray.rollout.engines import engine_for  # Ray: see the module docstring
        from kava_ray.rollout.onpolicy_source import OnPolicyStepSource, Sampler
        from kava_ray.rollout.step_source import StepSource

        kw = dict(rank=self.rank, world=self.world, device=self.device, start_step=self.start_step, until=until,
                  depth=depth)
        if self.cfg.onpolicy.fraction == 0:
            data = StepSource(self.cfg, self.plans, self.train_split, source, **kw)
        else:
            engine = engine_for(self.cfg, self.plans, source, self.distiller.student, self.tokenizer.eos_token_id,
                                self.train_split.pad_id, self.precision)
            sampler = Sampler(self.cfg, self.train_split, self.tokenizer, self.teacher_toks, engine, self.rank, flag)
            data = OnPolicyStepSource(self.cfg, self.plans, self.train_split, source, sampler, **kw)
        if state is not None:
            data.load_state_dict(state)
        return data

    def step(self, step_no: int, micro_batches, grad_share: bool = False) -> dict[str, torch.Tensor]:
        """One optimizer step over `micro_batches` (an iterable of (Batch, {teacher: KVBatch})).

        Returns the step's metrics as float64 tensors on the device: each a mean over the
        micro-batches that measured it (a metric a micro-batch could not measure is not in its dict:
        the sampled reverse KL on a batch of the data), counts (SUMMED) summed, plus grad_norm (and
        with `grad_share`, grad/kv_share of the first micro-batch); `self.measured`: how many
        micro-batches measured each (the weights of `reduce_metrics`). Nothing is converted to
        Python here (no GPU sync).
        """
        torch.manual_seed(self.cfg.train.seed * 1_000_003 + step_no * 7919 + self.rank)  # dropout identical on resume
        accum = self.cfg.optim.accumulation
        sums: dict[str, torch.Tensor] = {}
        measured: dict[str, int] = {}
        share = None
        for micro, (batch, kv) in enumerate(micro_batches):
            no_sync = self.world > 1 and micro < accum - 1
            with self._no_sync(no_sync):  # forward and backward: FSDP2 reads its flag in the post-backward
                # grad/kv_share: not under FSDP2 (the sharded parameters are not in the graph autograd.grad reads)
                measure = grad_share and micro == 0 and not self.sharded
                with self.autocast():
                    out = self.model(batch.to(self.device), kv, output_kv_term=measure)
                kv_grads = self._kv_grads(out.kv_term) if measure else None
                with record_function("kava/backward"):  # profiler scopes (`kava-ray bench step`): free without one
                    (out.loss / accum).backward()
            if kv_grads is not None:  # .grad now holds this micro-batch's gradient / accum (one micro-batch under
                # DDP: averaged over ranks, so KV's is averaged too before "the rest" is taken as the difference)
                if self.world > 1 and not no_sync and dist.is_available() and dist.is_initialized():
                    for g in kv_grads:
                        if g is not None:
                            dist.all_reduce(g, op=dist.ReduceOp.AVG)
                share = self._kv_shares(kv_grads, accum)
            for k, v in out.metrics.items():
                sums[k] = sums.get(k, 0) + v.detach().double()
                measured[k] = measured.get(k, 0) + 1
        with record_function("kava/optimizer"):
            # clipped per group: the projectors' gradients (a KV loss's, large at first) never shrink the student's
            limit = self.cfg.optim.grad_clip or float("inf")
            norms = {g.get("name", str(i)): fsdp.local_norm(torch.nn.utils.clip_grad_norm_(g["params"], limit))
                     for i, g in enumerate(self.opt.param_groups)}
            self.last_lrs = [g["lr"] for g in self.opt.param_groups]  # this step's rates (before the schedule moves)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
        out = {k: v if summed(k) else v / measured[k] for k, v in sums.items()}
        self.measured = measured
        if share is not None:
            out.update(share)
        out["grad_norm"] = norms["student"].detach().double()  # the student's gradient norm (before clipping)
        if "projector" in norms:
            out["grad_norm_projector"] = norms["projector"].detach().double()
        return out

    def _no_sync(self, skip: bool):
        """No gradient reduction for this micro-batch (DDP's no_sync; FSDP2's
        set_requires_gradient_sync): held over its forward and backward, as FSDP2 reads the flag in
        its post-backward hook (where it reduce-scatters) and DDP in its forward; the gradients
        accumulate unreduced until the last micro-batch's backward reduces them once."""
        if not skip or (self.sharded and self.cfg.ray.fsdp_reduce == "micro_batch"):  # memory over communication
            return contextlib.nullcontext()
        if not self.sharded:
            return self.model.no_sync()
        model = self.model

        @contextlib.contextmanager
        def off():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return off()

    def _student_params(self) -> list:
        """The optimizer's student group (`distiller.param_groups`): what grad_norm measures."""
        return next(g["params"] for g in self.opt.param_groups if g.get("name") == "student")

    def _kv_grads(self, term: torch.Tensor) -> list:
        """d(kv_weight * KV loss) / d(student) of the forward just run (its
        `DistillOutput.kv_term`), per student parameter (None where it does not reach one): a
        separate backward that leaves .grad alone."""
        params = self._student_params()
        if not term.requires_grad:
            return [None] * len(params)
        return list(torch.autograd.grad(term, params, retain_graph=True, allow_unused=True))

    def _kv_shares(self, kv_grads: list, accum: int) -> dict[str, torch.Tensor]:
        """grad/kv_share, |KV's gradient| / |the whole loss's|, and grad/kv_ratio, |KV's| / |every
        other term's| (CE's in a CE + KV recipe: the rest is the whole gradient minus KV's), on the
        student's parameters."""
        whole, kv, rest = [], [], []
        for p, g in zip(self._student_params(), kv_grads):
            if p.grad is None:
                continue
            w = p.grad * accum
            whole.append(w)
            kv.append(g if g is not None else torch.zeros_like(w))
            rest.append(w - kv[-1])
        if not whole:
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            return {GRAD_KV_SHARE: zero, GRAD_KV_RATIO: zero}
        n_kv = get_total_norm(kv)
        return {GRAD_KV_SHARE: (n_kv / get_total_norm(whole).clamp_min(1e-30)).double(),
                GRAD_KV_RATIO: (n_kv / get_total_norm(rest).clamp_min(1e-30)).double()}

    def save(self, path, step: int, data_state: dict, with_optimizer: bool = True,
             extra: Optional[dict] = None) -> Path:
        """A checkpoint at `step`: the Distiller (and optimizer), and `data_state` (the step
        source's `state_dict()`, where the data side continues)."""
        return save_checkpoint(path, self.distiller, self.tokenizer, self.opt if with_optimizer else None,
                               self.sched if with_optimizer else None, step, data_state, self.cfg, extra=extra,
                               rank=self.rank)

    def evaluate(self, source) -> dict[str, float]:
        """`eval/*` on the validation split: what checkpoint selection and Tune read; with
        `train.eval_tasks`, rank 0 runs those harness tasks on the student too
        (`eval/task/<task>/<metric>`; the other ranks wait for it: `recipes.rank_wait`)."""
        out = evaluate_heldout(self.distiller, source, self.plans, self.val, self.cfg, self.device, torch.float32,
                               autocast=self.autocast)
        t = self.cfg.train
        if t.eval_tasks and self.rank == 0:
            if self._tasks is None:
                self._tasks = resolve_tasks(t.eval_tasks)
            t0 = time.perf_counter()
            try:
                out.update(task_metrics(run_tasks(self.distiller.student, self.tokenizer, self._tasks,
                                                  self.cfg.data.prompt_format, t.eval_tasks_limit,
                                                  batch_size=t.batch_size, max_length=t.eval_tasks_max_length)))
            except torch.OutOfMemoryError:
                raise KavaError(f"train.eval_tasks: out of memory on rank 0 running {', '.join(t.eval_tasks)} at "
                                f"batch {t.batch_size} (the harness's windows are the model's context unless "
                                f"train.eval_tasks_max_length caps them): cap it, lower train.batch_size, or "
                                f"evaluate the checkpoints with `kava-ray eval RUN --tasks`") from None
            out[EVAL_TASKS_S] = time.perf_counter() - t0
        return out

    def test(self, source) -> dict[str, float]:
        """`test/*` on the test split, once, after the last step (never used to select anything), in
        fp32 without autocast: the numbers `kava-ray eval` computes for the same checkpoint."""
        split = load_test_split(self.cfg.data, self.cfg.train, self.tokenizer, self.teacher_toks)
        return evaluate_heldout(self.distiller, source, self.plans, split, self.cfg, self.device, torch.float32,
                                prefix="test")


# ------------------------------------------------------------------------------------------ the Ray Train loop


def _quiet_train_logs() -> None:
    """Ray Train V2 logs every report at INFO from a logger named after its source file (so its own
    `LoggingConfig`, which filters `ray.train*` names, does not reach it); metrics.jsonl and the
    progress bar already carry those numbers. Found by name, without importing Ray internals."""
    import ray.train  # Ray: see the module docstring

    name = os.path.join(os.path.dirname(ray.train.__file__), "v2", "_internal", "execution", "context.py")
    logging.getLogger(name).setLevel(logging.WARNING)


def report_step(recipe: DistillRecipe, record: dict, step: int, data_state: Optional[dict] = None) -> None:
    """`ray.train.report` of a step's numbers; at a save step (`data_state`) with rank 0's
    checkpoint (FSDP2: every rank's shard, Ray Train merging them), its numbers inside (a restored
    run re-announces them)."""
    import ray.train  # Ray: see the module docstring

    if data_state is None:
        ray.train.report(record)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ck = None
        if recipe.rank == 0 or recipe.sharded:  # FSDP2: every rank its shard (Ray Train merges the directories)
            recipe.save(Path(tmp) / "ckpt", step, data_state, extra={"metrics": record})
            ck = ray.train.Checkpoint.from_directory(str(Path(tmp) / "ckpt"))
        ray.train.report(record, checkpoint=ck)


def finish(recipe: DistillRecipe, source, log: Optional[MetricsLog], run_dir: Path, data_state: dict) -> None:
    """Rank 0 (FSDP2: every rank, rank 0 writing), after the last step: the test split, read once
    after every selection decision, and the final student in `run_dir/final` (outside Ray's
    checkpoint dirs; a whole Hugging Face student either way), logged to the trackers as an
    artifact."""
    steps = recipe.cfg.train.steps
    # at `steps`: restored from the last checkpoint of a run cut off in here (a complete run's
    # --resume ends in preflight: `checkpoint.finished`); past it, final/ would name `steps` for
    # weights trained longer
    if recipe.start_step <= steps:
        test = recipe.test(source)
        with tempfile.TemporaryDirectory() as elsewhere:  # (the other ranks gather with rank 0 and write nothing)
            final = run_dir / "final" if recipe.rank == 0 else Path(elsewhere) / "final"
            recipe.save(final, steps, data_state, with_optimizer=False, extra={"test": test})
        if log is not None:
            log.write({"step": steps, "kind": "test", **test})
            log.trackers.log_artifact(run_dir / "final")  # the final student (MLflow, W&B; TensorBoard has none)
    if log is not None:
        log.trackers.close()


def open_run(recipe: DistillRecipe, source, run_dir: Path, state: Optional[dict], evaluates: bool
             ) -> tuple[Optional[MetricsLog], dict]:
    """(rank 0's metrics log, with its trackers; the held-out numbers before any training, on the
    ranks that evaluate, {} on a resumed run). A run restored after its last step re-announces its
    final result."""
    import ray.train  # Ray: see the module docstring

    cfg, start = recipe.cfg, recipe.start_step
    log = MetricsLog(run_dir / METRICS, start, open_trackers(cfg.train.loggers, run_dir, cfg.to_dict(), start)) \
        if recipe.rank == 0 else None
    first = recipe.evaluate(source) if start == 0 and evaluates else {}
    if log is not None and first:
        log.write({"step": 0, "kind": "eval", **first})
    if state and start >= cfg.train.steps:
        ray.train.report(state.get("metrics", {"step": start}))
    return log, first


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker; `config` is a `LoopConfig` as a dict."""
    import ray.train  # Ray: see the module docstring
    import ray.train.torch

    from kava_ray.runtime.job import kv_source

    loop = LoopConfig.from_dict(config)
    cfg, plans, run_dir = validate_config(loop.job), plans_from_payload(loop.plans), Path(loop.run_dir)
    _quiet_train_logs()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    recipe = DistillRecipe(cfg, plans, rank, world, ray.train.torch.get_device())
    ckpt = ray.train.get_checkpoint()
    with (ckpt.as_directory() if ckpt is not None else contextlib.nullcontext(loop.resume)) as ckdir:
        state = recipe.setup(ckdir, wrap=ray.train.torch.prepare_model, run_changes=loop.resume_override)
    source = kv_source(cfg, plans, recipe.train_split.fingerprint)
    fit_maps(recipe, source)  # kind fit: the student-side maps start as the ridge fit (not on a resumed run)
    data_state = state["data"] if state else None  # the last save's (final/ keeps it)
    data = recipe.data(source, flag=run_dir / SAMPLING if rank == 0 else None, state=data_state)
    with contextlib.closing(data):  # a colocated engine (vLLM) is shut down after the loop's last collective
        evaluates = rank == 0 or recipe.sharded  # FSDP2: every rank runs the sharded forwards, rank 0 logs
        wait = rank_zero_wait(cfg.train.eval_tasks, world)  # the other ranks, while rank 0 runs the harness tasks
        log, last_eval = open_run(recipe, source, run_dir, state, evaluates)  # last_eval: in every report (Tune's)
        if recipe.start_step == 0:
            wait()
        evals = evals_through(recipe.start_step, cfg.train)  # a Tune scheduler's clock, counted on from a resumed step
        steps = run_steps(recipe, data, cfg.train.steps, lambda s: step_kind(s, cfg.train),
                          grad_share=cfg.loss.kv_weight > 0)
        try:
            for done in steps:
                if done.record is None:  # not a log step
                    continue
                kind, step, record = done.kind, done.step, done.record
                evals += kind.eval
                if kind.eval and evaluates:
                    last_eval = recipe.evaluate(source)
                if kind.eval:
                    wait()
                if rank == 0:
                    log.write(record)
                    if kind.eval:
                        log.write({"step": step, "kind": "eval", **last_eval})
                    record.update(last_eval)
                data_state = data.state_dict() if kind.save else data_state  # every rank (collectives)
                report = {k: v for k, v in record.items() if isinstance(v, (int, float))} | {EVALS: evals}
                report_step(recipe, report, step, data_state if kind.save else None)  # EVALS: a scheduler's clock
        except NonFinite as e:  # no fault to retry from the checkpoint (it would go bad again): one line for the driver
            if log is not None:
                log.write({"step": e.step, "kind": ERROR, "message": str(e)})
            return
        if evaluates:
            finish(recipe, source, log, run_dir, data_state)
