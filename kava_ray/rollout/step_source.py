"""The data side of one rank's training steps: `StepSource.next_step` gives a step's micro-batches
with their teachers' KV, and `state_dict` is where a resumed run continues the same curve.

torchtune's `StatefulDataLoader` shape: one object per rank owns the batch stream
(`data.BatchStream` over the training split), the teachers' feed over it (`rollout.feed.KVFeed`,
`depth` batches ahead) and the batches skipped for non-finite teacher KV (train.on_bad_kv=skip); the
recipe only asks for a step's batches and saves `state_dict()` as one opaque entry of its
checkpoint. On-policy distillation is a subclass in its own module
(`kava_ray.rollout.onpolicy_source.OnPolicyStepSource`: the sampler, its lag and the batches in
flight). docs/internals/step.md#step-source.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist

from kava_ray.common.config import JobConfig
from kava_ray.common.errors import KavaError
from kava_ray.core.kv import KVBatch
from kava_ray.core.metric_names import SKIPPED_BATCHES, TEACHER_WAIT_S
from kava_ray.core.plans import teacher_logits_top_k, token_logprob_teachers, wants_hidden
from kava_ray.data import Batch, BatchStream, TokenizedSplit
from kava_ray.data.splits import data_seed
from kava_ray.rollout.feed import BadKV, KVFeed, KVSource, feed_items


class StepSource:
    """One rank's steps: `next_step(step)` -> the step's `optim.accumulation` (Batch, {teacher: KVBatch}).

    split: the training split; kv_source: where the teachers' answers come from
    (`kava_ray.rollout.feed.KVSource`); start_step: the steps already trained (a resumed run's);
    until: the last step to feed (train.steps): no batch past it is read, and a skipped one extends
    the read by one; depth: batches in flight to the teachers (align.prefetch_depth). The feed
    starts at the first `next_step`, after any `load_state_dict`."""

    read_ahead = True  # the feed tops its pipeline up as soon as a batch is delivered

    def __init__(self, cfg: JobConfig, plans: dict, split: TokenizedSplit, kv_source: KVSource, *, rank: int = 0,
                 world: int = 1, device="cpu", start_step: int = 0, until: Optional[int] = None,
                 depth: Optional[int] = None):
        self.cfg, self.plans, self.kv_source = cfg, plans, kv_source
        self.rank, self.world, self.device = rank, world, device
        self.stream = BatchStream(split, cfg.train.batch_size, data_seed(cfg.train), rank=rank, world_size=world)
        self.limit = max(0, (until or cfg.train.steps) - start_step) * cfg.optim.accumulation
        self.depth = cfg.align.prefetch_depth if depth is None else depth
        self.skipped_before = 0  # this rank's skips before a resume (its cumulative count continues from them)
        self.feed: Optional[KVFeed] = None
        self.wait_s = 0.0  # the last step's wait for the teachers

    # ------------------------------------------------------------------------------------------ the steps

    def items(self) -> Iterator[tuple]:
        """The feed's items (`kava_ray.rollout.feed.feed_items`): the stream's batches."""
        return feed_items(self.stream)

    def _feed(self) -> KVFeed:
        if self.feed is None:
            cfg = self.cfg
            self.feed = KVFeed(self.kv_source, self.items(), {n: p.layers for n, p in self.plans.items()},
                               depth=self.depth, wire_dtype=cfg.align.wire_dtype, device=self.device,
                               logits_top_k=teacher_logits_top_k(cfg.loss, self.plans), on_bad_kv=cfg.train.on_bad_kv,
                               limit=self.limit, hidden=wants_hidden(cfg.loss),
                               token_logprobs=token_logprob_teachers(cfg.onpolicy, self.plans),
                               read_ahead=self.read_ahead)
        return self.feed

    def next_step(self, step: int) -> Iterator[tuple[Batch, dict[str, KVBatch]]]:
        """The step's micro-batches, each taken as the step asks for it; a batch of non-finite
        teacher KV with train.on_bad_kv=stop becomes one line naming the teacher, batch key and
        step."""
        feed, self.wait_s = self._feed(), 0.0
        for _ in range(self.cfg.optim.accumulation):
            try:
                (_, _, _, batch), kv = next(feed)
            except BadKV as e:
                raise KavaError(f"{e} at step {step} (train.on_bad_kv=stop)") from None
            self.wait_s += feed.last_wait_s
            yield batch, kv

    @property
    def skipped(self) -> int:
        """This rank's cumulative skipped batches (train.on_bad_kv=skip), a resumed run's included."""
        return self.skipped_before + (self.feed.skipped if self.feed is not None else 0)

    def step_metrics(self) -> dict[str, float]:
        """The last step's figures of the data side: the seconds it waited for teachers, the cumulative skips."""
        return {TEACHER_WAIT_S: self.wait_s, SKIPPED_BATCHES: float(self.skipped)}

    # ------------------------------------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        """Where a resumed run continues: the stream just after the last batch trained on (the feed
        reads ahead: those batches are read again), with every rank's cumulative skips. Every rank
        calls it (one all-reduce)."""
        return {"stream": stream_state_after(self.stream, self._read_again(), self._skips())}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()` (before the first `next_step`)."""
        s = self.stream
        self.stream = BatchStream(s.split, s.batch_size, s.seed, rank=self.rank, world_size=self.world,
                                  state=state["stream"])
        self.skipped_before = skip_resumed(self.stream, state["stream"])

    def close(self) -> None:
        """Release what the source holds beyond Python objects (an on-policy source: its engine)."""

    def _read_again(self) -> int:
        """The batches read but not trained on that a resumed run reads again from the stream: the feed's in flight."""
        return self.feed.in_flight if self.feed is not None else 0

    def _skips(self) -> list[int]:
        return skipped_by_rank(self.skipped, self.rank, self.world, self.device)


