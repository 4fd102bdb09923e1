"""`kava-ray bench feed`: does the KVFeed hide teacher time behind the student's step, in every regime?

S: one production step alone; T: one teacher's round trip alone; pipelined: the KVFeed at depth 1,
2, 4. Overlap efficiency = max(T_slowest, S) / pipelined step. Regimes (timed and real teachers,
replicas, cross-node, early stop, transport): docs/internals/runtime.md#bench-feed.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import ray
import torch

from actors.pool import TeacherReplicas
from kava_ray.bench.cross_node import format_cross_node
from kava_ray.bench.timed_teacher import TimedTeacher
from kava_ray.common.config import JobConfig, validate_config
from kava_ray.common.files import format_table
from kava_ray.common.resources import embedded_cpus
from kava_ray.core.kv import KVBatch, teacher_forward_kv
from kava_ray.core.models import kv_geometry, load_model, load_model_config
from kava_ray.core.plans import student_geometry, student_tokenizer, teacher_plans
from kava_ray.data.batching import Batch, batch_key
from kava_ray.recipes.distill import DistillRecipe
from kava_ray.rollout.feed import ActorSource, KVFeed, get_kv
from kava_ray.runtime.connect import connect, disconnect
from kava_ray.runtime.console import status
from kava_ray.runtime.job import job_teachers
from kava_ray.testing.tiny import build_tiny_model

TEACHER = dict(family="qwen2", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=2)
STUDENT = dict(family="qwen2", num_layers=6, hidden_size=192, num_heads=6, num_kv_heads=2)
SPEED_STEPS = (1.0, 0.5, 0.25)  # teacher i of a multi-teacher regime runs at this fraction of the slowest's T


def bench_config(t_dirs: dict, s_dir: Path, storage: Path) -> JobConfig:
    """The bench's job: tiny teachers {name: dir} and student, structured linear projector, Mercator + CE, AdamW."""
    return validate_config({
        "name": "bench-feed",
        "teachers": [{"name": n, "model": str(d), "dtype": "float32"} for n, d in t_dirs.items()],
        "student": {"model": str(s_dir), "dtype": "float32"},
        "data": {"num_train": 8, "num_test": 4, "num_val": 4},
        "align": {"mode": "structured", "projector": {"kind": "linear", "dropout": 0.0}},
        "optim": {"lr_student": 1e-4, "lr_projector": 1e-4, "warmup_steps": 0, "schedule": "constant"},
        "ray": {"namespace": "kava-bench", "storage_path": str(storage), "num_workers": 1, "use_gpu": False},
    })


def _batches(n: int, batch: int, tokens: int, vocab: int, seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab - 4, (batch, tokens), generator=g)
        mask = torch.ones_like(ids)
        out.append(Batch(input_ids=ids, attention_mask=mask, labels=ids.clone(), answer_mask=mask))
    return out


def _items(batches, keyed: bool):
    """KVFeed items. keyed: batch keys as training uses them (routing to replicas); else None (a
    real teacher's LRU would otherwise answer a repeated run from memory)."""
    for i, b in enumerate(batches):
        yield (batch_key("bench", 0, i) if keyed else None), b.input_ids.numpy(), b.attention_mask.numpy(), b


class _Student:
    """One production training step (DistillRecipe.step, rank 0) for a set of teacher plans."""

    def __init__(self, cfg: JobConfig, plans: dict):
        self.recipe = DistillRecipe(cfg, plans)
        self.recipe.setup()
        self.n = 0

    def step(self, batch: dict, kv: dict) -> None:
        self.n += 1
        self.recipe.step(self.n, [(batch, kv)])

    def alone(self, data: list, payloads: list) -> float:
        """S: per step, on payloads already received (decoding them is part of the step, as in the feed)."""
        t0 = time.perf_counter()
        for b, p in zip(data, payloads):
            self.step(b, {n: KVBatch.from_wire(w) for n, w in p.items()})
        return (time.perf_counter() - t0) / len(data)

    def pipelined(self, source, layers: dict, data: list, depth: int, keyed: bool) -> float:
        """Per step in steady state: the time between the first and the last delivered batch over
        the steps between them (the pipeline's fill before the first batch is not a per-step
        cost)."""
        feed = iter(KVFeed(source, _items(data, keyed), layers, depth=depth))
        t0 = None
        for b, kv in feed:
            t_last = time.perf_counter()
            t0 = t0 or t_last
            self.step(b, kv)
        return (t_last - t0) / (len(data) - 1)

    def sequential(self, handles: dict, layers: dict, data: list) -> float:
        """Ask, wait, then train (the predecessor's loop): ~T + S per step."""
        t0 = time.perf_counter()
        for key, ids, mask, b in _items(data, keyed=False):
            payloads = get_kv([h.kv.remote(key, ids, mask, layers[n], "bf16") for n, h in handles.items()])
            self.step(b, {n: KVBatch.from_wire(w) for n, w in zip(handles, payloads)})
        return (time.perf_counter() - t0) / len(data)


