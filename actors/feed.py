"""KVFeed: the student-side prefetcher that keeps teacher work ahead of the student.

Inside a train worker, the feed keeps `depth` batches in flight to every teacher at once and
hands back batch i's KV from all teachers, in order, as KVBatches on the worker's device. The
time the student blocked waiting for teachers is recorded per step (`teacher_wait_s`): near 0
means teacher work is hidden behind the student's step.

Teacher answers come from a `KVSource`: live actors (`ActorSource`) or the on-disk cache written by
`kava-ray teachers precompute` (`actors.kv_cache.CacheSource`).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import ray
import torch

from kava_ray.data import BatchStream
from kava_ray.kv import KVBatch

RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class ActorSource:
    """Live teacher actors: `submit` sends the request and returns an ObjectRef; `result` waits for it.

    A teacher that dies mid-request restarts (max_restarts) and Ray retries the call
    (max_task_retries); if Ray gives up on the call, it is submitted again, up to `max_retries` times.
    """

    def __init__(self, handles: dict, max_retries: int = 5, retry_wait_s: float = 1.0):
        self.handles = handles
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s
        self.resubmits = 0

    def submit(self, name: str, request: tuple) -> Any:
        key, ids, mask, layers, wire_dtype, logits_top_k = request
        return self.handles[name].kv.remote(key, ids, mask, layers, wire_dtype, logits_top_k)

    def result(self, name: str, request: tuple, ref) -> dict:
        for attempt in range(self.max_retries + 1):
            try:
                return ray.get(ref)
            except RETRYABLE:
                if attempt == self.max_retries:
                    raise
                self.resubmits += 1
                time.sleep(self.retry_wait_s)  # give the actor time to come back
                ref = self.submit(name, request)
        raise AssertionError("unreachable")


class KVFeed:
    """Iterate `(item, {teacher: KVBatch})` in the order of `items`, `depth` batches ahead.

    items: iterable of `(key, input_ids [B, T], attention_mask [B, T], item)`; `item` is passed
    through untouched (the student's own batch). input_ids / attention_mask may instead be dicts
    {teacher: array}, with the key None for every teacher not named: a teacher of another tokenizer gets
    its own tokenization of the batch (`feed_items` builds these). layers: {teacher: layer ids to ship}.
    logits_top_k > 0 (an int for every teacher, or {teacher: k}): the teacher also serves its top-k
    log-probs from the same forward (KVBatch.topk_ids / topk_logp).

    A request, as every source receives it: (key, input_ids, attention_mask, layers, wire_dtype, logits_top_k).
    """

    def __init__(self, source, items: Iterable[tuple], layers: dict[str, Optional[list[int]]], depth: int = 2,
                 wire_dtype: str = "bf16", device="cpu", dtype: torch.dtype = torch.float32, decode: bool = True,
                 logits_top_k: int = 0):
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.source = source
        self.items: Iterator[tuple] = iter(items)
        self.layers = layers
        self.depth = depth
        self.wire_dtype = wire_dtype
        self.logits_top_k = logits_top_k if isinstance(logits_top_k, dict) else {n: int(logits_top_k) for n in layers}
        self.device = device
        self.dtype = dtype
        self.decode = decode  # False: hand back the wire payloads as they arrived (precompute writes them)
        self._inflight: collections.deque = collections.deque()
        self.wait_s: list[float] = []  # per delivered batch
        self._exhausted = False

    def _fill(self) -> None:
        while not self._exhausted and len(self._inflight) < self.depth:
            try:
                key, ids, mask, item = next(self.items)
            except StopIteration:
                self._exhausted = True
                return
            reqs = {name: (key, _for(ids, name), _for(mask, name), layers, self.wire_dtype,
                           int(self.logits_top_k.get(name, 0)))
                    for name, layers in self.layers.items()}
            refs = {name: self.source.submit(name, req) for name, req in reqs.items()}
            self._inflight.append((item, reqs, refs))

    def __iter__(self):
        return self

    def __next__(self) -> tuple[Any, dict[str, KVBatch]]:
        self._fill()
        if not self._inflight:
            raise StopIteration
        item, reqs, refs = self._inflight.popleft()
        t0 = time.perf_counter()
        payloads = {name: self.source.result(name, reqs[name], refs[name]) for name in refs}
        self.wait_s.append(time.perf_counter() - t0)
        self._fill()  # top the pipeline up before the student starts computing on this batch
        if not self.decode:
            return item, payloads
        return item, {name: KVBatch.from_wire(p, device=self.device, dtype=self.dtype) for name, p in payloads.items()}

    @property
    def in_flight(self) -> int:
        """Batches taken from `items` but not yet delivered."""
        return len(self._inflight)

    @property
    def last_wait_s(self) -> float:
        return self.wait_s[-1] if self.wait_s else 0.0


def _for(x, name: str) -> np.ndarray:
    """A teacher's input array: its own entry of a per-teacher dict (default: the None entry), or `x`."""
    if isinstance(x, dict):
        x = x.get(name, x[None])
    return np.ascontiguousarray(x)


def feed_items(stream: BatchStream, steps: Optional[int] = None) -> Iterator[tuple]:
    """(key, input_ids, attention_mask, (key, step, epoch, batch)) for KVFeed, `steps` batches or forever.

    A teacher of another tokenizer (the batch carries `teacher_input_ids/<teacher>`) gets its own ids and
    mask: input_ids / attention_mask are then {teacher: array, None: the student's}."""
    n = 0
    while steps is None or n < steps:
        key, step, epoch, batch = item = stream.next()
        ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
        own = [k.split("/", 1)[1] for k in batch if k.startswith("teacher_input_ids/")]
        if own:
            ids = {None: ids, **{t: batch[f"teacher_input_ids/{t}"].numpy() for t in own}}
            mask = {None: mask, **{t: batch[f"teacher_attention_mask/{t}"].numpy() for t in own}}
        yield key, ids, mask, item
        n += 1
