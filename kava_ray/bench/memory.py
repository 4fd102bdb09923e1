"""Measured memory of a job's student worker and teacher beside `kava-ray plan`'s estimate.

`measure_peak(cfg, steps)` runs the teachers' forwards, then the student worker's steps, in a fresh
Python process, each from a settled baseline; `compare_with_plan` sets them beside the planner's
items. The method: docs/internals/runtime.md#bench-memory.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kava_ray.common.config import JobConfig, derive, load_config
from kava_ray.common.errors import KavaError
from kava_ray.core.kv import KVBatch, teacher_forward_kv
from kava_ray.core.models import load_model, load_student
from kava_ray.core.plans import teacher_logits_top_k
from kava_ray.core.precision import student_precision
from kava_ray.data.batching import Batch
from kava_ray.recipes.distill import DistillRecipe
from kava_ray.recipes.fit_maps import fit_on
from kava_ray.runtime.planner import RUNTIME_BYTES, cpu_allocator_slack, plan
from kava_ray.testing.inprocess_source import in_process_plans


def measure_peak(cfg: JobConfig, steps: int = 2, threads: int = 2, timeout: float = 300) -> dict:
    """{"device": "cpu" | "cuda", "peak": bytes} of `steps` steps of `cfg`, measured in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.yaml"
        job.write_text(cfg.to_yaml())
        out = subprocess.run([sys.executable, "-m", "kava_ray.bench.memory", str(job), str(int(steps))],
                             capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise KavaError(f"memory measurement of {cfg.name} failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def planned_bytes(cfg: JobConfig, device: str) -> dict:
    """{"student", "teacher"}: what the planner says `measure_peak` measures (see the module docstring)."""
    def with_slack(items: dict) -> int:  # the planner's CPU rule, on one process's items
        return sum(items.values()) + cpu_allocator_slack(items)

    on_cpu = {f"teachers.{i}.num_gpus": 0 for i in range(len(cfg.teachers))}
    items = plan(derive(cfg, {"ray.use_gpu": False, **on_cpu}))["devices"]["cpu"]["items"]
    teacher = {k: v for k, v in items.items() if k.startswith("teacher:")}
    out = {"teacher": with_slack(teacher)}
    if device == "cpu":  # the student worker's items: not the teachers', not the cpu device's slack
        out["student"] = with_slack({k: v for k, v in items.items() if k not in teacher and "slack" not in k})
    else:
        gpu = derive(cfg, {"ray.use_gpu": True, "ray.gpus_per_worker": 1, "ray.num_workers": 1,
                            "ray.strategy": "ddp", **on_cpu})  # one unsharded worker
        out["student"] = plan(gpu)["devices"]["student worker"]["total"] - RUNTIME_BYTES
    return out


def compare_with_plan(cfg: JobConfig, steps: int = 2, threads: int = 2) -> dict:
    """The student worker's {"device", "measured", "planned", "error"} and the same for its teachers
    under "teacher" (on the CPU); error = (planned - measured) / measured."""
    m = measure_peak(cfg, steps, threads)
    p = planned_bytes(cfg, m["device"])

    def row(measured: int, planned: int) -> dict:
        return {"measured": measured, "planned": planned, "error": (planned - measured) / measured}

    return {"device": m["device"], **row(m["peak"], p["student"]),
            "teacher": {"device": "cpu", **row(m["teacher_peak"], p["teacher"])}}


# ----------------------------------------------------------------------------- the measuring process


def _settled() -> int:
    """Free what is garbage, hand freed heap back to the OS, reset the peak RSS; the RSS now (bytes)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    """The peak RSS since the last `_settled` (bytes): VmHWM. Not getrusage's ru_maxrss, which also
    keeps the peak of the process this one was forked from (a large pytest or bench process:
    measured 1.6 GiB here)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise KavaError("no VmHWM in /proc/self/status: the memory measurement needs Linux")


def _batch(gen: torch.Generator, B: int, T: int) -> Batch:
    """A random batch [B, T], the first sequence half padding (real batches are padded), the first quarter prompt."""
    ids = torch.randint(0, 256, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, T // 2:] = 0
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, : T // 4] = -100  # prompt tokens
    return Batch(input_ids=ids, attention_mask=mask, labels=labels, answer_mask=(labels != -100).long())


def _run(job: str, steps: int) -> dict:
    """The measuring process: the job's teacher payloads first (then the teachers are freed), then
    the student worker's Distiller and optimizer, `steps` steps, reading each payload as the KVFeed
    receives it."""
    cfg = load_config(job)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    precision = student_precision(cfg.student, device)
    B, T = cfg.train.batch_size, cfg.train.max_length
    accum, depth = cfg.optim.accumulation, cfg.align.prefetch_depth + 1
    gen = torch.Generator().manual_seed(0)

    # warm up one-time allocations (lazy imports, kernels), then hand freed heap back to the OS
    warm = load_student(cfg.student.model, dtype="float32")
    warm(input_ids=torch.ones(1, 8, dtype=torch.long)).logits.sum().backward()
    del warm
    base = _settled()

    # the teachers' side first, alone (a teacher actor's process): what each sends for every batch
    # (the shipped layers, and top-k log-probs when the loss uses logits) in the wire format,
    # pickled: bytes inside the baseline, unpickled into new arrays inside the measurement as a
    # KVFeed receives them
    teachers = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    plans = in_process_plans(cfg, teachers)
    top_k = teacher_logits_top_k(cfg.loss, plans)
    batches = [_batch(gen, B, T) for _ in range(steps * accum + depth - 1)]
    sent = [pickle.dumps({n: teacher_forward_kv(teachers[n], b.input_ids, b.attention_mask, layers=p.layers,
                                                logits_top_k=top_k[n]).to_wire(cfg.align.wire_dtype)
                          for n, p in plans.items()}, protocol=5) for b in batches]
    teacher_peak = _peak() - base
    del teachers
    base = _settled()  # then the student worker's, alone

    recipe = DistillRecipe(cfg, plans, device=device)
    recipe.build_model()  # the student, Distiller and optimizer a Train worker builds
    # projector kind fit (auto for a student of the teacher's geometry trained apart): its
    # student-side map is fitted before step 1, as a Train worker does
    # (`recipes.fit_maps.fit_maps`); here on the first batch
    fit_on(recipe.distiller, [(batches[0], {n: KVBatch.from_wire(w, device=device, dtype=torch.float32)
                                      for n, w in pickle.loads(sent[0]).items()})], cfg.align.key_space, device)
    distiller, opt = recipe.distiller, recipe.opt
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    inflight = collections.deque()  # like KVFeed: prefetch_depth batches stay in flight, received as wire payloads
    pending = iter(range(len(batches)))
    for _ in range(steps):
        for _ in range(accum):
            while len(inflight) < depth:
                i = next(pending)
                inflight.append((batches[i], pickle.loads(sent[i])))
            b, payload = inflight.popleft()
            kv = {n: KVBatch.from_wire(w, device=device, dtype=torch.float32) for n, w in payload.items()}
            del payload
            with precision.autocast():
                loss = distiller(b.to(device), kv).loss
            del kv
            (loss / accum).backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        return {"device": "cuda", "peak": torch.cuda.max_memory_allocated(), "teacher_peak": teacher_peak}
    return {"device": "cpu", "peak": _peak() - base, "teacher_peak": teacher_peak}


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[1], int(sys.argv[2]))))
