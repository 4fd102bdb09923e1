"""On-policy distillation's side of the feed: batches whose completions are sampled before the teachers score them.

`onpolicy_items` wraps the stream's items (`actors.feed.feed_items`): a share `onpolicy.fraction` of the batches
(GKD's lambda, drawn per batch key, so DDP ranks, a resumed run and a re-run draw the same) go through a `Sampler`,
which samples each row's completion -- the student with its current weights on this worker, or a teacher actor
(`source: teacher`, sequence-level KD) -- and returns the sampled batch (`data.onpolicy.sampled_batch`) under a key
made of its content (replicas and Tune trials that sampled the same sequences share one teacher forward). The
KVFeed then asks every teacher for it like any other batch. When the sampling happens relative to training is the
feed's depth (it takes batches only when a step asks for one): `onpolicy.lag` 1 samples batch n + 1 as step n asks
for batch n (the teachers score n meanwhile, and n + 1 while the student trains on n), 0 samples batch n then
(docs/training.md#on-policy).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import ray

from actors.feed import feed_items, request_arrays
from kava_ray.common.config import JobConfig
from kava_ray.common.errors import KavaError
from kava_ray.core.plans import check_writer, onpolicy_writer
from kava_ray.core.sampling import sample
from kava_ray.data import Batch, BatchStream
from kava_ray.data.onpolicy import prompts_of, sampled_batch


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
    """Samples the completions of one batch of records: `sampler(batch, rows, key)` -> the sampled `Batch`.

    model: the student (sampled on this worker; `source: student`), or None with `teacher` a function
    (prompts, max_new_tokens, temperature, top_p, seed) -> completions (`teacher_writer`: a teacher of the student's
    tokenizer). Counts `seconds` and `tokens` sampled."""

    def __init__(self, cfg: JobConfig, split, tokenizer, teacher_tokenizers: dict, model=None, teacher=None,
                 rank: int = 0, autocast=None, flag: Optional[Path] = None):
        self.cfg, self.split, self.tok, self.teacher_toks = cfg, split, tokenizer, teacher_tokenizers
        self.model, self.teacher, self.rank, self.autocast = model, teacher, rank, autocast
        self.flag = flag  # a file that exists while this sampler samples (the driver's progress bar reads it)
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
        prompts = prompts_of(batch)
        seed = sample_seed(self.cfg.train.seed, key, self.rank)
        eos = [self.tok.eos_token_id]
        # nothing past train.max_length is kept (`sampled_batch` cuts there): no token is sampled past it either
        new = max(1, min(o.max_new_tokens, self.cfg.train.max_length - min(len(p) for p in prompts)))
        if self.model is not None:
            s = sample(self.model, prompts, new, o.temperature, o.top_p, eos_ids=eos,
                       pad_id=self.split.pad_id, seed=seed, autocast=self.autocast)
            ids, logps, source = s.ids, s.logp, "student"
        else:
            ids = self.teacher(prompts, new, o.temperature, o.top_p, seed)
            logps, source = None, "teacher"
        out = sampled_batch(batch, rows, self.split, ids, logps, self.tok, self.teacher_toks,
                            self.cfg.train.max_length, self.cfg.data.prompt_format, source)
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(r) for r in ids)
        return out


def onpolicy_items(stream: BatchStream, sampler: Callable, fraction: float, seed: int,
                   steps: Optional[int] = None) -> Iterator[tuple]:
    """`feed_items(stream)` with a share `fraction` of the batches sampled (`sampler(batch, rows, key)`): those come
    out under a content key and without example indices (no KV cache holds them)."""
    for key, ids, mask, (_, step, epoch, batch), (fp, rows) in feed_items(stream, steps):
        if fraction <= 0 or _unit("onpolicy", seed, key) >= fraction:
            yield key, ids, mask, (key, step, epoch, batch), (fp, rows)
            continue
        sb = sampler(batch, list(rows), key)
        skey = content_key(sb)
        s_ids, s_mask = request_arrays(sb)
        yield skey, s_ids, s_mask, (skey, step, epoch, sb)


def teacher_writer(cfg: JobConfig, plans: dict, source) -> Callable:
    """For `onpolicy.source: teacher`: the function that has the teacher (`onpolicy.teacher`, else the first) write
    completions -- its actor's `generate` (a live source), or the source's own `generate` (in process). The teacher
    must share the student's tokenizer (its ids are the student's)."""
    name = onpolicy_writer(cfg)
    check_writer(cfg, not plans[name].aligned)  # (the driver's preflight refused it already where it could tell)
    if hasattr(source, "generate"):
        return lambda *args: source.generate(name, *args)
    handles = getattr(source, "handles", None)
    if handles is None:
        raise KavaError("onpolicy.source: teacher needs live teachers (a KV cache cannot write completions)")
    h = handles[name].route("") if hasattr(handles[name], "route") else handles[name]
    return lambda *args: ray.get(h.generate.remote(*args))
