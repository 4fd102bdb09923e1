"""Teacher KV on disk: `kava-ray teachers precompute` writes it, `data.kv_source: cache` reads it.

Layout of a cache dir:
  manifest.json                 meta (config hash, data fingerprint, wire dtype, key space, per-teacher
                                layers + geometry) and {batch key: {file, sha256, bytes}}
  tokenizers/<teacher>/         the tokenizer of a teacher whose tokenizer differs from the student's
                                (its positions are aligned by characters from the same text)
  shard-<hash of key>.safetensors  one batch: `<teacher>.k`, `<teacher>.v` (+ `.k_scale`, `.v_scale` for
                                fp8; + `.topk_ids`, `.topk_logp` when the job serves teacher logits) and
                                `mask`; the wire metadata in the safetensors header
The meta records `logits_top_k` when the cache holds top-k log-probs (absent: a cache without logits,
as every cache written before logits existed), so a job that needs logits refuses one without them.
Every shard is written to a temp file and renamed, and the manifest is rewritten atomically after
each shard, so an interrupted precompute resumes where it stopped. Reads verify the checksum.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from kava_ray._io import atomic_dir, atomic_write
from kava_ray.errors import KavaError

MANIFEST = "manifest.json"
TOKENIZERS = "tokenizers"
ARRAYS = ("k", "v", "k_scale", "v_scale", "topk_ids", "topk_logp")


def shard_file(key: str) -> str:
    return f"shard-{hashlib.sha1(key.encode()).hexdigest()[:20]}.safetensors"


def encode_shard(payloads: dict[str, dict]) -> bytes:
    """{teacher: wire payload} -> safetensors bytes (arrays as-is, wire metadata in the header)."""
    tensors, meta = {}, {}
    mask = None
    for name, p in payloads.items():
        for a in ARRAYS:
            if p.get(a) is not None:
                tensors[f"{name}.{a}"] = np.ascontiguousarray(p[a])
        meta[name] = {k: p[k] for k in ("version", "dtype", "shape", "layer_ids", "key_space", "topk_dtype") if k in p}
        mask = p.get("mask") if mask is None else mask
    if mask is not None:
        tensors["mask"] = np.ascontiguousarray(mask)
    return st_save(tensors, metadata={"kava": json.dumps(meta)})


def decode_shard(data: bytes, header_meta: dict) -> dict[str, dict]:
    arrays = st_load(data)
    out = {}
    for name, meta in header_meta.items():
        p = dict(meta, mask=arrays.get("mask"))
        for a in ARRAYS:
            if f"{name}.{a}" in arrays:
                p[a] = arrays[f"{name}.{a}"]
        out[name] = p
    return out


def _header_meta(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    return json.loads(header["__metadata__"]["kava"])


class KVCache:
    """A cache dir: `meta` must match what the job expects; shards are addressed by batch key."""

    def __init__(self, root, meta: Optional[dict] = None, create: bool = False):
        self.root = Path(root)
        path = self.root / MANIFEST
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
            except json.JSONDecodeError:
                raise KavaError(f"KV cache {self.root}: manifest.json is not valid JSON") from None
            self.meta, self.shards = manifest["meta"], manifest["shards"]
            if meta is not None:
                # a reader checks the logits on their own (one line; a job without logits reads a cache with
                # them); a writer (create) must match exactly, so one cache never mixes batches with and without
                ignore = set()
                if not create:
                    check_logits(self.root, self.meta, meta.get("logits_top_k", 0))
                    ignore = {"logits_top_k"}
                diff = sorted(k for k in set(meta) | set(self.meta)
                              if k not in ignore and meta.get(k) != self.meta.get(k))
                if diff:
                    raise KavaError(f"KV cache {self.root} was written for another job: {', '.join(diff)} differ")
        elif create:
            if meta is None:
                raise KavaError(f"KV cache {self.root}: meta is required to create a cache")
            self.root.mkdir(parents=True, exist_ok=True)
            self.meta, self.shards = meta, {}
            self._save_manifest()
        else:
            raise KavaError(f"KV cache {self.root}: no manifest.json (run `kava-ray teachers precompute` first)")

    def _save_manifest(self) -> None:
        atomic_write(self.root / MANIFEST, json.dumps({"meta": self.meta, "shards": self.shards}, indent=1).encode())

    def has(self, key: str) -> bool:
        entry = self.shards.get(key)
        return entry is not None and (self.root / entry["file"]).is_file()

    def put(self, key: str, payloads: dict[str, dict]) -> None:
        data = encode_shard(payloads)
        name = shard_file(key)
        atomic_write(self.root / name, data)
        self.shards[key] = {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        self._save_manifest()

    def get(self, key: str) -> dict[str, dict]:
        """{teacher: wire payload} of one batch; KavaError naming the shard if it is missing or corrupt."""
        entry = self.shards.get(key)
        if entry is None:
            raise KavaError(f"KV cache {self.root}: batch {key!r} was not precomputed")
        path = self.root / entry["file"]
        try:
            data = path.read_bytes()
        except OSError:
            raise KavaError(f"KV cache shard {path}: missing") from None
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise KavaError(f"KV cache shard {path}: checksum mismatch (corrupted); re-run precompute")
        try:
            return decode_shard(data, _header_meta(data))
        except Exception as e:  # noqa: BLE001 - a truncated/forged file that still matched its checksum
            raise KavaError(f"KV cache shard {path}: unreadable ({type(e).__name__})") from None


class CacheSource:
    """A KVFeed source that reads precomputed shards instead of asking live teachers."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self._last: tuple[Optional[str], dict] = (None, {})

    def submit(self, name: str, request: tuple):
        return request[0]  # the batch key is the future

    def result(self, name: str, request: tuple, key: str) -> dict:
        if self._last[0] != key:  # one read per batch, shared by all teachers
            self._last = (key, self.cache.get(key))
        payloads = self._last[1]
        if name not in payloads:
            raise KavaError(f"KV cache {self.cache.root}: teacher '{name}' is not in batch {key!r}")
        p = payloads[name]
        _, _, _, layers, wire_dtype, logits_top_k = request
        if layers is not None and list(p["layer_ids"]) != list(layers) or p["dtype"] != wire_dtype:
            raise KavaError(f"KV cache {self.cache.root}: teacher '{name}' has layers {p['layer_ids']} in "
                            f"{p['dtype']}, the job wants {layers} in {wire_dtype}")
        has = 0 if p.get("topk_ids") is None else int(p["topk_ids"].shape[-1])
        if logits_top_k and has != logits_top_k:
            raise KavaError(f"KV cache {self.cache.root}: teacher '{name}' batch {key!r} has top-{has} logits, the "
                            f"job wants top-{logits_top_k}; re-run `kava-ray teachers precompute` for this job")
        if not logits_top_k and has:  # a job without logits gets the payload it always got
            p = {k: v for k, v in p.items() if k not in ("topk_ids", "topk_logp", "topk_dtype")}
        return p


