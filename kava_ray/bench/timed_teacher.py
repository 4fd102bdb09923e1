"""TimedTeacher: a stand-in for a teacher on a GPU of its own, for `kava-ray bench feed`.

On a 2-core CPU a real teacher takes cores from the student, so "a 72B teacher 4x slower than the
student" cannot be measured with real models here. A TimedTeacher answers the production request
(`kv(key, input_ids, attention_mask, layers, wire_dtype, logits_top_k)`) with KV of the real
teacher's geometry, shaped like the batch, in the real wire format, after a fixed delay per batch —
like a GPU busy for `delay_s` — and uses no CPU while it waits. Requests queue on the actor one at a
time, as on a real teacher. The payload still travels through Ray's object store like a real
teacher's (put into this node's store, the answer a ref to it), so transport is part of T.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import ray
import torch

from kava_ray.core.kv import KVBatch
from kava_ray.core.models import KVGeometry


@ray.remote(num_cpus=0)
class TimedTeacher:
    """Serves KV of `geometry` (`KVGeometry.to_dict()` plus the identity fields a plan reads) after `delay_s`."""

    def __init__(self, geometry: dict, delay_s: float, seed: int = 0):
        self.geom_dict = dict(geometry)
        self.geom = KVGeometry.from_dict(geometry)
        self.delay_s = float(delay_s)
        self.gen = torch.Generator().manual_seed(seed)
        self._kv: dict = {}  # (B, T, layers) -> (K, V) bf16, made once: the bench times waiting, not RNG
        self.counters = dict(requests=0, forwards=0, hits=0, forward_s=0.0, bytes_served=0)

    def ping(self) -> Optional[str]:
        return None

    def geometry(self) -> dict:
        return dict(self.geom_dict)

    def kv(self, key, input_ids: np.ndarray, attention_mask: np.ndarray, layers=None, wire_dtype: str = "bf16",
           logits_top_k: int = 0) -> ray.ObjectRef:
        t0 = time.perf_counter()
        B, T = np.asarray(input_ids).shape
        ids = list(range(self.geom.num_layers)) if layers is None else list(layers)
        shape = (len(ids), B, self.geom.num_kv_heads, T, self.geom.head_dim)
        if (B, T, tuple(ids)) not in self._kv:
            self._kv[(B, T, tuple(ids))] = tuple(torch.randn(shape, generator=self.gen).bfloat16() for _ in "kv")
        k, v = self._kv[(B, T, tuple(ids))]
        mask = torch.from_numpy(np.array(attention_mask, dtype=bool))  # a copy: Ray hands read-only arrays
        payload = ray.put(KVBatch(k, v, ids, mask, "pre_rope").to_wire(wire_dtype))
        time.sleep(max(0.0, self.delay_s - (time.perf_counter() - t0)))  # the GPU is busy for delay_s per batch
        self.counters["requests"] += 1
        self.counters["forwards"] += 1
        self.counters["forward_s"] += time.perf_counter() - t0
        self.counters["bytes_served"] += 2 * k.numel() * 2
        return payload

    def set_delay(self, delay_s: float) -> None:
        """Another regime on the same actor (no restart between the bench's regimes)."""
        self.delay_s = float(delay_s)

    def stats(self) -> dict:
        return dict(self.counters)
