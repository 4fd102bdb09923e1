"""The student's recipe: `DistillRecipe.setup`, `step`, `save`, and the Ray Train loop that runs it.

`DistillRecipe` holds one rank's state (the Distiller, the optimizer and schedule, the data stream) and does one
optimizer step over `optim.accumulation` micro-batches of (Batch, {teacher: KVBatch}); it knows nothing of where
the KV comes from, so `kava-ray bench feed` times exactly this step. `train_loop_per_worker` is the plain loop
Ray Train runs; what it does and how a resume continues the same curve: docs/internals/step.md#recipe.

Ray (and `actors`, the KV sources that need it) is imported inside the functions that use it: `kava-ray bench gpu`
builds this recipe on images without Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
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

from kava_ray.common.config import JobConfig, TrainConfig, validate_config
from kava_ray.common.errors import KavaError
from kava_ray.common.metrics_file import ERROR, METRICS, SAMPLING, MetricsLog
from kava_ray.common.trackers import open_trackers
from kava_ray.core import fsdp
from kava_ray.core.checkpoint import (
    check_compatible,
    is_sharded_checkpoint,
    load_into,
    load_pending,
    save_checkpoint,
)
from kava_ray.core.distiller import Distiller, build_optimizer, build_scheduler
from kava_ray.core.kv import student_forward_kv
from kava_ray.core.metric_names import (
    COS_SIM,
    EVALS,
    GRAD_KV_RATIO,
    GRAD_KV_SHARE,
    KV_TOKENS,
    LABEL_TOKENS,
    RKL,
    RKL_SUM,
    SAMPLE_S,
    SAMPLED_TOKENS,
    SKIPPED_BATCHES,
    TOKENS,
    phase,
    summed,
)
from kava_ray.core.models import kv_geometry, load_student, load_tokenizer
from kava_ray.core.nonfinite import FirstBad
from kava_ray.core.plans import (
    data_seed,
    eval_stream,
    load_splits,
    load_test_split,
    plans_from_payload,
    teacher_logits_top_k,
    teacher_tokenizers,
    token_logprob_teachers,
    vocab_maps,
    wants_hidden,
)
from kava_ray.core.precision import student_precision
from kava_ray.core.probe import KVAlignment
from kava_ray.data import BatchStream
from kava_ray.recipes.evaluate import evaluate_heldout


@dataclass
class LoopConfig:
    """What the driver hands each Ray Train worker (as a dict: `to_dict` / `from_dict`, Ray Train's
    train_loop_config). job: `JobConfig.to_dict()`; plans: `plans.plans_payload`; resume: a checkpoint dir;
    resume_override: `--resume-override` (the config's optim.*/train.*/data.*/loss.*/onpolicy.* replace the
    checkpoint's)."""

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
    """One rank of a distillation run: `setup()`, then `step(step_no, micro_batches)`, `save(path)`."""

    def __init__(self, cfg: JobConfig, plans: dict, rank: int = 0, world: int = 1, device="cpu"):
        self.cfg, self.plans = cfg, plans
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        # student.precision on this device: the weight dtype the student loads in and the autocast of every
        # forward (auto: fp32 master weights + bf16 autocast on a CUDA GPU with bf16, plain fp32 on a CPU)
        self.precision = student_precision(cfg.student, self.device)
        self.autocast = self.precision.autocast
        # ray.strategy fsdp with several workers: the Distiller sharded with FSDP2 (`core.fsdp`); every rank then
        # takes part in evaluation and checkpoints (their collectives), rank 0 alone writes what is shared
        self.sharded = cfg.ray.strategy == "fsdp" and world > 1
        # the last step's: its learning rates (before the schedule moves) and how many micro-batches measured each metric
        self.last_lrs: list = []
        self.measured: dict[str, int] = {}

    def setup(self, checkpoint_dir: Optional[str] = None, wrap=None, run_changes: bool = False) -> Optional[dict]:
        """Build (or restore from `checkpoint_dir`) the model and optimizer (`build_model`), the tokenizers and the
        rank's stream of training batches. Returns the checkpoint's state (None from scratch)."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.student.model)
        self.teacher_toks = teacher_tokenizers(self.plans)  # teachers of another tokenizer (aligned by characters)
        maps = vocab_maps(cfg, self.plans, self.tokenizer, self.teacher_toks)  # for their logits (hybrid)
        state = self.build_model(maps, checkpoint_dir, wrap, run_changes)
        self.train_split, self.val = load_splits(cfg, self.tokenizer, self.teacher_toks)  # test: only in `test()`
        self.stream = BatchStream(self.train_split, cfg.train.batch_size, data_seed(cfg), rank=self.rank,
                                  world_size=self.world, state=state["stream"] if state else None)
        self.skipped_before = skip_resumed(self.stream, state["stream"] if state else None)  # train.on_bad_kv
        kept = load_pending(checkpoint_dir) if state else []  # on-policy: every rank's sampled batches in flight
        self.pending = kept[self.rank] if self.rank < len(kept) else []
        return state

    def build_model(self, maps: Optional[dict] = None, checkpoint_dir: Optional[str] = None, wrap=None,
                    run_changes: bool = False) -> Optional[dict]:
        """The Distiller, optimizer and schedule alone (restored from `checkpoint_dir`): no tokenizer and no data,
        for callers that bring their own batches (`bench gpu`, `bench step`; a GPU image may lack `datasets`).

        maps: the vocabulary maps of logit teachers of another tokenizer (`plans.vocab_maps`). wrap: e.g.
        `ray.train.torch.prepare_model` (DDP) when world > 1. run_changes (`--resume-override`): the checkpoint's
        optim.*/train.*/data.*/loss.*/onpolicy.* may differ, and the config's learning rates, weight decay and
        schedule win.
        Returns the checkpoint's state (None from scratch)."""
        cfg = self.cfg
        state = check_compatible(checkpoint_dir, cfg, allow_run_changes=run_changes) if checkpoint_dir else None
        whole = state is not None and not is_sharded_checkpoint(checkpoint_dir)  # else FSDP2 shards, loaded below
        student = load_student(str(Path(checkpoint_dir) / "student") if whole else cfg.student.model,
                               dtype=self.precision.weight_dtype, keep=None if whole else cfg.student.keep_layers,
                               gradient_checkpointing=cfg.student.gradient_checkpointing)
        torch.manual_seed(cfg.train.seed)  # projector init: the same on every rank and every run
        self.distiller = Distiller(student, self.plans, kv_geometry(student), cfg, maps,
                                   sharded=self.sharded).to(self.device)
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

    def fit_maps(self, source, batches: int = 16) -> list[str]:
        """Projector kind fit: each teacher's student-side map starts as the ridge fit of the student's KV to that
        teacher's (`probe.KVAlignment`'s ridge probe over the first `batches` batches of the training split, on rank 0,
        broadcast to the other ranks), so step 1 already compares the student's best linear image with the teacher.
        A map restored from a checkpoint is kept. Returns the teachers fitted here."""
        todo = {n: pr for n, pr in self.distiller.projectors.items() if pr.student_side and not pr.k_map.fitted}
        if not todo:
            return []
        if self.rank == 0:  # fit once; the other ranks receive the maps (DDP broadcast only at its construction)
            from actors.feed import KVFeed, feed_items  # Ray: see the module docstring

            for n in todo:
                if self.plans[n].aligned:
                    raise KavaError(f"align.projector.kind: fit needs teacher '{n}' to share the student's tokenizer "
                                    f"(its KV is fit token by token); use linear or elastic for it")
            stream = eval_stream(self.train_split, self.cfg)
            feed = KVFeed(source, feed_items(stream, min(batches, stream.steps_per_epoch)),
                          {n: self.plans[n].layers for n in todo}, wire_dtype=self.cfg.align.wire_dtype,
                          device=self.device)
            self.fit_maps_on((batch, kv) for (_, _, _, batch), kv in feed)
        if self.world > 1 and dist.is_available() and dist.is_initialized():
            for pr in todo.values():
                for t in (*pr.k_map.parameters(), *pr.v_map.parameters(), pr.k_map.fitted, pr.v_map.fitted):
                    dist.broadcast(t.data, src=0)
        return list(todo)

    def fit_maps_on(self, micro) -> list[str]:
        """`fit_maps` from the caller's own (Batch, {teacher: KVBatch}) pairs: for benches that bring their batches
        and no data source (`bench gpu`). Returns the teachers fitted here."""
        todo = {n: pr for n, pr in self.distiller.projectors.items() if pr.student_side and not pr.k_map.fitted}
        if not todo:
            return []
        probes = {n: KVAlignment(list(pr.target_pos), probe=True) for n, pr in todo.items()}
        student = self.distiller.student
        was_training = student.training
        student.eval()  # the student as it is, no dropout
        with torch.no_grad():
            for batch, kv in micro:
                mask = batch.attention_mask.to(self.device)
                _, skv = student_forward_kv(student, batch.input_ids.to(self.device), mask,
                                            key_space=self.cfg.align.key_space)
                for n, kva in probes.items():
                    kva.fit_batch((skv.keys, skv.values), (kv[n].keys, kv[n].values), mask)
        student.train(was_training)
        for n, pr in todo.items():
            probes[n].fit()
            pr.k_map.load_fit(probes[n].maps["k"])
            pr.v_map.load_fit(probes[n].maps["v"])
        return list(todo)

    def feed(self, source, until: Optional[int] = None, depth: Optional[int] = None):
        """The KVFeed over this rank's stream: exactly the batches of the steps up to `until` (train.steps), no
        read-ahead past the last step (a skipped batch, train.on_bad_kv=skip, extends the read by one)."""
        from actors.feed import KVFeed, feed_items  # Ray: see the module docstring

        cfg = self.cfg
        remaining = max(0, (until or cfg.train.steps) - self.start_step) * cfg.optim.accumulation
        items, read_ahead = feed_items(self.stream), True
        # sampled batches, taken only as a step asks for its batch: lag 0 takes (samples) that batch then; lag 1 also
        # the next one, sampled while the teachers score this one, and scored while the student trains on it
        if cfg.onpolicy.fraction > 0:
            from actors.onpolicy import onpolicy_items

            self.sampler = self.make_sampler(source)
            items = itertools.chain(getattr(self, "pending", []),
                                    onpolicy_items(self.stream, self.sampler, cfg.onpolicy.fraction, cfg.train.seed))
            depth, read_ahead = 1 + cfg.onpolicy.lag, False
        return KVFeed(source, items, {n: p.layers for n, p in self.plans.items()},
                      depth=cfg.align.prefetch_depth if depth is None else depth, wire_dtype=cfg.align.wire_dtype,
                      device=self.device, logits_top_k=teacher_logits_top_k(self.cfg, self.plans),
                      on_bad_kv=cfg.train.on_bad_kv, limit=remaining, hidden=wants_hidden(cfg),
                      token_logprobs=token_logprob_teachers(cfg, self.plans), read_ahead=read_ahead)

    def make_sampler(self, source):
        """On-policy: the `actors.onpolicy.Sampler` of this rank (the student samples on this worker; with
        `onpolicy.source: teacher`, the named teacher's actor writes)."""
        from actors.onpolicy import Sampler, teacher_writer  # Ray: see the module docstring

        cfg, teacher, model = self.cfg, None, self.distiller.student
        if cfg.onpolicy.source == "teacher":
            teacher, model = teacher_writer(cfg, self.plans, source), None
        return Sampler(cfg, self.train_split, self.tokenizer, self.teacher_toks, model=model, teacher=teacher,
                       rank=self.rank, autocast=self.autocast, flag=getattr(self, "sampling_flag", None))

    def step(self, step_no: int, micro_batches, grad_share: bool = False) -> dict[str, torch.Tensor]:
        """One optimizer step over `micro_batches` (an iterable of (Batch, {teacher: KVBatch})).

        Returns the step's metrics as float64 tensors on the device: each a mean over the micro-batches that
        measured it (a metric a micro-batch could not measure is not in its dict: the sampled reverse KL on a batch of
        the data), counts (SUMMED) summed, plus grad_norm (and with `grad_share`, grad/kv_share of the first
        micro-batch); `self.measured`: how many micro-batches measured each (the weights of `reduce_metrics`).
        Nothing is converted to Python here (no GPU sync).
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
        """No gradient reduction for this micro-batch (DDP's no_sync; FSDP2's set_requires_gradient_sync): held over
        its forward and backward, as FSDP2 reads the flag in its post-backward hook (where it reduce-scatters) and DDP
        in its forward; the gradients accumulate unreduced until the last micro-batch's backward reduces them once."""
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
        """d(kv_weight * KV loss) / d(student) of the forward just run (its `DistillOutput.kv_term`), per student
        parameter (None where it does not reach one): a separate backward that leaves .grad alone."""
        params = self._student_params()
        if not term.requires_grad:
            return [None] * len(params)
        return list(torch.autograd.grad(term, params, retain_graph=True, allow_unused=True))

    def _kv_shares(self, kv_grads: list, accum: int) -> dict[str, torch.Tensor]:
        """grad/kv_share, |KV's gradient| / |the whole loss's|, and grad/kv_ratio, |KV's| / |every other term's|
        (CE's in a CE + KV recipe: the rest is the whole gradient minus KV's), on the student's parameters."""
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

    def save(self, path, step: int, stream_state: dict, with_optimizer: bool = True,
             extra: Optional[dict] = None, pending: Optional[list] = None) -> Path:
        return save_checkpoint(path, self.distiller, self.tokenizer, self.opt if with_optimizer else None,
                               self.sched if with_optimizer else None, step, stream_state, self.cfg, extra=extra,
                               pending=pending, rank=self.rank)

    def save_run(self, path, step: int, feed, skipped: list[int], with_optimizer: bool = True,
                 extra: Optional[dict] = None, pending: Optional[list] = None) -> Path:
        """`save` at the feed's position: the stream just after the last batch trained on, or -- with `pending`
        (`gather_pending`: on-policy, whose batches in flight were sampled with the weights of their time) --
        after the batches in flight, which the checkpoint keeps and a resumed run trains on first: the same curve
        either way."""
        state = stream_state_after(self.stream, feed, skipped, keep_in_flight=pending is not None)
        return self.save(path, step, state, with_optimizer, extra, pending)

    def gather_pending(self, feed) -> Optional[list]:
        """On-policy, on every rank at a save step: every rank's batches in flight, [rank] -> items (rank 0
        saves them); None off-policy (a resume reads those batches again from the stream)."""
        if self.cfg.onpolicy.fraction == 0:
            return None
        mine = feed.pending_items()
        if self.world == 1 or not (dist.is_available() and dist.is_initialized()):
            return [mine]
        out = [None] * self.world
        dist.all_gather_object(out, mine)
        return out

    def evaluate(self, source) -> dict[str, float]:
        """`eval/*` on the validation split: what checkpoint selection and Tune read."""
        return evaluate_heldout(self.distiller, source, self.plans, self.val, self.cfg, self.device, torch.float32,
                                autocast=self.autocast)

    def test(self, source) -> dict[str, float]:
        """`test/*` on the test split, once, after the last step (never used to select anything), in fp32
        without autocast: the numbers `kava-ray eval` computes for the same checkpoint."""
        split = load_test_split(self.cfg, self.tokenizer, self.teacher_toks)
        return evaluate_heldout(self.distiller, source, self.plans, split, self.cfg, self.device, torch.float32,
                                prefix="test")


# ---------------------------------------------------------------------------------- streams, ranks, metrics


def reduce_metrics(values: dict[str, torch.Tensor], world: int, measured: Optional[dict[str, int]] = None
                   ) -> dict[str, float]:
    """Python numbers for logging: counts (SUMMED) summed over ranks, every other metric the mean over the
    micro-batches of every rank that measured it (`measured`: this rank's, `DistillRecipe.step`; 1 for a metric not
    in it). A metric no rank measured is absent; one only some ranks measured is theirs alone (not averaged with 0).
    Every rank calls it: one gather of the names (ranks may have measured different ones), one all-reduce."""
    if world == 1:
        keys = sorted(values)
        return dict(zip(keys, torch.stack([values[k].reshape(()) for k in keys]).tolist()))
    measured = measured or {}
    names: list = [None] * world
    dist.all_gather_object(names, sorted(values))
    keys = sorted(set().union(*names))
    weight = {k: float(measured.get(k, 1)) if k in values else 0.0 for k in keys}
    like = next(iter(values.values()))
    zero = torch.zeros((), dtype=torch.float64, device=like.device)
    flat = torch.stack([values[k].reshape(()).double() * (1.0 if summed(k) else weight[k]) if k in values else zero
                        for k in keys] + [zero + weight[k] for k in keys])
    dist.all_reduce(flat)
    totals, weights = flat[:len(keys)].tolist(), flat[len(keys):].tolist()
    return {k: t if summed(k) else t / w for k, t, w in zip(keys, totals, weights) if w > 0}


def stream_state_after(stream, feed, skipped: Optional[list[int]] = None, keep_in_flight: bool = False) -> dict:
    """The stream position just after the last batch the student trained on, with every rank's skips.

    The feed reads ahead, so the stream is ahead by the batches in flight: step back by those. The saved position
    counts only the batches trained on (the same on every rank); `skipped` lists each rank's cumulative skips
    (train.on_bad_kv=skip: each rank reads its own shard), which `skip_resumed` steps over on resume.
    keep_in_flight: the batches in flight are saved with the checkpoint (on-policy): no step back for them.
    """
    s = stream.state()
    own = int(skipped[stream.rank]) if skipped else 0
    behind = (0 if keep_in_flight else feed.in_flight) + own
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
    counts = torch.zeros(world, dtype=torch.float64, device=device)
    counts[rank] = own
    dist.all_reduce(counts)
    return [int(round(c)) for c in counts.tolist()]


def micro_batches(feed, accum: int, step: int, wait: list):
    """The step's `accum` (Batch, {teacher: KVBatch}) from the feed; a batch of non-finite teacher KV with
    train.on_bad_kv=stop becomes one line naming the teacher, batch key and step."""
    from actors.feed import BadKV  # Ray: see the module docstring

    for _ in range(accum):
        try:
            (_, _, _, batch), kv = next(feed)
        except BadKV as e:
            raise KavaError(f"{e} at step {step} (train.on_bad_kv=stop)") from None
        wait.append(feed.last_wait_s)
        yield batch, kv


def train_step(recipe: DistillRecipe, feed, step: int, grad_share: bool = False) -> dict[str, torch.Tensor]:
    """`recipe.step` on the feed's next micro-batches, plus the time it waited for teachers and the rank's
    cumulative skipped batches (float64 tensors on the device, like the step's own metrics)."""
    waits: list = []
    sampler = getattr(recipe, "sampler", None)  # on-policy: the seconds this step spent sampling
    sampled_before = sampler.seconds if sampler is not None else 0.0
    values = recipe.step(step, micro_batches(feed, recipe.cfg.optim.accumulation, step, waits), grad_share)
    device = values["grad_norm"].device
    if sampler is not None:
        values[SAMPLE_S] = torch.tensor(sampler.seconds - sampled_before, dtype=torch.float64, device=device)
    values["teacher_wait_s"] = torch.tensor(sum(waits), dtype=torch.float64, device=device)
    values[SKIPPED_BATCHES] = torch.tensor(float(recipe.skipped_before + feed.skipped), dtype=torch.float64,
                                           device=device)  # cumulative, summed over ranks
    return values


@dataclass(frozen=True)
class StepKind:
    """What a step does besides training: log its metrics, evaluate (rank 0), save a checkpoint."""

    log: bool
    eval: bool
    save: bool


def step_kind(step: int, t: TrainConfig) -> StepKind:
    """Save every save_steps and at the end; evaluate every eval_steps, at the end and at every save a kept
    checkpoint is scored by (`train.checkpoint_score` eval/*); log every log_steps and at each of those."""
    save = step % t.save_steps == 0 or step == t.steps
    scored_by_eval = (t.checkpoint_score or "").startswith("eval/")
    evaluate = step % t.eval_steps == 0 or step == t.steps or (save and scored_by_eval)
    return StepKind(log=save or evaluate or step % t.log_steps == 0, eval=evaluate, save=save)


def evals_through(step: int, t: TrainConfig) -> int:
    """How many evaluations a run has made after step 0, up to and including `step` (a Tune scheduler's clock)."""
    return sum(step_kind(s, t).eval for s in range(1, step + 1))


def evals_before_end(t: TrainConfig) -> int:
    """The evaluations a run makes before its last step: the last rung a Tune scheduler may judge."""
    return evals_through(t.steps - 1, t)


def step_record(values: dict[str, torch.Tensor], step: int, dt: float, lrs: list, world: int,
                measured: Optional[dict[str, int]] = None) -> dict:
    """The step's train record for metrics.jsonl: metrics reduced over ranks (every rank joins the all-reduce;
    `measured`: `reduce_metrics`'), token counts turned into tokens_per_s, the phase, the learning rates of this
    step. A figure the step did not measure is absent, never 0 (the reverse KL of a step that sampled nothing)."""
    metrics = reduce_metrics(values, world, measured)
    metrics.pop(LABEL_TOKENS)
    metrics.pop(KV_TOKENS)
    metrics[SKIPPED_BATCHES] = int(metrics[SKIPPED_BATCHES])
    for k in [k for k in metrics if k.startswith(RKL_SUM + "/")]:  # on-policy: per sampled token
        total = metrics.pop(k)
        if metrics[SAMPLED_TOKENS] > 0:
            metrics[RKL + k[len(RKL_SUM):]] = total / metrics[SAMPLED_TOKENS]
    metrics.update(step=step, kind="train", time_s=dt, tokens_per_s=metrics.pop(TOKENS) / dt,
                   phase=phase(metrics[COS_SIM]), lr_student=lrs[0], lr_projector=lrs[-1])
    return metrics


# ------------------------------------------------------------------------------------------ the Ray Train loop


def _quiet_train_logs() -> None:
    """Ray Train V2 logs every report at INFO from a logger named after its source file (so its own
    `LoggingConfig`, which filters `ray.train*` names, does not reach it); metrics.jsonl and the
    progress bar already carry those numbers. Found by name, without importing Ray internals."""
    import ray.train  # Ray: see the module docstring

    name = os.path.join(os.path.dirname(ray.train.__file__), "v2", "_internal", "execution", "context.py")
    logging.getLogger(name).setLevel(logging.WARNING)


def report_step(recipe: DistillRecipe, feed, record: dict, step: int, skips: Optional[list[int]] = None) -> None:
    """`ray.train.report` of a step's numbers; at a save step (`skips`: every rank's cumulative skips) with rank
    0's checkpoint (FSDP2: every rank's shard, Ray Train merging them), its numbers inside (a restored run
    re-announces them)."""
    import ray.train  # Ray: see the module docstring

    if skips is None:
        ray.train.report(record)
        return
    pending = recipe.gather_pending(feed)  # every rank joins (on-policy)
    with tempfile.TemporaryDirectory() as tmp:
        ck = None
        if recipe.rank == 0 or recipe.sharded:  # FSDP2: every rank its shard (Ray Train merges the directories)
            recipe.save_run(Path(tmp) / "ckpt", step, feed, skips, extra={"metrics": record}, pending=pending)
            ck = ray.train.Checkpoint.from_directory(str(Path(tmp) / "ckpt"))
        ray.train.report(record, checkpoint=ck)


def finish(recipe: DistillRecipe, source, feed, log: Optional[MetricsLog], run_dir: Path, skips: list[int]) -> None:
    """Rank 0 (FSDP2: every rank, rank 0 writing), after the last step: the test split, read once after every
    selection decision, and the final student in `run_dir/final` (outside Ray's checkpoint dirs; a whole Hugging
    Face student either way), logged to the trackers as an artifact."""
    steps = recipe.cfg.train.steps
    # at `steps`: restored from the last checkpoint of a run cut off in here (a complete run's --resume ends in
    # preflight: `checkpoint.finished`); past it, final/ would name `steps` for weights trained longer
    if recipe.start_step <= steps:
        test = recipe.test(source)
        with tempfile.TemporaryDirectory() as elsewhere:  # (the other ranks gather with rank 0 and write nothing)
            final = run_dir / "final" if recipe.rank == 0 else Path(elsewhere) / "final"
            recipe.save_run(final, steps, feed, skips, with_optimizer=False, extra={"test": test})
        if log is not None:
            log.write({"step": steps, "kind": "test", **test})
            log.trackers.log_artifact(run_dir / "final")  # the final student (MLflow, W&B; TensorBoard has none)
    if log is not None:
        log.trackers.close()


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
    source = kv_source(cfg, plans, recipe.stream.split.fingerprint)
    if rank == 0:
        recipe.sampling_flag = run_dir / SAMPLING  # on-policy: the progress bar says when a step is sampling
    recipe.fit_maps(source)  # kind fit: the student-side maps start as the ridge fit (not on a resumed run)
    feed = recipe.feed(source)
    log = MetricsLog(run_dir / METRICS, recipe.start_step,
                     open_trackers(cfg.train.loggers, run_dir, cfg.to_dict(), recipe.start_step)) if rank == 0 else None

    last_eval: dict = {}  # carried in every report, so a Tune scheduler always sees its held-out metric
    evaluates = rank == 0 or recipe.sharded  # FSDP2: every rank runs the sharded forwards, rank 0 logs
    if recipe.start_step == 0 and evaluates:  # held-out numbers before any training
        last_eval = recipe.evaluate(source)
        if rank == 0:
            log.write({"step": 0, "kind": "eval", **last_eval})
    if state and recipe.start_step >= cfg.train.steps:  # restored after the last step: re-announce the final result
        ray.train.report(state.get("metrics", {"step": recipe.start_step}))

    skips = [recipe.skipped_before] * world  # every rank's cumulative skips at the last save (final/ reuses them)
    bad, saved = FirstBad(), recipe.start_step  # a non-finite loss: found at the next log step, before any save
    evals = evals_through(recipe.start_step, cfg.train)  # a Tune scheduler's clock, counted on from a resumed step
    for step in range(recipe.start_step + 1, cfg.train.steps + 1):
        kind = step_kind(step, cfg.train)
        t0 = time.perf_counter()
        values = train_step(recipe, feed, step, grad_share=kind.log and cfg.loss.kv_weight > 0)
        dt = time.perf_counter() - t0
        bad.update(values, step)
        if not kind.log:
            continue
        try:
            bad.check(saved)  # every rank stops at the same step (the norms are all-reduced)
        except KavaError as e:  # not a fault to retry from the checkpoint (it would go bad again): the driver's line
            if rank == 0:
                log.write({"step": step, "kind": ERROR, "message": str(e)})
            return
        saved = step if kind.save else saved
        evals += kind.eval
        record = step_record(values, step, dt, recipe.last_lrs, world, recipe.measured)
        if kind.eval and evaluates:
            last_eval = recipe.evaluate(source)
        if rank == 0:
            log.write(record)
            if kind.eval:
                log.write({"step": step, "kind": "eval", **last_eval})
            record.update(last_eval)
        if kind.save:
            skips = skipped_by_rank(recipe.skipped_before + feed.skipped, rank, world, values["grad_norm"].device)
        report = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        report[EVALS] = evals  # a scheduler judges no trial before one evaluation after step 0
        report_step(recipe, feed, report, step, skips if kind.save else None)
    if evaluates:
        finish(recipe, source, feed, log, run_dir, skips)