def check_logits(root, meta: dict, logits_top_k: int) -> None:
    """A job that needs teacher logits (top-k > 0) refuses a cache written without them (or with another
    k), in one line. A job without logits reads any cache (it ignores the logits there)."""
    has = int(meta.get("logits_top_k", 0) or 0)
    if logits_top_k and has != logits_top_k:
        what = "without teacher logits" if not has else f"with top-{has} teacher logits"
        raise KavaError(f"KV cache {root} was written {what}; this job needs top-{logits_top_k} "
                        f"(loss.logit_weight > 0, loss.logit_top_k): re-run `kava-ray teachers precompute`")


def cache_meta(cfg, plans: dict, plan_fingerprint: str, logits_top_k: int = 0) -> dict:
    """What a cache must match to serve a job: data/batching, teachers' layers, wire dtype, key space, and
    the top-k of teacher logits (recorded only when > 0, so a cache without logits has the meta it always had)."""
    teachers = {n: {"model": cfg.teacher(n).model, "quantization": cfg.teacher(n).quantization,
                    "layers": p.layers, "geometry": p.geometry.to_dict()} for n, p in plans.items()}
    for n, p in plans.items():  # a teacher of another tokenizer: the cache keeps a copy to align positions with
        if p.aligned:
            teachers[n].update(tokenizer=f"{TOKENIZERS}/{n}", tokenizer_fingerprint=p.tokenizer_fingerprint)
    meta = {
        "data": plan_fingerprint,
        "wire_dtype": cfg.align.wire_dtype,
        "key_space": cfg.align.key_space,
        "teachers": teachers,
    }
    if logits_top_k:
        meta["logits_top_k"] = int(logits_top_k)
    return meta


def precompute(cfg, handles: dict, plans: dict, stream, out_dir, epochs: int = 1, progress=None,
               extra_streams: tuple = (), logits_top_k=0, tokenizers: Optional[dict] = None) -> dict:
    """Write `epochs` epochs of the stream's batches of teacher KV to `out_dir`; skips shards already there.

    `stream` must be a world_size-1 BatchStream: keys use global batch indices, so the cache serves
    any number of DDP ranks. `extra_streams` (e.g. the held-out split, one epoch each) are cached
    too, so evaluation during training needs no live teacher. logits_top_k > 0: the teachers' top-k
    log-probs are cached with the KV (an int, or {teacher: k}). `tokenizers`: {teacher: tokenizer} of the
    teachers aligned by characters, saved under `tokenizers/<teacher>/` so a job reading the cache can align
    positions without the teacher's model. Returns counts (written, skipped, bytes).
    """
    from actors.feed import ActorSource, KVFeed, feed_items

    k = max(logits_top_k.values(), default=0) if isinstance(logits_top_k, dict) else int(logits_top_k)
    cache = KVCache(out_dir, cache_meta(cfg, plans, stream.plan_fingerprint, k), create=True)
    for name, tok in (tokenizers or {}).items():
        if not (cache.root / TOKENIZERS / name).is_dir():
            with atomic_dir(cache.root / TOKENIZERS / name) as tmp:
                tok.save_pretrained(tmp)
    work = [(stream, stream.steps_per_epoch * epochs)] + [(s, s.steps_per_epoch) for s in extra_streams]
    stats = {"written": 0, "skipped": 0, "bytes": 0, "total": sum(n for _, n in work)}

    def todo():
        for st, n in work:
            for item in feed_items(st, n):
                if cache.has(item[0]):
                    stats["skipped"] += 1
                    continue
                yield item

    feed = KVFeed(ActorSource(handles), todo(), {n: p.layers for n, p in plans.items()},
                  depth=cfg.align.prefetch_depth, wire_dtype=cfg.align.wire_dtype, decode=False,
                  logits_top_k=logits_top_k)
    for (key, _step, _epoch, _batch), payloads in feed:
        cache.put(key, payloads)
        stats["written"] += 1
        stats["bytes"] += cache.shards[key]["bytes"]
        if progress is not None:
            progress(stats)
    return stats
