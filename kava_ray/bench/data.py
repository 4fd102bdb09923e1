"""`kava-ray bench data`: does the data path stay flat as the corpus grows?

Generated `text` corpora of the given sizes (JSONL of natural-text documents: CPython's reference
docs, paragraphs shuffled per document) are prepared the way `kava-ray train` prepares them -- in
the driver, `load_records` + `tokenize_split` with packing into `max_length` blocks over Hugging
Face `datasets` (Arrow on disk) -- and then read the way a Ray Train worker reads them: a fresh
process that loads the cached split, builds the resumable `BatchStream` and takes batches. Each side
runs in a fresh process so its peak RSS (VmHWM) is its own. Reported per size: the driver's
preparation time and peak RSS (cold cache), the worker's time to its first batch and peak RSS (warm
cache), and the stream's tokens/s against a student training step's tokens/s (a 6-layer Qwen2,
hidden 384, as `bench step`), measured side by side in one run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from transformers import AutoModelForCausalLM

from kava_ray.common.config import validate_config
from kava_ray.common.errors import KavaError
from kava_ray.common.files import format_table
from kava_ray.core.models import load_tokenizer
from kava_ray.data import BatchStream, plan_batches, synthetic_gsm8k, tokenize_split
from kava_ray.data.batching import RELEASE_EVERY
from kava_ray.data.corpus import pydoc_topics, split_topics
from kava_ray.data.splits import load_splits
from kava_ray.runtime.console import status
from kava_ray.testing.tiny import build_tiny_model
from kava_ray.testing.tokenizers import ensure_tokenizer

SIZES_MB = (10, 100, 1000)
ROW_CAP = 1024  # unpacked text documents, one per row, are cut here for the padding comparison


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> dict:
    """A JSONL text corpus of about `megabytes` MB: documents of 3-12 paragraphs of the Python docs, shuffled."""
    paras = [p.strip() for t in pydoc_topics().values() for p in t.split("\n\n") if len(p.strip()) > 40]
    rng = random.Random(seed)
    target, written, docs = int(megabytes * 2 ** 20), 0, 0
    with open(path, "w") as f:
        while written < target:
            line = json.dumps({"text": "\n\n".join(rng.sample(paras, rng.randint(3, 12)))}) + "\n"
            f.write(line)
            written += len(line.encode())
            docs += 1
    return {"path": str(path), "bytes": written, "documents": docs}


def _anon_rss_mib() -> float:
    """The process's private (anonymous) resident memory now. Peak RSS (VmHWM) also counts the clean
    pages of the memory-mapped Arrow cache that reads map in (readahead and fault-around);
    `BatchStream` releases those every `RELEASE_EVERY` batches (`kava_ray.data.mmap_advice`), and
    Ray's memory monitor does not count them."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _job(corpus: Path, max_length: int, cache: Path, batch_size: int):
    return validate_config({
        "teachers": [{"name": "t", "model": "unused"}], "student": {"model": str(_tokenizer_dir())},
        "data": {"source": str(corpus), "format": "text", "num_train": None, "num_val": 4, "num_test": 4,
                 "test_split": "train", "cache_dir": str(cache)},
        "train": {"max_length": max_length, "batch_size": batch_size}})


def _tokenizer_dir() -> Path:
    """The real SmolLM2 tokenizer (cached by `make install`): the demo's student tokenizer."""
    return ensure_tokenizer("smollm2")


def driver(corpus: str, max_length: int, cache: str, batch_size: int) -> dict:
    """What `kava-ray train` does to the data before Ray starts: read, tokenize, pack, cache (this process)."""
    cfg = _job(Path(corpus), max_length, Path(cache), batch_size)
    tok = load_tokenizer(cfg.student.model)
    base = _peak_rss_mib()
    t0 = time.perf_counter()
    train, _ = load_splits(cfg.data, cfg.train, tok)
    return {"prepare_s": time.perf_counter() - t0, "blocks": len(train), "tokens": int(train.lengths.sum()),
            "peak_rss_mib": _peak_rss_mib(), "base_rss_mib": base}