def _teacher_alone(handle, layers, data: list, keyed: bool) -> float:
    """T: one teacher's round trips, back to back, nothing else running (after one unmeasured
    request: a new actor's first call pays its start)."""
    key, ids, mask, _ = next(_items(data[:1], keyed))
    get_kv(handle.kv.remote(key, ids, mask, layers, "bf16"))
    t0 = time.perf_counter()
    for key, ids, mask, _ in _items(data, keyed):
        get_kv(handle.kv.remote(key, ids, mask, layers, "bf16"))
    return (time.perf_counter() - t0) / len(data)


def _log(msg: str, t0: float) -> None:
    """One progress line on the console (the tables go to stdout)."""
    status(f"bench feed [{time.perf_counter() - t0:5.0f} s] {msg}")


def _local_payloads(plans: dict, data: list) -> list[dict]:
    """Wire payloads shaped like the teachers' (what S consumes; their values do not change its cost)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for b in data:
        B, T = b.input_ids.shape
        p = {}
        for n, plan in plans.items():
            shape = (len(plan.layers), B, plan.geometry.num_kv_heads, T, plan.geometry.head_dim)
            p[n] = KVBatch(torch.randn(shape, generator=g), torch.randn(shape, generator=g), plan.layers,
                           b.attention_mask.bool(), "pre_rope").to_wire("bf16")
        out.append(p)
    return out


def _timed_regimes(t_dir, s_dir, storage, data, ratios, teacher_counts, depths, t0: float) -> tuple[list, dict]:
    """The timed-teacher regime table, and the one-teacher student (S, plans, cfg) the replica part reuses."""
    rows, one = [], {}
    s_fp = student_tokenizer(bench_config({"t": t_dir}, s_dir, storage).student)[1]
    geom = dict(kv_geometry(load_model_config(str(t_dir))).to_dict(), tokenizer_fingerprint=s_fp)
    for k in teacher_counts:
        names = [f"t{i}" for i in range(k)]
        cfg = bench_config({n: t_dir for n in names}, s_dir, storage)
        plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, {n: geom for n in names},
                              student_geometry(cfg.student), s_fp)
        layers = {n: p.layers for n, p in plans.items()}
        student = _Student(cfg, plans)
        payloads = _local_payloads(plans, data)
        student.alone(data[:1], payloads[:1])  # warm-up
        S = student.alone(data, payloads)
        actors = {n: TimedTeacher.remote(geom, 0.0, seed=i) for i, n in enumerate(names)}
        source = ActorSource(actors)
        for r in ratios:
            delays = [r * S * SPEED_STEPS[i] for i in range(k)]
            ray.get([actors[n].set_delay.remote(d) for n, d in zip(names, delays)])
            T = [_teacher_alone(actors[n], layers[n], data[: max(3, len(data) // 4)], keyed=True) for n in names]
            pipe = {d: student.pipelined(source, layers, data, d, keyed=True) for d in depths}
            best = max(max(T), S)
            rows.append({"mode": "timed", "teachers": k, "t_over_s_target": r, "T_s": T, "S_s": S,
                         "t_over_s": max(T) / S, "pipelined_s": {str(d): p for d, p in pipe.items()},
                         "efficiency": {str(d): best / p for d, p in pipe.items()},
                         "step_over_slowest_teacher": {str(d): p / max(T) for d, p in pipe.items()}})
        for a in actors.values():
            ray.kill(a)
        _log(f"timed regimes, {k} teacher(s)", t0)
        if k == 1:
            one = {"S": S, "plans": plans, "cfg": cfg, "student": student, "geom": geom, "layers": layers}
    return rows, one


def _replica_scaling(one: dict, data: list, ratio: float, replicas) -> list[dict]:
    """One teacher at T/S = ratio behind N replicas (depth 2N): step time vs max(T / N, S)."""
    S, student, layers, geom = one["S"], one["student"], one["layers"], one["geom"]
    rows = []
    for n in replicas:
        actors = [TimedTeacher.remote(geom, ratio * S, seed=i) for i in range(n)]
        T = _teacher_alone(actors[0], layers["t0"], data[:3], keyed=True)
        source = ActorSource({"t0": TeacherReplicas("t0", actors)})
        depth = 2 * n
        before = [st["forwards"] for st in ray.get([a.stats.remote() for a in actors])]
        step = student.pipelined(source, layers, data, depth, keyed=True)
        expected = max(T / n, S)
        served = [st["forwards"] - b for st, b in zip(ray.get([a.stats.remote() for a in actors]), before)]
        rows.append({"replicas": n, "depth": depth, "T_s": T, "S_s": S, "step_s": step, "expected_s": expected,
                     "step_over_expected": step / expected, "forwards_per_replica": served})
        for a in actors:
            ray.kill(a)
    return rows


def _real_teachers(tmp: Path, s_dir, storage, data, layer_counts, depths) -> list[dict]:
    """The production teacher actor with a real tiny model (one thread), at a few sizes."""
    rows = []
    for L in layer_counts:
        t_dir = build_tiny_model(tmp / f"teacher{L}", **dict(TEACHER, num_layers=L), seed=0)
        cfg = bench_config({"t": t_dir}, s_dir, storage)
        with job_teachers(cfg) as job:  # named, with restarts: what `kava-ray train` talks to (this Ray stays up)
            handles, plans = job.handles, job.plans
            layers = {"t": plans["t"].layers}
            student = _Student(cfg, plans)
            payloads = [{"t": get_kv(handles["t"].kv.remote(None, b.input_ids.numpy(), b.attention_mask.numpy(),
                                                             layers["t"], "bf16"))}
                        for b in data]
            student.alone(data[:1], payloads[:1])  # warm-up
            S = student.alone(data, payloads)
            T = _teacher_alone(handles["t"], layers["t"], data, keyed=False)
            seq = student.sequential(handles, layers, data)
            pipe = {d: student.pipelined(ActorSource(handles), layers, data, d, keyed=False) for d in depths}
        best = max(T, S)
        rows.append({"mode": "real", "teachers": 1, "teacher_layers": L, "served_layers": layers["t"],
                     "T_s": [T], "S_s": S, "t_over_s": T / S, "sequential_s": seq,
                     "pipelined_s": {str(d): p for d, p in pipe.items()},
                     "efficiency": {str(d): best / p for d, p in pipe.items()},
                     "step_over_slowest_teacher": {str(d): p / T for d, p in pipe.items()}})
    return rows


def _early_stop(t_dir: Path, batch: int, tokens: int, rounds: int = 3, reps: int = 6) -> dict:
    """Teacher ms per batch serving the first half of its layers: the whole forward vs stopped at the last served."""
    model = load_model(str(t_dir), dtype="float32")
    n = kv_geometry(model).num_layers
    layers = list(range(n // 2))
    ids = torch.randint(0, 200, (batch, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    times: dict = {False: [], True: []}
    for _ in range(rounds):
        for stop in (False, True):
            teacher_forward_kv(model, ids, mask, layers=layers, stop_early=stop)
            t0 = time.perf_counter()
            for _ in range(reps):
                teacher_forward_kv(model, ids, mask, layers=layers, stop_early=stop)
            times[stop].append((time.perf_counter() - t0) / reps)
    full, stopped = min(times[False]), min(times[True])
    return {"teacher_layers": n, "served_layers": layers, "full_ms": 1000 * full, "stopped_ms": 1000 * stopped,
            "stopped_over_full": stopped / full}


def run_feed_bench(steps: int = 12, batch: int = 4, tokens: int = 128, depths=(1, 2, 4),
                   ratios=(0.25, 0.5, 1.0, 2.0, 4.0), teacher_counts=(1, 2, 3), replicas=(1, 2, 4),
                   replica_ratio: float = 4.0, replica_steps: int = 16, real_layers=(8, 32), transport_mib: int = 64,
                   repeats: int = 15, cross_node: bool = True, transport_warmup_bytes: Optional[int] = None) -> dict:
    """Every measurement once, side by side in one Ray; returns the figures (seconds per step, bytes/s)."""
    torch.set_num_threads(1)
    started_ray = not ray.is_initialized()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            t_dir = build_tiny_model(tmp / "teacher", **TEACHER, seed=0)
            s_dir = build_tiny_model(tmp / "student", **STUDENT, seed=1)
            storage = tmp / "runs"
            if started_ray:  # sized by the one rule every command uses (the transport probe takes the worker's CPU)
                connect(None, "kava-bench", num_cpus=embedded_cpus(bench_config({"t": t_dir}, s_dir, storage)),
                        worker_env={"OMP_NUM_THREADS": "1"})
            data = _batches(steps, batch, tokens, 256)
            t0 = time.perf_counter()
            early = _early_stop(t_dir, batch, tokens)
            _log("teacher early stop", t0)
            timed, one = _timed_regimes(t_dir, s_dir, storage, data, ratios, teacher_counts, depths, t0)
            scaling = _replica_scaling(one, _batches(replica_steps, batch, tokens, 256), replica_ratio,
                                       replicas) if one else []
            _log("replica scaling", t0)
            real = _real_teachers(tmp, s_dir, storage, data, real_layers, depths)
            _log("real teachers", t0)
            transport = _transport(transport_mib, repeats, transport_warmup_bytes)
            _log("transport", t0)
        nodes = _cross_node(steps) if cross_node else None
        if nodes:
            _log("cross node", t0)
    finally:
        if started_ray:
            disconnect()
    return {
        "config": {"steps": steps, "batch": batch, "tokens": tokens, "teacher": TEACHER, "student": STUDENT,
                   "threads": "1 per teacher + 1 student", "speed_steps": list(SPEED_STEPS),
                   "replica_ratio": replica_ratio},
        "regimes": timed + real, "replicas": scaling, "early_stop": early, "transport": transport,
        "cross_node": nodes,
    }


def _cross_node(steps: int) -> dict:
    """The cross-node regime, in a subprocess of its own (its cluster is another Ray than this driver's)."""
    out = subprocess.run([sys.executable, "-m", "kava_ray.bench.cross_node", "--json", "--steps", str(steps)],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the cross-node regime failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@ray.remote(num_cpus=1)
class TransportProbe:
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

    def put_faults(self) -> tuple[float, int]:
        """(seconds, minor page faults) of this process writing one wire payload into the object store."""
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        ref = ray.put(self.kv.to_wire("bf16"))
        out = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        del ref
        return out


def _transport(mib: int, repeats: int, warmup_bytes: Optional[int] = None, cold: int = 5) -> dict:
    """The wire payload actor -> driver against pickled torch and a memcpy, on a fresh actor: its first `cold`
    payloads (a process's first writes into object-store memory fault in every 4 KiB page of its mapping:
    `kava_ray.bench.object_store`), then, after `warmup_bytes` of traffic (default: the object store's size +
    25 %, at most 16 GiB: the actor has then written all of it), the steady state a run spends its steps in.
    Minor page faults of one put, first and steady, say where the difference goes."""
    probe = TransportProbe.remote(mib)
    nbytes = ray.get(probe.nbytes.remote())
    if warmup_bytes is None:
        warmup_bytes = min(int(1.25 * ray.cluster_resources().get("object_store_memory", 0)), 16 * 2**30)
    warmup = max(10, -(-warmup_bytes // nbytes))

    def once(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def timed(fn, warm: int = warmup) -> float:
        for _ in range(warm):
            fn()
        return nbytes / statistics.median(once(fn) for _ in range(repeats))

    def wire():  # the received numpy buffers viewed as torch tensors: what `from_wire` starts from
        p = ray.get(probe.wire.remote())
        return [torch.from_numpy(p[n]).view(torch.bfloat16) for n in ("k", "v")]

    def pickled():
        t = ray.get(probe.tensors.remote())
        return [t["k"], t["v"]]

    first_put = ray.get(probe.put_faults.remote())
    first = nbytes / statistics.median(once(wire) for _ in range(cold))
    src = np.random.default_rng(0).integers(0, 2**16, nbytes // 2, dtype=np.uint16)
    dst = np.empty_like(src)
    out = {"bytes": nbytes, "wire_first_Bps": first, "wire_Bps": timed(wire), "torch_pickle_Bps": timed(pickled, 10),
           "memcpy_Bps": timed(lambda: np.copyto(dst, src), 10), "warmup_bytes": warmup * nbytes}
    steady_put = ray.get(probe.put_faults.remote())
    out.update(put_first_s=first_put[0], put_first_faults=first_put[1], put_steady_s=steady_put[0],
               put_steady_faults=steady_put[1])
    out["wire_over_pickle"] = out["wire_Bps"] / out["torch_pickle_Bps"]
    out["wire_over_memcpy"] = out["wire_Bps"] / out["memcpy_Bps"]
    out["wire_first_over_memcpy"] = out["wire_first_Bps"] / out["memcpy_Bps"]
    ray.kill(probe)
    return out


def _ms(s: float) -> str:
    return f"{1000 * s:.0f} ms"


def format_feed_bench(r: dict) -> str:
    c = r["config"]
    depths = list(r["regimes"][0]["pipelined_s"]) if r["regimes"] else []
    out = [f"feed bench: {c['steps']} steps of {c['batch']} x {c['tokens']} tokens, {c['threads']}; steady state",
           "overlap efficiency max(T_slowest, S) / pipelined step (1.00 = teacher time hidden); "
           "step / T_slowest where teachers are the bottleneck",
           "timed: teachers on GPUs of their own, stood in by a fixed delay (several teachers: the others at "
           f"{', '.join(f'{x:g}' for x in c['speed_steps'][1:])} of the slowest's T); real: the production teacher "
           "actor on this CPU"]
    rows = []
    for g in r["regimes"]:
        label = f"{g['mode']} {g['teachers']}" + (f" ({g['teacher_layers']} layers)" if g["mode"] == "real" else "")
        bottleneck = g["t_over_s"] > 1
        rows.append([label, f"{g['t_over_s']:.2f}", _ms(max(g["T_s"])), _ms(g["S_s"])]
                    + [_ms(g["pipelined_s"][d]) for d in depths]
                    + [f"{g['efficiency'][d]:.2f}" for d in depths]
                    + [f"{g['step_over_slowest_teacher']['2']:.2f}" if bottleneck and "2" in depths else "—"])
    out.append(format_table(["teachers", "T/S", "T slowest", "S"] + [f"step d{d}" for d in depths]
                            + [f"eff d{d}" for d in depths] + ["step/T d2"], rows))
    if r["replicas"]:
        out += ["", f"replica scaling (timed, one teacher at T/S = {c['replica_ratio']:g}, depth 2N, batches routed "
                    "by key):",
                format_table(["replicas N", "T", "S", "step", "max(T/N, S)", "step / max(T/N, S)",
                              "forwards per replica"],
                             [[str(x["replicas"]), _ms(x["T_s"]), _ms(x["S_s"]), _ms(x["step_s"]), _ms(x["expected_s"]),
                               f"{x['step_over_expected']:.2f}", "/".join(map(str, x["forwards_per_replica"]))]
                              for x in r["replicas"]])]
    e = r["early_stop"]
    out += ["", f"teacher forward serving layers {e['served_layers'][0]}-{e['served_layers'][-1]} "
                f"of {e['teacher_layers']}: "
                f"whole {e['full_ms']:.1f} ms, stopped after the last served layer {e['stopped_ms']:.1f} ms "
                f"({e['stopped_over_full']:.2f}x)"]
    t = r["transport"]
    gbs = lambda b: f"{b / 1e9:.2f} GB/s"  # noqa: E731
    out += ["", f"transport of one {t['bytes'] / 2**20:.0f} MiB bf16 KV payload, actor -> driver (median; steady: "
                f"after {t['warmup_bytes'] / 2**30:.1f} GiB of traffic):",
            format_table(["path", "throughput", "vs memcpy"], [
                ["wire (numpy views), steady", gbs(t["wire_Bps"]), f"{t['wire_over_memcpy']:.2f}"],
                ["wire, the actor's first payloads", gbs(t["wire_first_Bps"]), f"{t['wire_first_over_memcpy']:.2f}"],
                ["pickled torch tensors", gbs(t["torch_pickle_Bps"]), f"{t['torch_pickle_Bps'] / t['memcpy_Bps']:.2f}"],
                ["in-process memcpy", gbs(t["memcpy_Bps"]), "1.00"]]),
            f"wire is {t['wire_over_pickle']:.1f}x pickled torch and {100 * t['wire_over_memcpy']:.0f}% of memcpy; "
            f"one put into the object store: first {1000 * t['put_first_s']:.1f} ms with {t['put_first_faults']} page "
            f"faults, steady {1000 * t['put_steady_s']:.1f} ms with {t['put_steady_faults']}"]
    if r.get("cross_node"):
        out += ["", format_cross_node(r["cross_node"])]
    return "\n".join(out)
