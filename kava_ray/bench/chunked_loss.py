"""`kava-ray bench step --memory`'s chunked-loss part: the chunked vocabulary loss
(`loss.vocab_chunk`, `core.vocab_chunks`) against whole logits, on a tiny student that carries
Qwen2.5's vocabulary (151,936 ids), for CE and for the logit-KD recipe: the student worker's peak
memory (each in a fresh process, `bench.memory.measure_peak`) and the step time (interleaved rounds
in this process, the fastest kept), both from one run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from kava_ray.bench.memory import measure_peak
from kava_ray.bench.step_setup import bench_job, kv_stepper, random_batch, sync_device, timed_mean
from kava_ray.common.config import LossConfig, load_config
from kava_ray.common.files import format_table
from kava_ray.core.models import load_model
from kava_ray.testing.tiny import build_tiny_model

QWEN_VOCAB = 151_936
# a tiny student and teacher carrying Qwen2.5's vocabulary: the head and the loss are most of the step
STUDENT = dict(family="qwen2", num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
               vocab_size=QWEN_VOCAB)
TEACHER = dict(STUDENT)
RECIPES = {"ce": ["loss.kv_weight=0"], "ce+logits": ["loss.kv_weight=0", "loss.logit_weight=1"]}
TARGETS = {"memory": 0.5, "time": 1.10}  # chunked / whole at most


def chunk_bench(batch: int = 4, tokens: int = 1024, steps: int = 2, rounds: int = 3,
                chunk: int = LossConfig().vocab_chunk) -> dict:
    """{"config", "recipes": {recipe: {"whole"/"chunked": {"peak", "step_s"}, "memory_ratio",
    "time_ratio", "met"}}}."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paths = {"whole": 0, "chunked": int(chunk)}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        t_dir = build_tiny_model(Path(tmp) / "teacher", **TEACHER, seed=0)
        s_dir = build_tiny_model(Path(tmp) / "student", **STUDENT, seed=1)
        base = bench_job(t_dir, s_dir, Path(tmp) / "runs", batch, tokens)
        data = random_batch(batch, tokens, QWEN_VOCAB)
        t_model, payloads = load_model(str(t_dir), dtype="float32"), {}
        for name, overrides in RECIPES.items():
            cfgs = {p: load_config(base, [*overrides, f"loss.vocab_chunk={c}"]) for p, c in paths.items()}
            peaks = {p: measure_peak(cfg, steps=steps) for p, cfg in cfgs.items()}
            steppers = {p: kv_stepper(cfg, t_model, "t", data, payloads, QWEN_VOCAB, device) for p, cfg in cfgs.items()}
            times = {p: [] for p in paths}
            for fn in steppers.values():  # warm-up
                fn()
            for r in range(rounds):
                for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                    times[p].append(timed_mean(steppers[p], steps, device))
            del steppers
            sync_device(device)
            row = {p: {"peak": peaks[p]["peak"], "step_s": min(times[p]), "device": peaks[p]["device"]} for p in paths}
            row["memory_ratio"] = row["chunked"]["peak"] / row["whole"]["peak"]
            row["time_ratio"] = row["chunked"]["step_s"] / row["whole"]["step_s"]
            row["met"] = row["memory_ratio"] <= TARGETS["memory"] and row["time_ratio"] <= TARGETS["time"]
            out[name] = row
    config = {"batch": batch, "tokens": tokens, "steps": steps, "rounds": rounds, "chunk": int(chunk),
              "student": STUDENT, "device": device.type}
    return {"config": config, "recipes": out, "targets": TARGETS}


def format_chunk_bench(r: dict) -> str:
    c, s = r["config"], r["config"]["student"]
    what = "peak RSS growth" if c["device"] == "cpu" else "torch.cuda.max_memory_allocated"
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    rows = [[name, gib(v["whole"]["peak"]), gib(v["chunked"]["peak"]), f"{v['memory_ratio']:.2f}",
             f"{v['whole']['step_s']:.2f}", f"{v['chunked']['step_s']:.2f}", f"{v['time_ratio']:.2f}",
             "met" if v["met"] else "NOT met"] for name, v in r["recipes"].items()]
    t = r["targets"]
    return "\n".join([
        f"vocabulary: a {s['num_layers']}-layer student (hidden {s['hidden_size']}) with Qwen2.5's {s['vocab_size']:,} "
        f"ids, {c['batch']} x {c['tokens']} tokens on {c['device']}: whole logits (loss.vocab_chunk=0) vs chunks of "
        f"{c['chunk']} positions; memory: the student worker's {what} over {c['steps']} steps in a fresh process; "
        f"time: s/step, fastest of {c['rounds']} interleaved rounds",
        format_table(["recipe", "whole GiB", "chunked GiB", "ratio", "whole s", "chunked s", "ratio",
                      f"target (<= {t['memory']} x memory, <= {t['time']:.2f} x time)"], rows)])