def worker(corpus: str, max_length: int, cache: str, batch_size: int, batches: int) -> dict:
    """What a train worker does: load the cached split, build the stream, take `batches` batches (this process)."""
    cfg = _job(Path(corpus), max_length, Path(cache), batch_size)
    tok = load_tokenizer(cfg.student.model)
    base = _peak_rss_mib()
    t0 = time.perf_counter()
    train, _ = load_splits(cfg.data, cfg.train, tok)
    stream = BatchStream(train, batch_size, seed=0)
    stream.next()
    first = time.perf_counter() - t0
    anon = _anon_rss_mib()
    t1 = time.perf_counter()
    tokens = 0
    for _ in range(batches):
        _, _, _, b = stream.next()
        tokens += int(b.attention_mask.sum())
        anon = max(anon, _anon_rss_mib())
    dt = time.perf_counter() - t1
    return {"first_batch_s": first, "stream_tokens_per_s": tokens / dt, "peak_rss_mib": _peak_rss_mib(),
            "peak_anon_mib": anon, "base_rss_mib": base, "padded": 1.0 - tokens / (batches * batch_size * max_length)}


def student_step_tokens_per_s(max_length: int, batch_size: int, steps: int = 3) -> float:
    """Tokens/s of a plain training step (forward, backward, AdamW) of `bench step`'s student, one thread."""
    # here, not at the top: the driver and worker processes import this module, and their peak RSS is the measure
    from kava_ray.bench.step import STUDENT

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp, **STUDENT))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, max_length))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return batch_size * max_length / min(times[1:])


def padding_shares(max_length: int = 128, batch_size: int = 8) -> dict:
    """Share of padded positions over one epoch of batches, before and after: the demo's synthetic
    GSM8K (its max_length 224, batch 4) batched at random vs by length (`data.group_by_length`), and
    the Python-docs corpus's training documents padded one per row (cut at ROW_CAP) vs packed into
    `max_length` blocks (`data.packing`)."""
    tok = load_tokenizer(str(_tokenizer_dir()))
    gsm = tokenize_split(tok, synthetic_gsm8k(256, 0), 224, source_id="bench-data/gsm8k")
    topics = pydoc_topics()
    docs = [{"text": topics[n]} for n in split_topics(topics)["train"]]
    rows = tokenize_split(tok, docs, ROW_CAP, source_id="bench-data/pydoc", packing=False)
    packed = tokenize_split(tok, docs, max_length, source_id="bench-data/pydoc")

    def share(split, b, bucket):
        return split.padded_share(b, plan_batches(split.lengths, b, seed=0, epoch=0, bucket=bucket))

    return {"gsm8k_random": share(gsm, 4, False), "gsm8k_by_length": share(gsm, 4, True),
            "pydoc_rows": share(rows, batch_size, True), "pydoc_packed": share(packed, batch_size, False)}


def _in_fresh_process(fn: str, *args) -> dict:
    """Run `driver` / `worker` in a new Python process (its own peak RSS); returns its JSON result."""
    code = (f"import json, sys; from kava_ray.bench.data import {fn}; "
            f"print('RESULT ' + json.dumps({fn}(*json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(list(args))], capture_output=True, text=True,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        tail = ((out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"])[0]
        if tail.startswith("kava_ray.common.errors.KavaError: "):  # bad input, found in the child: one line, as here
            raise KavaError(f"bench data {fn}: {tail.split(': ', 1)[1]}")
        raise RuntimeError(f"bench data {fn} failed: {tail}")
    return json.loads(line[len("RESULT "):])


