"""Teacher KV on disk: `kava-ray teachers precompute` writes it, `data.kv_source: cache` reads it.

Indexed by example: every example of the training, validation and test splits goes through the
teachers once and is stored on its own, so a job assembles each batch from its examples whatever its
batch size, data seed, epochs or DDP ranks -- one precompute serves every run and every seed. A
shard is written to a temp file and renamed before its index line is appended (an interrupted
precompute resumes); reads verify the checksum. The layout of a cache dir, the older per-batch
layout and fp8: docs/internals/runtime.md#kv-cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import ray
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_dir, atomic_write, write_json
from kava_ray.core.align.vocab import save_vocab_map
from kava_ray.core.kv import TOPK_ARRAYS, KVBatch
from kava_ray.data import collate_split
from kava_ray.rollout.feed import ActorSource, KVFeed, request_arrays

MANIFEST = "manifest.json"
INDEX = "index.jsonl"
TOKENIZERS = "tokenizers"
LAYOUT = "examples"
ARRAYS = ("k", "v", "k_scale", "v_scale", *TOPK_ARRAYS, "h")


def example_key(split_fingerprint: str, index: int) -> str:
    """The cache key of example `index` of the split whose fingerprint is given."""
    return f"{split_fingerprint}/x{int(index)}"


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
        meta[name] = {k: p[k] for k in ("version", "dtype", "shape", "layer_ids", "key_space", "topk_dtype",
                                        "hidden_dtype") if k in p}
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
    """A cache dir: `meta` must match what the job expects; shards are addressed by key (an
    example's `example_key`, or a batch key in a cache of the old layout)."""

    def __init__(self, root, meta: Optional[dict] = None, create: bool = False):
        self.root = Path(root)
        path = self.root / MANIFEST
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError):
                raise KavaError(f"KV cache {path} is not valid JSON") from None
            if not isinstance(manifest, dict) or not isinstance(manifest.get("meta"), dict):
                raise KavaError(f"KV cache {path} is not a kava-ray cache manifest")
            self.meta, self.shards = manifest["meta"], dict(manifest.get("shards", {}))
            self.shards.update(_read_index(self.root / INDEX))
            if meta is not None:
                # a reader checks the logits on their own (one line; a job without logits reads a
                # cache with them); a writer (create) must match exactly, so one cache never mixes
                # batches with and without
                ignore = set()
                if not create:
                    check_logits(self.root, self.meta, meta.get("logits_top_k", 0))
                    if meta.get("hidden") and not self.meta.get("hidden"):
                        raise KavaError(f"KV cache {self.root} was written without the teachers' hidden states; this "
                                        f"job needs them (loss.hidden_weight > 0): re-run `kava-ray teachers "
                                        f"precompute` for this job into another --out")
                    ignore = {"logits_top_k", "hidden"}
                diff = sorted(k for k in set(meta) | set(self.meta)
                              if k not in ignore and meta.get(k) != self.meta.get(k))
                if diff:
                    raise KavaError(f"KV cache {self.root} was written for another job: {', '.join(diff)} differ "
                                    f"(re-run `kava-ray teachers precompute` for this job into another --out)")
        elif create:
            if meta is None:
                raise KavaError(f"KV cache {self.root}: meta is required to create a cache")
            self.root.mkdir(parents=True, exist_ok=True)
            self.meta, self.shards = meta, {}
            self._save_manifest()
        else:
            raise KavaError(f"KV cache {self.root}: no manifest.json "
                            f"(write the cache with kava-ray teachers precompute)")

    @property
    def by_example(self) -> bool:
        """True for the example-indexed layout (batches are assembled from their examples)."""
        return self.meta.get("layout") == LAYOUT

    def _save_manifest(self) -> None:
        legacy = {} if self.by_example else {"shards": self.shards}  # new entries live in index.jsonl
        write_json(self.root / MANIFEST, {"meta": self.meta, **legacy})

    def has(self, key: str) -> bool:
        entry = self.shards.get(key)
        return entry is not None and (self.root / entry["file"]).is_file()

    def put(self, key: str, payloads: dict[str, dict]) -> None:
        """Store one shard ({teacher: wire payload}) under `key`: the file first, then its index entry."""
        data = encode_shard(payloads)
        name = shard_file(key)
        atomic_write(self.root / name, data)
        entry = {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        self.shards[key] = entry
        if not self.by_example:
            self._save_manifest()
            return
        with open(self.root / INDEX, "a") as f:  # one line per entry: O(1) per example, whatever the cache's size
            f.write(json.dumps({"key": key, **entry}) + "\n")
            f.flush()
            os.fsync(f.fileno())

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
    """A KVFeed source that reads precomputed shards instead of asking live teachers: a batch is
    assembled from its examples' shards (`KVRequest.examples`), or, in a cache of the old layout,
    read by its batch key."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self._last: tuple[object, dict] = (None, {})

    def submit(self, name: str, request):
        return request.examples if self.cache.by_example else request.key  # the future: what names the batch

    def _read(self, what) -> dict:
        """{teacher: payload} of one batch (old layout) or {teacher: [payload per example]}; one
        read per batch, shared by all teachers."""
        if self._last[0] != what:
            if not self.cache.by_example:
                data = self.cache.get(what)
            else:
                rows = [self.cache.get(example_key(what[0], i)) for i in what[1]]
                data = {n: [r[n] for r in rows] for n in rows[0]} if rows else {}
            self._last = (what, data)
        return self._last[1]

    def result(self, name: str, request, what) -> dict:
        if self.cache.by_example and what is None:
            raise KavaError(f"KV cache {self.cache.root} is indexed by example, but the request names no examples "
                            f"(batch {request.key!r})")
        data = self._read(what)
        if name not in data:
            raise KavaError(f"KV cache {self.cache.root}: teacher '{name}' is not in batch {request.key!r}")
        p = data[name][0] if self.cache.by_example else data[name]
        vocab = self.cache.meta.get("teachers", {}).get(name, {}).get("geometry", {}).get("vocab_size")
        _check_payload(self.cache.root, name, request, p, vocab)
        if self.cache.by_example:
            rows = [KVBatch.from_wire(r, dtype=None) for r in data[name]]
            p = KVBatch.stack(rows, torch.as_tensor(request.attention_mask)).to_wire(p["dtype"])
        if not request.logits_top_k:  # a job without logits gets the payload it always got
            p = {k: v for k, v in p.items() if k not in (*TOPK_ARRAYS, "topk_dtype")}
        if not getattr(request, "hidden", False):  # nor hidden states it did not ask for
            p = {k: v for k, v in p.items() if k not in ("h", "hidden_dtype")}
        return p


def _check_payload(root, name: str, request, p: dict, vocab: Optional[int] = None) -> None:
    """A stored payload must have the layers, wire dtype and top-k the request asks for (one line if
    not); a k past the teacher's `vocab` is all of it (`teacher_forward_kv` serves at most V
    ids)."""
    layers, k = request.layers, request.logits_top_k
    if k and vocab:
        k = min(k, int(vocab))
    if layers is not None and list(p["layer_ids"]) != list(layers) or p["dtype"] != request.wire_dtype:
        raise KavaError(f"KV cache {root}: teacher '{name}' has layers {p['layer_ids']} in "
                        f"{p['dtype']}, the job wants {layers} in {request.wire_dtype}")
    has = 0 if p.get("topk_ids") is None else int(p["topk_ids"].shape[-1])
    if k and has != k:
        raise KavaError(f"KV cache {root}: teacher '{name}' batch {request.key!r} has top-{has} logits, the "
                        f"job wants top-{k}; re-run `kava-ray teachers precompute` for this job")
    if getattr(request, "hidden", False) and p.get("h") is None:
        raise KavaError(f"KV cache {root}: teacher '{name}' batch {request.key!r} has no hidden states, the job "
                        f"wants them (loss.hidden_weight > 0); re-run `kava-ray teachers precompute` for this job")


def _read_index(path: Path) -> dict:
    """{key: entry} from index.jsonl; a torn last line (an interrupted write) is ignored."""
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
                out[e.pop("key")] = e
            except (json.JSONDecodeError, KeyError, AttributeError):
                continue
    return out


def check_logits(root, meta: dict, logits_top_k: int) -> None:
    """A job that needs teacher logits (top-k > 0) refuses a cache written without them (or with
    another k), in one line. A job without logits reads any cache (it ignores the logits there)."""
    has = int(meta.get("logits_top_k", 0) or 0)
    if logits_top_k and has != logits_top_k:
        what = "without teacher logits" if not has else f"with top-{has} teacher logits"
        raise KavaError(f"KV cache {root} was written {what}; this job needs top-{logits_top_k} "
                        f"(loss.logit_weight > 0, loss.logit_top_k): re-run `kava-ray teachers precompute`")


def cache_meta(cfg, plans: dict, data_fingerprint: str, logits_top_k: int = 0, hidden: bool = False) -> dict:
    """What a cache must match to serve a job: its training split (`data`: the split's fingerprint,
    which depends on the data, tokenizer and max_length, not on batching), teachers' layers, wire
    dtype, key space, and the top-k of teacher logits (recorded only when > 0)."""
    teachers = {n: {"model": cfg.teacher(n).model, "quantization": cfg.teacher(n).quantization,
                    "layers": p.layers, "geometry": p.geometry.to_dict()} for n, p in plans.items()}
    for n, p in plans.items():  # a teacher of another tokenizer: the cache keeps a copy to align positions with
        if p.aligned:
            teachers[n].update(tokenizer=f"{TOKENIZERS}/{n}", tokenizer_fingerprint=p.tokenizer_fingerprint)
    meta = {
        "layout": LAYOUT,
        "data": data_fingerprint,
        "wire_dtype": cfg.align.wire_dtype,
        "key_space": cfg.align.key_space,
        "teachers": teachers,
    }
    if logits_top_k:
        meta["logits_top_k"] = int(logits_top_k)
    if hidden:  # the teachers' hidden states (loss.hidden_weight): recorded only when there
        meta["hidden"] = True
    return meta


def precompute(cfg, handles: dict, plans: dict, splits: list, out_dir, progress=None, logits_top_k=0,
               tokenizers: Optional[dict] = None, vocab_maps: Optional[dict] = None, hidden: bool = False) -> dict:
    """Run every example of `splits` (TokenizedSplits; the first is the training split the cache is
    checked against) through the teachers once, in batches of `train.batch_size` in split order, and
    store each example on its own (`example_key`); examples already stored are skipped (an
    interrupted precompute resumes). logits_top_k > 0: the teachers' top-k log-probs are cached with
    the KV (an int, or {teacher: k}). `tokenizers`: {teacher: tokenizer} of the teachers aligned by
    characters, saved under `tokenizers/<teacher>/`, with the vocabulary map to the student's of
    those whose logits the job takes (`vocab_maps`, `plans.vocab_maps`: a run from the cache reads
    it there). Returns counts in examples (written, skipped, total), bytes and the teacher forwards
    (batches) run.
    """

    k = max(logits_top_k.values(), default=0) if isinstance(logits_top_k, dict) else int(logits_top_k)
    cache = KVCache(out_dir, cache_meta(cfg, plans, splits[0].fingerprint, k, hidden), create=True)
    for name, tok in (tokenizers or {}).items():
        if not (cache.root / TOKENIZERS / name).is_dir():
            with atomic_dir(cache.root / TOKENIZERS / name) as tmp:
                tok.save_pretrained(tmp)
    for name, vmap in (vocab_maps or {}).items():
        if not (cache.root / TOKENIZERS / name / vmap.file_name).is_file():
            save_vocab_map(vmap, cache.root / TOKENIZERS / name / vmap.file_name)
    B = cfg.train.batch_size
    stats = {"written": 0, "skipped": 0, "bytes": 0, "forwards": 0, "total": sum(len(s) for s in splits)}

    def todo():
        for split in splits:
            fp = split.fingerprint
            for start in range(0, len(split), B):
                idx = [i for i in range(start, min(start + B, len(split))) if not cache.has(example_key(fp, i))]
                stats["skipped"] += min(B, len(split) - start) - len(idx)
                if idx:
                    ids, mask = request_arrays(collate_split(split, idx))
                    yield f"{fp}/x{idx[0]}+{len(idx)}", ids, mask, (fp, idx)

    feed = KVFeed(ActorSource(handles), todo(), {n: p.layers for n, p in plans.items()},
                  depth=cfg.align.prefetch_depth, wire_dtype=cfg.align.wire_dtype, decode=False,
                  logits_top_k=logits_top_k, hidden=hidden)
    for (fp, idx), payloads in feed:
        batches = {n: KVBatch.from_wire(p, dtype=None) for n, p in payloads.items()}
        for b, i in enumerate(idx):
            key = example_key(fp, i)
            cache.put(key, {n: kv.row(b).to_wire(payloads[n]["dtype"]) for n, kv in batches.items()})
            stats["written"] += 1
            stats["bytes"] += cache.shards[key]["bytes"]
        stats["forwards"] += 1
        if progress is not None:
            progress(stats)
    return stats


@ray.remote(num_cpus=0, max_concurrency=2)
class CacheWriter:
    """`precompute` run on a teacher's node (`kava-ray teachers precompute` from a driver on another
    node): the teachers' KV goes from their object store to the cache dir without crossing to the
    driver. Its progress is readable while it runs (`progress`, a second concurrent call)."""

    def __init__(self):
        self.stats: dict = {}

    def run(self, *args, **kwargs) -> dict:
        return precompute(*args, progress=self._report, **kwargs)

    def _report(self, stats: dict) -> None:
        self.stats = dict(stats)

    def progress(self) -> dict:
        return self.stats
