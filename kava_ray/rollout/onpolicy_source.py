"""On-policy distillation's step source: a share of the batches completed by the student (or a
teacher) before the teachers score them.

`OnPolicyStepSource` is the `kava_ray.rollout.step_source.StepSource` whose items go through a
`Sampler` for a share `onpolicy.fraction` of the batches (GKD's lambda, drawn per batch key, so DDP
ranks, a resumed run and a re-run draw the same): it samples each row's completion with a
`rollout.engines.CompletionEngine` and returns the sampled batch (`data.completions.sampled_batch`)
under a key made of its content (replicas and Tune trials that sampled the same sequences share one
teacher forward); the KVFeed then asks every teacher for it like any other batch. When the sampling
happens relative to training is the feed's depth, batches taken only as a step asks for one:
`onpolicy.lag` 1 samples batch n + 1 as step n asks for batch n (the teachers score n meanwhile, and
n + 1 while the student trains on n), 0 samples batch n then. A checkpoint keeps the batches in
flight (sampled with the weights of their time), and a resumed run trains on them first: the same
curve (docs/training.md#on-policy).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from kava_ray.common.config import JobConfig
from kava_ray.core.metric_names import SAMPLE_S
from kava_ray.data import Batch, BatchStream, TokenizedSplit
from kava_ray.data.completions import prompts_of, sampled_batch
from kava_ray.rollout.engines import CompletionEngine
from kava_ray.rollout.feed import feed_items, request_arrays
from kava_ray.rollout.step_source import StepSource, gathered


def _unit(*parts) -> float:
    """A number in [0, 1) from `parts` (sha256): the same on every rank, run and resume."""
    h = hashlib.sha256("\x00".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


def sample_seed(seed: int, key: str, rank: int) -> int:
    """The sampling seed of one batch: the run's seed, the batch's key and the rank (each its own samples)."""
    return int(_unit("sample", seed, key, rank) * 2 ** 31)


def content_key(batch: Batch) -> str:
    """A sampled batch's key for the teachers' LRU: a hash of its token ids and mask."""
    h = hashlib.sha1(np.ascontiguousarray(batch.input_ids.numpy()).tobytes())
    h.update(np.ascontiguousarray(batch.attention_mask.numpy()).tobytes())
    return f"sampled/{h.hexdigest()[:20]}"


class Sampler:
    """Completes one batch of records: `sampler(batch, rows, key)` -> the sampled `Batch` (each row's prompt and the
    engine's completion, cut at train.max_length). Counts `seconds` and `tokens` sampled; `flag`: a file that exists
    while it samples (the driver's progress bar reads it)."""

    def __init__(self, cfg: JobConfig, split: TokenizedSplit, tokenizer, teacher_tokenizers: dict,
                 engine: CompletionEngine, rank: int = 0, flag: Optional[Path] = None):
        self.cfg, self.split, self.tok, self.teacher_toks = cfg, split, tokenizer, teacher_tokenizers
        self.engine, self.rank, self.flag = engine, rank, flag
        self.seconds, self.tokens = 0.0, 0

    def __call__(self, batch: Batch, rows, key: str) -> Batch:
        if self.flag is None:
            return self._sample(batch, rows, key)
        try:
            self.flag.touch()
            return self._sample(batch, rows, key)
        finally:
            self.flag.unlink(missing_ok=True)

    def _sample(self, batch: Batch, rows, key: str) -> Batch:
        o, t0 = self.cfg.onpolicy, time.perf_counter()
        if o.samples_per_prompt > 1:  # each prompt k times: k completions of it, one `group`
            batch, rows = batch.repeated(o.samples_per_prompt), [r for r in rows for _ in range(o.samples_per_prompt)]
        prompts = prompts_of(batch)
        # nothing past train.max_length is kept (`sampled_batch` cuts there): no token is sampled past it either
        new = max(1, min(o.max_new_tokens, self.cfg.train.max_length - min(len(p) for p in prompts)))
        s = self.engine.complete(prompts, new, o.temperature, o.top_p, sample_seed(self.cfg.train.seed, key, self.rank))
        out = sampled_batch(batch, rows, self.split, s.ids, s.logp, self.tok, self.teacher_toks,
                            self.cfg.train.max_length, self.cfg.data.prompt_format, self.engine.writer)
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(r) for r in s.ids)
        return out


def onpolicy_items(stream: BatchStream, sampler: Callable, fraction: float, seed: int,
                   steps: Optional[int] = None, by_step: bool = False) -> Iterator[tuple]:
    """`feed_items(stream)` with a share `fraction` of the batches sampled (`sampler(batch, rows,
    key)`): those come out under a content key and without example indices (no KV cache holds
    them). Drawn by the batch's key (its examples: the same on a resume and a re-run), or with
    `by_step` by the stream's step (the same on every rank, whose batches differ: an FSDP2
    student's sampler gathers its shards, collectively)."""
    for key, ids, mask, (_, step, epoch, batch), (fp, rows) in feed_items(stream, steps):
        if fraction <= 0 or _unit("onpolicy", seed, *(("step", step) if by_step else (key,))) >= fraction:
            yield key, ids, mask, (key, step, epoch, batch), (fp, rows)
            continue
        sb = sampler(batch, list(rows), key)
        skey = content_key(sb)
        s_ids, s_mask = request_arrays(sb)
        yield skey, s_ids, s_mask, (skey, step, epoch, sb)


class OnPolicyStepSource(StepSource):
    """The `StepSource` of an on-policy run: `sampler` completes a share of its batches; the feed
    holds 1 + onpolicy.lag batches and takes one only when a step asks (lag 0: sampled with the
    current weights); the checkpoint keeps every rank's batches in flight."""

    read_ahead = False

    def __init__(self, cfg: JobConfig, plans: dict, split: TokenizedSplit, kv_source, sampler: Sampler, **kw):
        super().__init__(cfg, plans, split, kv_source, **kw)
        self.depth = 1 + cfg.onpolicy.lag
        self.sampler = sampler
        self.restored: list = []  # a resumed run's batches in flight: trained on first
        self.sampled_s = 0.0  # the sampler's seconds before the last step

    def items(self) -> Iterator[tuple]:
        o = self.cfg.onpolicy
        return itertools.chain(self.restored, onpolicy_items(self.stream, self.sampler, o.fraction, self.cfg.train.seed,
                                                             by_step=self.world > 1 and self.cfg.ray.sharded))

    def next_step(self, step: int):
        self.sampled_s = self.sampler.seconds
        yield from super().next_step(step)

    def step_metrics(self) -> dict[str, float]:
        return {**super().step_metrics(), SAMPLE_S: self.sampler.seconds - self.sampled_s}

    def state_dict(self) -> dict:
        """The stream after the batches in flight, and every rank's of them ([rank] -> feed items, sampled with the
        weights of their time, which a resumed run trains on first). Every rank calls it (collectives)."""
        mine = self.feed.pending_items() if self.feed is not None else list(self.restored)
        return {**super().state_dict(), "in_flight": gathered(mine, self.world)}  # (the all-reduce, then the gather)

    def close(self) -> None:
        """Shut the sampler's engine down where it holds one (vLLM's, colocated on this worker)."""
        close = getattr(self.sampler.engine, "close", None)
        if close is not None:
            close()

    def _read_again(self) -> int:
        return 0  # the batches in flight are kept in the checkpoint, not read again

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        kept = state.get("in_flight") or []
        self.restored = list(kept[self.rank]) if self.rank < len(kept) else []