def run_data_bench(sizes_mb: Sequence[float] = SIZES_MB, max_length: int = 128, batch_size: int = 8,
                   batches: int = 200, out: Optional[str] = None, progress: bool = True) -> dict:
    """Every size: write the corpus, prepare it in a fresh 'driver' process (cold cache), read it in
    a fresh 'worker' process (warm cache); then the student step's tokens/s for the ratio."""
    if not sizes_mb or min(sizes_mb) <= 0 or min(max_length, batch_size, batches) < 1:
        raise KavaError(f"bench data: sizes must be > 0 MB (got {list(sizes_mb)}), max-length, batch-size and "
                        f"batches >= 1")
    root = Path(out or tempfile.mkdtemp(prefix="kava-bench-data-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for mb in sizes_mb:
        corpus = root / f"corpus-{mb:g}MB.jsonl"
        cache = root / f"cache-{mb:g}MB"
        t0 = time.time()
        info = write_corpus(corpus, mb)
        if progress:
            status(f"[bench data] {mb:g} MB: {info['documents']} documents written ({time.time() - t0:.0f} s)")
        d = _in_fresh_process("driver", str(corpus), max_length, str(cache), batch_size)
        w = _in_fresh_process("worker", str(corpus), max_length, str(cache), batch_size, batches)
        rows.append({"size_mb": mb, **info, "driver": d, "worker": w})
        if progress:
            status(f"[bench data] {mb:g} MB: prepared in {d['prepare_s']:.0f} s ({d['tokens']} tokens), worker peak "
                   f"{w['peak_rss_mib']:.0f} MiB")
    step = student_step_tokens_per_s(max_length, batch_size)
    pads = padding_shares(max_length, batch_size)
    first, last = rows[0]["worker"], rows[-1]["worker"]
    return {"sizes_mb": list(sizes_mb), "max_length": max_length, "batch_size": batch_size, "batches": batches,
            "rows": rows, "student_step_tokens_per_s": step, "padding": pads,
            "worker_rss_ratio": last["peak_rss_mib"] / first["peak_rss_mib"],
            "worker_anon_ratio": last["peak_anon_mib"] / first["peak_anon_mib"],
            "out": str(root)}


def format_data_bench(r: dict) -> str:
    step, p = r["student_step_tokens_per_s"], r["padding"]
    rows = [[f"{x['size_mb']:g} MB", x["documents"], x["driver"]["tokens"], f"{x['driver']['prepare_s']:.1f}",
             f"{x['driver']['peak_rss_mib']:.0f}", f"{x['worker']['first_batch_s']:.2f}",
             f"{x['worker']['peak_rss_mib']:.0f}", f"{x['worker']['peak_anon_mib']:.0f}",
             f"{x['worker']['stream_tokens_per_s']:.0f}",
             f"{x['worker']['stream_tokens_per_s'] / step:.0f}x", f"{100 * x['worker']['padded']:.1f} %"]
            for x in r["rows"]]
    head = ["corpus", "documents", "tokens", "driver prepare s", "driver peak MiB", "worker first batch s",
            "worker peak MiB", "worker private MiB", "stream tokens/s", "vs student step", "padding"]
    return "\n".join([
        f"data bench: text records packed into {r['max_length']}-token blocks, batch {r['batch_size']}; driver = "
        f"read + tokenize + pack into the Arrow cache (cold, a fresh process); worker = load the cached split + "
        f"BatchStream + {r['batches']} batches (warm, a fresh process)",
        format_table(head, rows),
        f"student step (6-layer Qwen2, hidden 384, 1 thread): {step:.0f} tokens/s; worker at "
        f"{r['rows'][-1]['size_mb']:g} MB / at {r['rows'][0]['size_mb']:g} MB: private memory (peak RssAnon) "
        f"{r['worker_anon_ratio']:.2f}x, peak RSS {r['worker_rss_ratio']:.2f}x (target <= 1.5x; it also counts the "
        f"mapped Arrow cache's pages, which the stream releases every {RELEASE_EVERY} batches)",
        f"padded positions: demo GSM8K (synthetic, 224 tokens, batch 4) {100 * p['gsm8k_random']:.1f} % at random -> "
        f"{100 * p['gsm8k_by_length']:.1f} % grouped by length; Python-docs training documents one per row "
        f"(cut at {ROW_CAP}, grouped by length) {100 * p['pydoc_rows']:.1f} % -> packed into {r['max_length']}-token "
        f"blocks {100 * p['pydoc_packed']:.1f} %"])
