"""`kava-ray bench feed`: does the KVFeed hide teacher time behind the student's step?

Measured side by side in one run on an embedded Ray, one thread each for teacher and student:
  T  teacher alone: one `kv()` round trip per step (forward + wire + object store), no student
  S  student alone: one production training step (`worker.DistillRecipe.step`: Distiller forward,
     projector, fusion, Mercator + CE, backward, AdamW) on KV that is already there
  sequential: ask, wait, then train — the predecessor's way, ~T + S per step
  pipelined:  KVFeed at depth 1, 2, 4 — ideally max(T, S) per step
overlap efficiency = max(T, S) / pipelined step time (1.0 = teacher time fully hidden).
Each mode runs `rounds` times, interleaved, and keeps its fastest round.

Transport: bytes/s of one KV payload from an actor to the driver as the wire format (numpy views,
received zero-copy and viewed as bf16 tensors), as pickled torch tensors, and an in-process memcpy
of the same bytes (median of `repeats`, after `warmup` calls that fault in the object store's pages).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
import torch

from actors.feed import ActorSource, KVFeed
from actors.pool import start_pool, stop_pool
from kava_ray._io import format_table
from kava_ray.config import JobConfig, validate_config
from kava_ray.connect import connect
from kava_ray.job import embedded_cpus, live_plans
from kava_ray.kv import KVBatch
from kava_ray.testing.tiny import build_tiny_model
from kava_ray.worker import DistillRecipe

TEACHER = dict(family="qwen2", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=2)
STUDENT = dict(family="qwen2", num_layers=6, hidden_size=192, num_heads=6, num_kv_heads=2)


def bench_config(t_dir: Path, s_dir: Path, storage: Path) -> JobConfig:
    """The bench's job: the tiny teacher and student, structured linear projector, Mercator + CE, AdamW."""
    return validate_config({
        "name": "bench-feed",
        "teachers": [{"name": "t", "model": str(t_dir), "dtype": "float32"}],
        "student": {"model": str(s_dir), "dtype": "float32"},
        "data": {"num_train": 8, "num_test": 4, "num_val": 4},
        "align": {"mode": "structured", "projector": {"kind": "linear", "dropout": 0.0}},
        "optim": {"lr_student": 1e-4, "lr_projector": 1e-4, "warmup_steps": 0, "schedule": "constant"},
        "ray": {"namespace": "kava-bench", "storage_path": str(storage), "num_workers": 1, "use_gpu": False},
    })


def _batches(n: int, batch: int, tokens: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab - 4, (batch, tokens), generator=g)
        mask = torch.ones_like(ids)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone(), "answer_mask": mask})
    return out


def _items(batches):
    for b in batches:  # key None: every request is a real forward (no LRU hits)
        yield None, b["input_ids"].numpy(), b["attention_mask"].numpy(), b


