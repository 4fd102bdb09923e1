"""KVFeed: the student-side prefetcher that keeps teacher work ahead of the student.

Inside a train worker, the feed keeps `depth` batches in flight to every teacher at once and hands
back batch i's KV from all teachers, in order, as KVBatches on the worker's device; the time the
student waited is `teacher_wait_s` (near 0: teacher work is hidden). Answers come from a `KVSource`:
live actors (`ActorSource`) or the on-disk cache (`actors.kv_cache.CacheSource`). A batch with
NaN/Inf K or V is skipped or stops the run (`on_bad_kv`): docs/internals/step.md#feed.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Protocol

import numpy as np
import ray
import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.kv import KVBatch
from kava_ray.data import Batch, BatchStream

log = logging.getLogger(__name__)

# A teacher that died: the call fails, or (its answer being a ref to a payload the teacher owned) the payload is lost.
RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.ObjectLostError)


def get_kv(answer):
    """A teacher's answer to `kv()` (or a list of them) as the wire payload: a production teacher
    answers with a ref to the payload in its node's object store (`actors.teacher`), a stand-in may
    answer with the payload."""
    if isinstance(answer, list):
        return [get_kv(a) for a in answer]
    out = ray.get(answer) if isinstance(answer, ray.ObjectRef) else answer
    return ray.get(out) if isinstance(out, ray.ObjectRef) else out


def _pull_here(answer) -> None:
    """Start moving an answer's payload to this node now, in the background (`ObjectRef.future()`
    asks the local raylet to fetch the object, as `ray.get` would, without blocking): the student
    keeps training while a teacher's batch crosses nodes, and `ray.get` later finds it local.
    Chained: the answer, then its payload."""
    def then(done) -> None:
        try:
            inner = done.result()
        except Exception:  # noqa: BLE001 - a failed call: `result` retries or raises it
            return
        if isinstance(inner, ray.ObjectRef):
            inner.future()

    answer.future().add_done_callback(then)


class KVRequest(NamedTuple):
    """What a KV source is asked for one batch of one teacher (`KVFeed` builds it; every source reads it).

    key: the batch key the teacher's LRU de-duplicates by; input_ids / attention_mask [B, T] this
    teacher's own tokens; layers: the teacher layers to ship; logits_top_k: top-k log-probs too (0:
    none); examples: (split fingerprint, example indices of the batch's rows), what an
    example-indexed KV cache assembles the batch from (None when the items name no split).
    """

    key: Optional[str]
    input_ids: np.ndarray
    attention_mask: np.ndarray
    layers: Optional[list[int]]
    wire_dtype: str
    logits_top_k: int = 0
    examples: Optional[tuple[str, tuple[int, ...]]] = None
    hidden: bool = False  # the layers' output hidden states too (loss.hidden_weight)
    token_logprobs: bool = False  # each next token's log-prob too (on-policy distillation's sampled reverse KL)


class KVSource(Protocol):
    """Where a KVFeed's teacher answers come from: `ActorSource` (live actors),
    `actors.kv_cache.CacheSource` (the on-disk cache),
    `kava_ray.testing.inprocess_source.InProcessSource` (teachers in this process). `submit` starts
    one teacher's work on a request and returns a future (anything); `result` turns it into the wire
    payload."""

    def submit(self, name: str, request: KVRequest) -> Any: ...

    def result(self, name: str, request: KVRequest, future: Any) -> dict: ...


class ActorSource:
    """Live teacher actors: `submit` sends the request and returns an ObjectRef; `result` waits for it.

    handles: {teacher: actor handle or `TeacherReplicas`} (a batch goes to the replica its key routes to). A call
    Ray gives up on, or a payload lost with its teacher, is submitted again up to `max_retries` times. prefetch:
    each answer starts moving to this node as soon as it exists (`_pull_here`), off the student's critical path.
    unplaceable(teacher) -> a line or None (`actors.pool.unplaceable`): raised as a KavaError once a late
    answer's teacher has been unplaceable for `lost_wait_s`, instead of waiting forever.
    """

    def __init__(self, handles: dict, max_retries: int = 5, retry_wait_s: float = 1.0, prefetch: bool = True,
                 unplaceable: Optional[Callable[[str], Optional[str]]] = None, lost_wait_s: float = 300.0,
                 poll_s: float = 5.0):
        self.handles = handles
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s
        self.prefetch = prefetch
        self.unplaceable = unplaceable
        self.lost_wait_s = lost_wait_s
        self.poll_s = min(poll_s, lost_wait_s)
        self.resubmits = 0

    def submit(self, name: str, request: KVRequest) -> Any:
        r = request
        h = self.handles[name]
        h = h.route(r.key) if hasattr(h, "route") else h
        extra = {"hidden": True} if r.hidden else {}  # (a pool of an older version takes no `hidden`)
        if r.token_logprobs:
            extra["token_logprobs"] = True
        ref = h.kv.remote(r.key, r.input_ids, r.attention_mask, r.layers, r.wire_dtype, r.logits_top_k, **extra)
        if self.prefetch:
            _pull_here(ref)
        return ref

    def _wait(self, name: str, ref) -> None:
        """Until the answer exists, or (`unplaceable`) the teacher has been unplaceable for `lost_wait_s`."""
        if self.unplaceable is None:
            return
        lost_since = None
        while not ray.wait([ref], timeout=self.poll_s, fetch_local=False)[0]:
            why = self.unplaceable(name)
            lost_since = None if why is None else (lost_since or time.monotonic())
            if why is not None and time.monotonic() - lost_since >= self.lost_wait_s:
                raise KavaError(why)

    def result(self, name: str, request: KVRequest, ref) -> dict:
        for attempt in range(self.max_retries + 1):
            try:
                self._wait(name, ref)
                return get_kv(ref)
            except RETRYABLE:
                if attempt == self.max_retries:
                    raise
                self.resubmits += 1
                time.sleep(self.retry_wait_s)  # give the actor time to come back
                ref = self.submit(name, request)
        raise AssertionError("unreachable")


class BadKV(KavaError):
    """A teacher's K or V holds NaN/Inf (`on_bad_kv="stop"`); `teacher`, `key` name the batch."""

    def __init__(self, teacher: str, key, what: str):
        self.teacher, self.key = teacher, key
        super().__init__(f"teacher '{teacher}' sent non-finite {what} (NaN/Inf) for batch {key}")


class KVFeed:
    """Iterate `(item, {teacher: KVBatch})` in the order of `items`, `depth` batches ahead.

    items: iterable of `(key, input_ids [B, T], attention_mask [B, T], item[, examples])`; `item` is
    passed through untouched (the student's own batch); `examples` (split fingerprint, row indices)
    goes into the request for an example-indexed KV cache (`feed_items` adds it). input_ids /
    attention_mask may instead be dicts {teacher: array}, with the key None for every teacher not
    named: a teacher of another tokenizer gets its own tokenization of the batch (`feed_items`
    builds these). layers: {teacher: layer ids to ship}. logits_top_k > 0 (an int for every teacher,
    or {teacher: k}): the teacher also serves its top-k log-probs from the same forward
    (KVBatch.topk_ids / topk_logp). hidden: the layers' output hidden states too (KVBatch.hidden).
    token_logprobs: the teachers that also serve each next token's log-prob. read_ahead False: a
    batch is taken from `items` only when it is asked for (on-policy lag 0: sampled with the current
    weights).

    Every source receives a `KVRequest` per teacher and batch.

    on_bad_kv: None (no check), "skip" (a batch with non-finite K/V from any teacher is dropped and
    the next one delivered; `skipped` counts them) or "stop" (raise `BadKV`). One `isfinite().all()`
    per decoded tensor and one sync per batch. limit: deliver at most `limit` batches and never read
    ahead past them (each skipped batch extends the read by one), so `items` may be endless.
    """

    def __init__(self, source: KVSource, items: Iterable[tuple], layers: dict[str, Optional[list[int]]], depth: int = 2,
                 wire_dtype: str = "bf16", device="cpu", dtype: torch.dtype = torch.float32, decode: bool = True,
                 logits_top_k: int = 0, on_bad_kv: Optional[str] = None, limit: Optional[int] = None,
                 hidden: bool = False, token_logprobs: Iterable[str] = (), read_ahead: bool = True):
        if depth < 1:
            raise ValueError("depth must be >= 1")
        if on_bad_kv not in (None, "skip", "stop"):
            raise ValueError(f"on_bad_kv must be None, 'skip' or 'stop', not {on_bad_kv!r}")
        self.source = source
        self.items: Iterator[tuple] = iter(items)
        self.layers = layers
        self.depth = depth
        self.wire_dtype = wire_dtype
        self.logits_top_k = logits_top_k if isinstance(logits_top_k, dict) else {n: int(logits_top_k) for n in layers}
        self.device = device
        self.dtype = dtype
        self.hidden = bool(hidden)
        self.token_logprobs = set(token_logprobs)  # teachers that also serve each next token's log-prob
        self.read_ahead = read_ahead  # False: a batch is taken from `items` only when it is asked for
        self.decode = decode  # False: hand back the wire payloads as they arrived (precompute writes them)
        self._inflight: collections.deque = collections.deque()
        self.wait_s: list[float] = []  # per delivered batch
        self._exhausted = False
        self.on_bad_kv = on_bad_kv
        self.limit = limit
        self.skipped = 0  # batches dropped for non-finite K/V (on_bad_kv="skip")
        self._taken = 0  # batches taken from `items`

    def _fill(self) -> None:
        while (not self._exhausted and len(self._inflight) < self.depth
               and (self.limit is None or self._taken < self.limit + self.skipped)):
            try:
                key, ids, mask, item, *examples = next(self.items)
            except StopIteration:
                self._exhausted = True
                return
            reqs = {name: KVRequest(key, _for(ids, name), _for(mask, name), layers, self.wire_dtype,
                                    int(self.logits_top_k.get(name, 0)), examples[0] if examples else None,
                                    self.hidden, name in self.token_logprobs)
                    for name, layers in self.layers.items()}
            refs = {name: self.source.submit(name, req) for name, req in reqs.items()}
            self._inflight.append((item, reqs, refs))
            self._taken += 1

    def __iter__(self):
        return self

    def __next__(self) -> tuple[Any, dict[str, KVBatch]]:
        waited = 0.0
        while True:
            self._fill()
            if not self._inflight:
                raise StopIteration
            item, reqs, refs = self._inflight.popleft()
            t0 = time.perf_counter()
            payloads = {name: self.source.result(name, reqs[name], refs[name]) for name in refs}
            waited += time.perf_counter() - t0
            if self.read_ahead:
                self._fill()  # top the pipeline up before the student starts computing on this batch
            if not self.decode:
                self.wait_s.append(waited)
                return item, payloads
            kv = {name: KVBatch.from_wire(p, device=self.device, dtype=self.dtype) for name, p in payloads.items()}
            bad = self._bad(kv) if self.on_bad_kv else None
            if bad is None:
                self.wait_s.append(waited)
                return item, kv
            name, what = bad
            key = reqs[name].key
            if self.on_bad_kv == "stop":
                raise BadKV(name, key, what)
            self.skipped += 1
            log.warning("teacher '%s' sent non-finite %s (NaN/Inf) for batch %s: skipped (train.on_bad_kv=skip, "
                        "%d so far)", name, what, key, self.skipped)

    @staticmethod
    def _bad(kv: dict[str, KVBatch]) -> Optional[tuple[str, str]]:
        """(teacher, "K" | "V" | "hidden states") of the first non-finite tensor, else None; one
        device sync for the batch."""
        checks = [(name, what, torch.isfinite(t).all()) for name, b in kv.items()
                  for what, t in (("K", b.keys), ("V", b.values), ("hidden states", b.hidden)) if t is not None]
        ok = torch.stack([c for _, _, c in checks]).cpu()
        if bool(ok.all()):
            return None
        i = int((~ok).nonzero()[0])
        return checks[i][0], checks[i][1]

    def pending_items(self) -> list[tuple]:
        """The batches taken from `items` but not yet delivered, as items again ((key, input_ids,
        attention_mask, item, examples), arrays per teacher): what a checkpoint keeps for a resumed
        feed to replay (on-policy)."""
        out = []
        for item, reqs, _ in self._inflight:
            r = next(iter(reqs.values()))
            out.append((r.key, {n: q.input_ids for n, q in reqs.items()},
                        {n: q.attention_mask for n, q in reqs.items()}, item, r.examples))
        return out

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
        x = x[name] if name in x else x[None]
    return np.ascontiguousarray(x)


def request_arrays(batch: Batch) -> tuple:
    """(input_ids, attention_mask) of a batch as the teachers get them: the student's arrays, or,
    when a teacher of another tokenizer has its own (`batch.teachers`), {teacher: array, None: the
    student's}."""
    ids, mask = batch.input_ids.numpy(), batch.attention_mask.numpy()
    if batch.teachers:
        ids = {None: ids, **{t: v.input_ids.numpy() for t, v in batch.teachers.items()}}
        mask = {None: mask, **{t: v.attention_mask.numpy() for t, v in batch.teachers.items()}}
    return ids, mask


def feed_items(stream: BatchStream, steps: Optional[int] = None) -> Iterator[tuple]:
    """(key, input_ids, attention_mask, (key, step, epoch, batch), examples) for KVFeed, `steps`
    batches or forever; arrays as `request_arrays`, examples = (the split's fingerprint, the batch's
    example indices)."""
    n = 0
    while steps is None or n < steps:
        key, step, epoch, batch, idx = stream.next_indexed()
        ids, mask = request_arrays(batch)
        yield key, ids, mask, (key, step, epoch, batch), (stream.split.fingerprint, tuple(idx))
        n += 1
