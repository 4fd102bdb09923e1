"""`kava-ray bench step`: what KV distillation adds to a training step, and where the time goes.

Five variants of one optimizer step -- `ce` (plain fine-tuning), `ce+kv structured` (the production
step with the default recipe), `ce+kv flat`, `ce+kv+logits` and `ce+kv+logits cross-vocab` -- on the
same student, batch and optimizer, interleaved over `rounds` in one process, each keeping its
fastest round; profiled steps split the time by phase. Teacher KV is computed beforehand, so only
the student is timed. `memory=True` also measures memory beside `kava-ray plan`. The variants and
the method: docs/internals/runtime.md#bench-step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kava_ray.bench.chunked_loss import chunk_bench, format_chunk_bench
from kava_ray.bench.memory import compare_with_plan
from kava_ray.bench.step_setup import CROSS_COVERAGE, bench_job, kv_stepper, random_batch, sync_device, timed_mean
from kava_ray.common.config import JobConfig, load_config
from kava_ray.common.errors import KavaError
from kava_ray.common.files import format_table
from kava_ray.core.distiller import build_scheduler
from kava_ray.core.kv import student_forward_kv
from kava_ray.core.models import load_model, load_student
from kava_ray.core.precision import student_precision
from kava_ray.data import Batch
from kava_ray.testing.tiny import build_tiny_model

# a small student: ~25% of its forward FLOPs in the LM head, as in Qwen2.5-0.5B (vocab 8192 at hidden 384)
STUDENT = dict(family="qwen2", num_layers=6, hidden_size=384, num_heads=6, num_kv_heads=2, intermediate_size=1024,
               vocab_size=8192)
TEACHER = dict(family="qwen2", num_layers=12, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1536,
               vocab_size=8192)
PLAIN = "ce"
LORA = ["student.lora.r=16", "student.lora.target_modules=all-linear"]  # (TRL's r, every Linear but the head)
# variant -> overrides of the bench job (None: the plain fine-tuning step)
VARIANTS: dict[str, Optional[list[str]]] = {
    PLAIN: None,
    "ce+kv structured": [],
    "ce+kv flat": ["align.mode=flat"],
    "ce+kv+logits": ["loss.logit_weight=1"],
    "ce+kv+logits cross-vocab": ["loss.logit_weight=1"],
    "ce+kv+logits lora": ["loss.logit_weight=1", *LORA],
}
CROSS = "ce+kv+logits cross-vocab"  # its teacher has another vocabulary (CROSS_VOCAB x the student's)
CROSS_VOCAB = 3
PHASES = ("student_forward", "projectors", "fusion_loss", "backward", "optimizer")
TARGET = ("ce+kv structured", 1.25)  # the KV step may cost at most this much more than the plain one
CROSS_TARGET = (CROSS, "ce+kv+logits", 1.1)  # a teacher of another vocabulary vs one of the student's
# recipes whose memory `memory=True` measures (every kind the planner plans)
MEMORY_RECIPES: dict[str, list[str]] = {
    "ce (kv_weight 0)": ["loss.kv_weight=0"],
    "ce+kv structured elastic": [],
    "ce+kv structured linear": ["align.projector.kind=linear"],
    "ce+kv flat elastic": ["align.mode=flat"],
    "ce+kv flat linear": ["align.mode=flat", "align.projector.kind=linear"],
    "ce+kv+logits": ["loss.logit_weight=1"],
    "ce+kv+logits lora": ["loss.logit_weight=1", *LORA],
}


class _Plain:
    """Plain fine-tuning of the student alone, with the recipe's precision and optimizer settings."""

    def __init__(self, cfg: JobConfig, device, batch: Batch):
        self.precision = student_precision(cfg.student, device)
        self.model = load_student(cfg.student.model, dtype=self.precision.weight_dtype).to(device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr_student, weight_decay=o.weight_decay)
        self.sched = build_scheduler(self.opt, o, cfg.train.steps)
        self.grad_clip = o.grad_clip
        self.batch = batch.to(device)

    def step(self) -> None:
        b = self.batch
        with self.precision.autocast(), record_function("kava/student_forward"):  # incl. HF's CE
            out = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
        with record_function("kava/backward"):
            out.loss.backward()
        with record_function("kava/optimizer"):
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or float("inf"))
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _native_stderr_muted():
    """File descriptor 2 to /dev/null: kineto writes a line there at every profiler start and stop."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _profiled(fn, n: int, device) -> dict:
    """Seconds per step of each `kava/*` scope over `n` profiled steps, and the profiled step ("step")."""
    cuda = device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    with _native_stderr_muted():
        prof.start()
    try:
        for _ in range(n):
            with record_function("kava/step"):
                fn()
        sync_device(device)
    finally:
        with _native_stderr_muted():
            prof.stop()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key.startswith("kava/"):
            t = (getattr(e, "device_time_total", 0) if cuda else 0) or e.cpu_time_total  # microseconds
            out[e.key[5:]] = max(out.get(e.key[5:], 0.0), t / 1e6 / n)
    return out


def run_step_bench(steps: int = 4, rounds: int = 3, batch: int = 4, tokens: int = 256, threads: int = 1,
                   profile_steps: int = 1, student: Optional[dict] = None, teacher: Optional[dict] = None,
                   memory: bool = False, memory_steps: int = 2) -> dict:
    """Time every variant side by side (fastest of `rounds` interleaved rounds of `steps` steps),
    break each down by phase, time the KV capture, and with `memory` measure each recipe's memory
    beside the plan."""
    _check_sizes(steps=steps, rounds=rounds, profile_steps=profile_steps, batch=batch, tokens=tokens,
                 threads=threads, memory_steps=memory_steps)
    student, teacher = dict(student or STUDENT), dict(teacher or TEACHER)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base, steppers, plain = _build(Path(tmp), student, teacher, batch, tokens, device)
            precision = plain.precision.policy
            times, prof, fwd = _measure(steppers, plain, base.align.key_space, rounds, steps, profile_steps, device)
    finally:
        torch.set_num_threads(old_threads)
    config = {"steps": steps, "rounds": rounds, "batch": batch, "tokens": tokens, "threads": threads,
              "profile_steps": profile_steps, "memory_steps": memory_steps, "student": student, "teacher": teacher,
              "device": device.type, "precision": precision}
    out = _result(config, times, prof, fwd)
    if memory:
        out["memory"] = memory_table(student=student, teacher=teacher, batch=batch, tokens=tokens,
                                     steps=memory_steps)
        out["chunked_loss"] = chunk_bench(steps=memory_steps)  # Qwen2.5's vocabulary at 4 x 1024 tokens
    return out


def _check_sizes(**sizes: int) -> None:
    """Every size >= 1, or a one-line error naming the first (in the order given) that is not."""
    for name, value in sizes.items():
        if int(value) < 1:
            raise KavaError(f"bench step: {name} must be >= 1, got {value}")


def _build(tmp: Path, student: dict, teacher: dict, batch: int, tokens: int, device) -> tuple:
    """The bench's models in `tmp` (a teacher, the student, a teacher of CROSS_VOCAB x the student's
    vocabulary), its job and batch, and one step function per variant; returns (base job, {variant:
    step}, the plain step)."""
    t_dir = build_tiny_model(tmp / "teacher", **teacher, seed=0)
    s_dir = build_tiny_model(tmp / "student", **student, seed=1)
    base = bench_job(t_dir, s_dir, tmp / "runs", batch, tokens)
    data = random_batch(batch, tokens, min(student["vocab_size"], teacher["vocab_size"]))
    x_dir = build_tiny_model(tmp / "teacher_x", **{**teacher, "vocab_size": CROSS_VOCAB * student["vocab_size"]},
                             seed=0)
    t_models = {"t": load_model(str(t_dir), dtype="float32"), "x": load_model(str(x_dir), dtype="float32")}
    steppers, payloads = {}, {}
    for name, overrides in VARIANTS.items():
        if overrides is None:
            plain = _Plain(base, device, data)
            steppers[name] = plain.step
            continue
        which = "x" if name == CROSS else "t"
        cfg = load_config(base, overrides + ([f"teachers.0.model={x_dir}"] if which == "x" else []))
        steppers[name] = kv_stepper(cfg, t_models[which], which, data, payloads, student["vocab_size"], device)
    return base, steppers, plain


def _measure(steppers: dict, plain: _Plain, key_space, rounds: int, steps: int, profile_steps: int,
             device) -> tuple[dict, dict, dict]:
    """A warm-up step each, then `rounds` interleaved rounds (each starting one variant later):
    every variant timed, then profiled (the least disturbed round kept), then the student's forward
    without and with the KV capture (alternating which goes first); returns ({variant: [s]},
    {variant: phases}, {forward: [s]})."""
    names = list(steppers)
    for fn in steppers.values():  # warm-up: first-step allocations, the optimizer's states
        fn()
    times: dict[str, list] = {n: [] for n in names}
    prof: dict[str, dict] = {}
    fwd: dict[str, list] = {"plain": [], "capture": []}
    pair = _forwards(plain, key_space)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            times[n].append(timed_mean(steppers[n], steps, device))
        for n in order:  # the breakdown: separate profiled steps; the least disturbed round is kept
            p = _profiled(steppers[n], profile_steps, device)
            if n not in prof or p["step"] < prof[n]["step"]:
                prof[n] = p
        for k, fn in (pair if r % 2 == 0 else pair[::-1]):
            fwd[k].append(timed_mean(fn, steps, device))
    return times, prof, fwd


def _forwards(plain: _Plain, key_space) -> list:
    """The student's forward on the bench's batch without and with the KV capture hooks
    (`student_forward_kv`): [("plain", fn), ("capture", fn)], the capture's cost the difference."""
    ids, mask = plain.batch.input_ids, plain.batch.attention_mask

    def forward_plain():
        with plain.precision.autocast():
            plain.model(input_ids=ids, attention_mask=mask)

    def forward_capture():
        with plain.precision.autocast():
            student_forward_kv(plain.model, ids, mask, key_space=key_space)

    return [("plain", forward_plain), ("capture", forward_capture)]