def _per_step(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / n


def run_feed_bench(steps: int = 32, batch: int = 4, tokens: int = 128, depths=(1, 2, 4),
                   transport_mib: int = 64, repeats: int = 15,
                   rounds: int = 2) -> dict:
    """Run every measurement once, side by side, and return the figures (seconds per step, bytes/s)."""
    torch.set_num_threads(1)
    started_ray = not ray.is_initialized()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t_dir = build_tiny_model(Path(tmp) / "teacher", **TEACHER, seed=0)
            s_dir = build_tiny_model(Path(tmp) / "student", **STUDENT, seed=1)
            cfg = bench_config(t_dir, s_dir, Path(tmp) / "runs")
            if started_ray:  # sized by the one rule every command uses (the transport probe takes the worker's CPU)
                connect(None, cfg.ray.namespace, num_cpus=embedded_cpus(cfg), worker_env={"OMP_NUM_THREADS": "1"})
            teacher = start_pool(cfg)["t"]  # the production teacher actor, named, with restarts
            plans = live_plans(cfg, {"t": teacher})
            layers = plans["t"].layers
            recipe = DistillRecipe(cfg, plans)  # the production training step, one rank
            recipe.setup()
            n_step = iter(range(1, 10**9))

            def step(batch, kv):  # one production optimizer step on one micro-batch
                recipe.step(next(n_step), [(batch, {"t": kv})])
            data = _batches(steps + 1, batch, tokens, 256)
            source = ActorSource({"t": teacher})

            def teacher_only():
                for _, ids, mask, _b in _items(data[1:]):
                    ray.get(teacher.kv.remote(None, ids, mask, layers, "bf16"))

            def student_only(kvs):
                for b, kv in zip(data[1:], kvs):
                    step(b, KVBatch.from_wire(kv))

            def sequential():
                for _, ids, mask, b in _items(data[1:]):
                    step(b, KVBatch.from_wire(ray.get(teacher.kv.remote(None, ids, mask, layers, "bf16"))))

            def pipelined(depth):
                def run():
                    for b, kv in KVFeed(source, _items(data[1:]), {"t": layers}, depth=depth):
                        step(b, kv["t"])
                return run

            # warm-up: first forward/backward of each model pays one-off allocation costs
            step(data[0], KVBatch.from_wire(ray.get(teacher.kv.remote(None, data[0]["input_ids"].numpy(),
                                                                      data[0]["attention_mask"].numpy(),
                                                                      layers, "bf16"))))
            payloads = [ray.get(teacher.kv.remote(None, b["input_ids"].numpy(), b["attention_mask"].numpy(),
                                                  layers, "bf16")) for b in data[1:]]
            # `rounds` interleaved rounds; each mode keeps its fastest round (least disturbed by the box)
            runs: dict = {}
            for _ in range(rounds):
                for name, fn in [("T", teacher_only), ("S", lambda: student_only(payloads)), ("seq", sequential)] + \
                                [(d, pipelined(d)) for d in depths]:
                    runs.setdefault(name, []).append(_per_step(fn, steps))
            T, S, seq = min(runs["T"]), min(runs["S"]), min(runs["seq"])
            pipe = {d: min(runs[d]) for d in depths}
            transport = _transport(transport_mib, repeats)
            stop_pool(cfg)
    finally:
        if started_ray:
            ray.shutdown()
    best = max(T, S)
    return {
        "config": {"steps": steps, "batch": batch, "tokens": tokens, "rounds": rounds, "teacher": TEACHER, "student": STUDENT,
                   "threads": "1 teacher + 1 student"},
        "teacher_s": T, "student_s": S, "t_over_s": T / S, "sequential_s": seq,
        "pipelined_s": {str(d): p for d, p in pipe.items()},
        "overlap_efficiency": {str(d): best / p for d, p in pipe.items()},
        "speedup_vs_sequential": {str(d): seq / p for d, p in pipe.items()},
        "transport": transport,
    }


@ray.remote(num_cpus=1)
class _TransportProbe:
    """Holds one bf16 KV batch of ~`mib` MiB and returns it as wire payload or as torch tensors."""

    def __init__(self, mib: int):
        L, B, H, D = 28, 4, 2, 128  # Qwen2.5-1.5B geometry: 28 KiB of bf16 K+V per token
        T = max(1, mib * 2**20 // (2 * L * B * H * D * 2))
        g = torch.Generator().manual_seed(0)
        self.kv = KVBatch(torch.randn(L, B, H, T, D, generator=g).bfloat16(),
                          torch.randn(L, B, H, T, D, generator=g).bfloat16(), list(range(L)), None, "pre_rope")

    def nbytes(self) -> int:
        return self.kv.num_bytes()

    def wire(self) -> dict:
        return self.kv.to_wire("bf16")

    def tensors(self) -> dict:
        return {"k": self.kv.keys, "v": self.kv.values}


def _transport(mib: int, repeats: int, warmup: int = 10) -> dict:
    probe = _TransportProbe.remote(mib)
    nbytes = ray.get(probe.nbytes.remote())

    def timed(fn):
        for _ in range(warmup):  # the object store's shared pages are faulted in on first use
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times)

    def wire():  # the received numpy buffers viewed as torch tensors: what `from_wire` starts from
        p = ray.get(probe.wire.remote())
        return [torch.from_numpy(p[n]).view(torch.bfloat16) for n in ("k", "v")]

    def pickled():
        t = ray.get(probe.tensors.remote())
        return [t["k"], t["v"]]

    src = np.random.default_rng(0).integers(0, 2**16, nbytes // 2, dtype=np.uint16)
    dst = np.empty_like(src)
    out = {"bytes": nbytes, "wire_Bps": timed(wire), "torch_pickle_Bps": timed(pickled),
           "memcpy_Bps": timed(lambda: np.copyto(dst, src))}
    out["wire_over_pickle"] = out["wire_Bps"] / out["torch_pickle_Bps"]
    out["wire_over_memcpy"] = out["wire_Bps"] / out["memcpy_Bps"]
    ray.kill(probe)
    return out


def format_feed_bench(r: dict) -> str:
    ms = lambda s: f"{1000 * s:.0f} ms"  # noqa: E731
    rows = [["teacher alone (T)", ms(r["teacher_s"]), "", ""],
            ["student alone (S)", ms(r["student_s"]), "", ""],
            ["sequential (T + S)", ms(r["sequential_s"]), f"{max(r['teacher_s'], r['student_s']) / r['sequential_s']:.2f}", "1.00"]]
    for d, p in r["pipelined_s"].items():
        rows.append([f"KVFeed depth {d}", ms(p), f"{r['overlap_efficiency'][d]:.2f}", f"{r['speedup_vs_sequential'][d]:.2f}"])
    c = r["config"]
    out = [f"feed bench: {c['steps']} steps of {c['batch']} x {c['tokens']} tokens, {c['threads']}; "
           f"T/S = {r['t_over_s']:.2f}",
           format_table(["mode", "per step", "overlap eff. max(T,S)/step", "speedup vs sequential"], rows)]
    t = r["transport"]
    gbs = lambda b: f"{b / 1e9:.2f} GB/s"  # noqa: E731
    out += ["", f"transport of one {t['bytes'] / 2**20:.0f} MiB bf16 KV payload, actor -> driver (median):",
            format_table(["path", "throughput", "vs wire"], [
                ["wire (numpy views)", gbs(t["wire_Bps"]), "1.00"],
                ["pickled torch tensors", gbs(t["torch_pickle_Bps"]), f"{t['torch_pickle_Bps'] / t['wire_Bps']:.2f}"],
                ["in-process memcpy", gbs(t["memcpy_Bps"]), f"{t['memcpy_Bps'] / t['wire_Bps']:.2f}"]]),
            f"wire is {t['wire_over_pickle']:.1f}x pickled torch and {100 * t['wire_over_memcpy']:.0f}% of memcpy"]
    return "\n".join(out)
