"""TeacherActor: one teacher model in one Ray actor, serving KV batches in the wire format.

The actor runs one request at a time (Ray's default for a sync actor), so two consumers asking
for the same batch key — DDP ranks, Tune trials — are served in turn and the second one hits the
LRU: one forward per batch, however many students consume it.

`kv()` answers with an ObjectRef of the payload, put once into the teacher node's object store: the
LRU holds these refs, so a hit hands out the same object (no second copy into the store), and a
consumer on another node pulls it straight from there (`rollout.feed.ActorSource` starts that pull
as soon as the ref exists).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import numpy as np
import ray
import torch

from kava_ray.common.config import TeacherConfig
from kava_ray.common.errors import KavaError
from kava_ray.common.files import content_key, first_line
from kava_ray.common.fingerprints import tokenizer_fingerprint
from kava_ray.core.kv import teacher_forward_kv, wire_logits_nbytes, wire_nbytes
from kava_ray.core.models import PYPI_SCHEME, kv_geometry, load_model, load_tokenizer, resolve_packaged_file


def teacher_device_map(num_gpus: float) -> tuple[Optional[object], str]:
    """(device_map for from_pretrained, device label) for a teacher's GPU share. Ray sets
    CUDA_VISIBLE_DEVICES for the actor, so its GPUs are cuda:0..n-1; more than one are spread across
    by accelerate (`device_map="auto"`)."""
    if num_gpus > 0 and torch.cuda.is_available():
        if num_gpus > 1:
            return "auto", f"cuda x{torch.cuda.device_count()}"
        return {"": 0}, "cuda:0"
    return None, "cpu"


def weights_fingerprint(spec: str) -> Optional[str]:
    """A fingerprint of a local model's content (each weights and config file's name and
    `content_key`: size, first and last MiB), or None for a hub id. Where or when the files were
    written does not count: two copies of the same weights (on two nodes, in two places) match;
    weights rewritten with other values do not."""
    path = resolve_packaged_file(spec) if spec.startswith(PYPI_SCHEME) else Path(spec).expanduser()
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(
        f for f in path.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin", ".gguf", ".json"))
    h = hashlib.sha1()
    for f in files:
        h.update(f"{f.name}:".encode())
        content_key(f, h)
    return h.hexdigest()[:16]


class TeacherActor:
    """Loads one teacher and serves `kv(key, input_ids, attention_mask, layers, wire_dtype, logits_top_k)`.

    A load failure does not crash the actor: it is kept and reported by `ping()`, so the pool can
    turn it into one clear line instead of a remote traceback.
    """

    def __init__(self, teacher: dict, key_space: str = "pre_rope", cache_size: int = 64):
        self.cfg = TeacherConfig(**teacher)
        self.key_space = key_space
        self.cache_size = cache_size
        self._lru: OrderedDict = OrderedDict()
        self.counters = dict(requests=0, forwards=0, hits=0, forward_s=0.0, bytes_served=0, logit_bytes_served=0,
                             tokens=0)
        self.error: Optional[str] = None
        self.started = time.time()
        in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None  # (else a driver's)
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed) if in_actor else False
        torch.set_num_threads(max(1, int(self.cfg.num_cpus)))
        device_map, self.device = teacher_device_map(self.cfg.num_gpus)
        self.weights: Optional[str] = None
        try:
            self.weights = weights_fingerprint(self.cfg.model) if self.cfg.engine != "openai" else None
            self._load(device_map)
            self.tokenizer = load_tokenizer(self.cfg.served_from())
            self._check()
        except KavaError as e:
            self.error = str(e)
        except Exception as e:  # noqa: BLE001 - anything at load time is reported as one line by the pool
            self.error = f"model '{self.cfg.model}': {first_line(e, with_type=True)}"

    def _load(self, device_map) -> None:
        """Load the model this actor serves from (`self.model`) and its geometry (`self.geom`)."""
        self.model = load_model(self.cfg.model, dtype=self.cfg.dtype, quantization=self.cfg.quantization,
                                device_map=device_map)
        self.geom = kv_geometry(self.model)

    def _check(self) -> None:
        """After the load: what the engine must confirm before the first batch (a server: `url_teacher`)."""

    def _served(self) -> dict:
        """What the model serves from, for `geometry()`: its revision and the dtype it computes in."""
        return dict(revision=getattr(self.model.config, "_commit_hash", None),
                    dtype=str(next(self.model.parameters()).dtype).replace("torch.", ""))

    def ping(self) -> Optional[str]:
        """None when the teacher is loaded, else the one-line load error."""
        return self.error

    def weights_now(self) -> dict:
        """What this teacher loaded and what its model path holds now, read on this teacher's node
        (where the path is read: the driver's node may hold another copy, or none): {loaded, now,
        node (its address), node_id}."""
        up = ray.is_initialized()
        now = weights_fingerprint(self.cfg.model) if self.cfg.engine != "openai" else None
        return {"loaded": self.weights, "now": now,
                "node": ray.util.get_node_ip_address() if up else None,
                "node_id": ray.get_runtime_context().get_node_id() if up else None}

    def geometry(self) -> dict:
        """Layers / kv heads / head_dim, and the teacher's identity (what it was started with:
        model, weights fingerprint, revision, quantization, dtype, key space), so a driver can
        refuse a pool started for another config; no weights travel."""
        return dict(
            self.geom.to_dict(),
            name=self.cfg.name,
            model=self.cfg.model,
            weights=self.weights,
            quantization=self.cfg.quantization,
            requested_dtype=self.cfg.dtype,
            engine=self.cfg.engine,
            key_space=self.key_space,
            layers=self.cfg.layers,
            device=self.device,
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer),
            pid=os.getpid(),
            **self._served(),
        )

    def kv(self, key: Optional[str], input_ids: np.ndarray, attention_mask: np.ndarray,
           layers: Optional[list[int]] = None, wire_dtype: str = "bf16", logits_top_k: int = 0,
           hidden: bool = False, token_logprobs: bool = False) -> ray.ObjectRef:
        """An ObjectRef of the wire KV of `layers` for one batch (input_ids, attention_mask: [B, T]
        int arrays); `kava_ray.rollout.feed.get_kv` turns the call's result into the payload.

        `key` names the batch (dataset fingerprint, epoch, index); None disables the LRU.
        logits_top_k > 0: the payload also carries the top-k log-probs of the same forward
        (`KVBatch.to_wire`); k is part of the LRU key, so consumers asking for the same batch with
        the same k share one forward (k = 0 keeps the key it always had). hidden: the layers' output
        hidden states too; token_logprobs: each next token's log-prob too (on-policy distillation);
        both part of the LRU key. `bytes_served` counts KV and logits, `logit_bytes_served` the
        logits alone.
        """
        self.counters["requests"] += 1
        logits_top_k = int(logits_top_k or 0)
        cache_key = None if key is None else (key, tuple(layers) if layers is not None else None, wire_dtype)
        if cache_key is not None and logits_top_k:
            cache_key = cache_key + (logits_top_k,)
        if cache_key is not None and hidden:
            cache_key = cache_key + ("hidden",)
        if cache_key is not None and token_logprobs:
            cache_key = cache_key + ("token_logprobs",)
        if cache_key is not None and cache_key in self._lru:
            self._lru.move_to_end(cache_key)
            self.counters["hits"] += 1
            ref, nbytes, logit_nbytes = self._lru[cache_key]
        else:
            t0 = time.perf_counter()
            ids = torch.tensor(np.asarray(input_ids), dtype=torch.long)  # [B, T]; a copy: inputs are read-only
            mask = torch.tensor(np.asarray(attention_mask), dtype=torch.long)  # [B, T]
            batch = self._forward(ids, mask, layers, logits_top_k, bool(hidden), bool(token_logprobs))
            payload = batch.to_wire(wire_dtype)
            ref, nbytes, logit_nbytes = ray.put(payload), wire_nbytes(payload), wire_logits_nbytes(payload)
            self.counters["forward_s"] += time.perf_counter() - t0
            self.counters["forwards"] += 1
            self.counters["tokens"] += int(mask.sum())
            if cache_key is not None:
                self._lru[cache_key] = ref, nbytes, logit_nbytes
                while len(self._lru) > self.cache_size:
                    self._lru.popitem(last=False)  # the store frees it once no consumer holds it either
        self.counters["bytes_served"] += nbytes
        self.counters["logit_bytes_served"] += logit_nbytes
        return ref

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, layers: Optional[list[int]], logits_top_k: int,
                 hidden: bool, token_logprobs: bool):
        """The KVBatch of one batch (ids, mask [B, T]): `teacher_forward_kv`."""
        return teacher_forward_kv(self.model, ids, mask, layers=layers, key_space=self.key_space,
                                  logits_top_k=logits_top_k, hidden=hidden, token_logprobs=token_logprobs)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[int]]:
        """Sampled completions of `prompts` (token ids of its tokenizer): on-policy distillation's
        `source: teacher` (sequence-level KD), seeded like the student's
        (`core.sampling.sample`)."""
        from kava_ray.core.sampling import sample

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        s = sample(self.model, prompts, max_new_tokens, temperature, top_p, eos_ids=[self.tokenizer.eos_token_id],
                   pad_id=pad or 0, seed=seed)
        self.counters["generated"] = self.counters.get("generated", 0) + s.tokens
        return s.ids

    def stats(self) -> dict:
        c = dict(self.counters)
        c["mean_forward_ms"] = 1000 * c["forward_s"] / c["forwards"] if c["forwards"] else 0.0
        c["restarted"] = self.restarted
        c["uptime_s"] = time.time() - self.started
        return c