def _result(config: dict, times: dict, prof: dict, fwd: dict) -> dict:
    """The JSON-able result: per variant its fastest round, its ratio to the plain step and its
    phases (the profiled step's remainder as "other_s"), the capture's overhead, and both
    targets."""
    plain_s = min(times[PLAIN])
    variants = {}
    for n in times:
        p = prof[n]
        phases = {ph: p[ph] for ph in PHASES if ph in p}
        variants[n] = {"step_s": min(times[n]), "rounds_s": times[n], "ratio": min(times[n]) / plain_s,
                       "phases_s": phases, "profiled_step_s": p["step"], "other_s": p["step"] - sum(phases.values())}
    f_plain, f_cap = min(fwd["plain"]), min(fwd["capture"])
    target, limit = TARGET
    out = {
        "config": config,
        "variants": variants,
        "capture": {"forward_s": f_plain, "forward_capture_s": f_cap, "overhead": f_cap / f_plain - 1},
        "target": {"variant": target, "max_ratio": limit, "ratio": variants[target]["ratio"],
                   "met": variants[target]["ratio"] <= limit},
    }
    cross, same, limit = CROSS_TARGET
    ratio = variants[cross]["step_s"] / variants[same]["step_s"]
    out["cross_vocab"] = {"variant": cross, "against": same, "max_ratio": limit, "ratio": ratio, "met": ratio <= limit,
                          "teacher_vocab": CROSS_VOCAB * config["student"]["vocab_size"],
                          "student_coverage": CROSS_COVERAGE}
    return out