def stream_state_after(stream: BatchStream, behind: int, skipped: Optional[list[int]] = None) -> dict:
    """The stream's position `behind` batches back (those read but not trained on), less this rank's
    skips, with every rank's cumulative skips (`skipped`: each rank reads its own shard, so the
    saved position counts only the batches trained on, the same on every rank), which `skip_resumed`
    steps over on resume."""
    s = stream.state()
    behind += int(skipped[stream.rank]) if skipped else 0
    pos, epoch, step = s["position"] - behind, s["epoch"], s["step"] - behind
    while pos < 0:
        epoch -= 1
        pos += stream.steps_per_epoch
    out = dict(s, position=pos, epoch=epoch, step=step)
    if skipped and any(skipped):
        out["skipped"] = [int(n) for n in skipped]
    return out


def skip_resumed(stream: BatchStream, state: Optional[dict]) -> int:
    """Step a restored stream past the batches this rank had skipped (a `stream_state_after` state's
    `skipped`); returns that count, where this rank's cumulative `skipped_batches` continues
    from."""
    skipped = (state or {}).get("skipped") or []
    n = int(skipped[stream.rank]) if stream.rank < len(skipped) else 0
    stream.position += n
    stream.step += n
    while stream.position > stream.steps_per_epoch:  # position == steps_per_epoch: next() starts the next epoch
        stream.epoch += 1
        stream.position -= stream.steps_per_epoch
    return n


def _single(world: int) -> bool:
    """Whether there is no other rank to gather from: one rank (several without a process group is a fault)."""
    if world == 1:
        return True
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{world} ranks but no torch.distributed process group to gather their data state")
    return False


def skipped_by_rank(own: int, rank: int, world: int, device) -> list[int]:
    """Every rank's cumulative skipped-batch count (one all-reduce; every rank calls it at save steps)."""
    if _single(world):
        return [int(own)]
    counts = torch.zeros(world, dtype=torch.float64, device=device)
    counts[rank] = own
    dist.all_reduce(counts)
    return [int(round(c)) for c in counts.tolist()]


def gathered(obj, world: int) -> list:
    """[rank] -> `obj` of every rank (all_gather_object; every rank calls it), [obj] alone."""
    if _single(world):
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out