def memory_table(student: Optional[dict] = None, teacher: Optional[dict] = None, batch: int = 4,
                 tokens: int = 256, steps: int = 2, recipes: Optional[dict] = None) -> dict:
    """{recipe: {"device", "measured", "planned", "error"}}: each recipe of the bench job measured
    in a fresh process (`kava_ray.bench.memory.compare_with_plan`) beside `kava-ray plan`'s
    estimate."""
    student, teacher = dict(student or STUDENT), dict(teacher or TEACHER)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        t_dir = build_tiny_model(Path(tmp) / "teacher", **teacher, seed=0)
        s_dir = build_tiny_model(Path(tmp) / "student", **student, seed=1)
        base = bench_job(t_dir, s_dir, Path(tmp) / "runs", batch, tokens)
        for name, overrides in (recipes or MEMORY_RECIPES).items():
            out[name] = compare_with_plan(load_config(base, overrides), steps=steps)
    return out


def _ms(s: float) -> str:
    return f"{1000 * s:.0f}" if s >= 0.01 else f"{1000 * s:.1f}"


def format_step_bench(r: dict) -> str:
    c, s = r["config"], r["config"]["student"]
    t = c["teacher"]
    out = [f"step bench: {s['num_layers']}-layer Qwen2 student (hidden {s['hidden_size']}, vocab {s['vocab_size']}), "
           f"{t['num_layers']}-layer teacher (hidden {t['hidden_size']}), batch {c['batch']} x {c['tokens']} tokens, "
           f"{c['precision']} on {c['device']}, {c['threads']} thread(s); fastest of {c['rounds']} interleaved rounds "
           f"x {c['steps']} steps",
           "phases: ms per step in separately profiled steps (torch.profiler, kava/* scopes)"]
    heads = ["variant", "ms/step", "vs ce", "fwd", "proj", "fusion+loss", "backward", "optim", "other"]
    rows = []
    for name, v in r["variants"].items():
        ph = v["phases_s"]
        rows.append([name, _ms(v["step_s"]), f"{v['ratio']:.2f}"]
                    + [_ms(ph[p]) if p in ph else "-" for p in PHASES] + [_ms(v["other_s"])])
    out.append(format_table(heads, rows))
    cap = r["capture"]
    out.append(f"KV capture: student training forward {_ms(cap['forward_s'])} ms without hooks, "
               f"{_ms(cap['forward_capture_s'])} ms with (student_forward_kv): {100 * cap['overhead']:+.1f} %")
    tg = r["target"]
    out.append(f"target: {tg['variant']} <= {tg['max_ratio']:.2f} x ce: {tg['ratio']:.2f} "
               f"({'met' if tg['met'] else 'NOT met'})")
    x = r["cross_vocab"]
    out.append(f"target: {x['variant']} (teacher vocab {x['teacher_vocab']}, map reaching "
               f"{100 * x['student_coverage']:.0f} % of the student's ids) <= {x['max_ratio']:.2f} x {x['against']}: "
               f"{x['ratio']:.2f} ({'met' if x['met'] else 'NOT met'})")
    if r.get("memory"):
        mem = r["memory"]
        dev = next(iter(mem.values()))["device"]
        what = "peak RSS growth" if dev == "cpu" else "torch.cuda.max_memory_allocated"
        mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
        rows = [[n, mib(m["measured"]), mib(m["planned"]), f"{100 * m['error']:+.0f} %",
                 mib(m["teacher"]["measured"]), mib(m["teacher"]["planned"]), f"{100 * m['teacher']['error']:+.0f} %"]
                for n, m in mem.items()]
        out += ["", f"memory in MiB, {c['batch']} x {c['tokens']} tokens, each in a fresh process: the student "
                    f"worker's {what} over {c.get('memory_steps', 2)} steps, the teacher's peak RSS growth over its "
                    f"forwards; beside kava-ray plan's items (with its CPU allocator slack):",
                format_table(["recipe", "student measured", "plan", "error", "teacher measured", "plan", "error"],
                             rows)]
    if r.get("chunked_loss"):
        out += ["", format_chunk_bench(r["chunked_loss"])]
    return "\n".join(out)
