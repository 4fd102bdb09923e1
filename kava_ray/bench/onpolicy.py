"""`kava-ray bench onpolicy`: does one-step-off sampling (`onpolicy.lag: 1`) hide the teachers' scoring?

The production DistillRecipe and KVFeed with `onpolicy.fraction: 1` on tiny models: the student
samples each batch's completions on this process and trains; the teachers are timed stand-ins for
teachers on GPUs of their own -- each answers the production request with the real tiny teacher's
payload (KV, top-k, token log-probs), padded to `D` seconds per batch in a thread of its own (one
batch at a time, like an actor), so they use no CPU while "busy". First lag 0 with D = 0 measures S
(sampling) and T (training) per step; then D is set to S + T (the regime where overlap matters most:
hidden, the step is max(S + T, D); serial, S + T + D), and lag 0 and lag 1 run side by side.

`--engine hf vllm` (`run_engine_bench`): the same student, prompts and lengths sampled by each
`onpolicy.engine` (Hugging Face generate; vLLM colocated in this process, weights pushed each
round), the step at lag 0 and lag 1 with instant teachers, and a teacher's scoring of the same
sequences (HF forward + top-k against vLLM prompt log-probs).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kava_ray.bench.engines import scoring_rates
from kava_ray.common.config import validate_config
from kava_ray.common.files import format_table
from kava_ray.core.kv import teacher_forward_kv
from kava_ray.core.metric_names import SAMPLE_S, TEACHER_WAIT_S
from kava_ray.core.models import load_model
from kava_ray.recipes.distill import DistillRecipe
from kava_ray.runtime.console import status
from kava_ray.testing.inprocess_source import in_process_plans
from kava_ray.testing.tiny import build_tiny_model

TEACHER = dict(family="qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
STUDENT = dict(family="qwen2", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2)


class TimedSource:
    """KV source of teachers each busy `delay_s` per batch (their real tiny forward, then asleep),
    one batch at a time per teacher in its own thread: `submit` starts the work, `result` waits for
    it."""

    def __init__(self, models: dict, delay_s: float):
        self.models, self.delay_s = models, float(delay_s)
        self.pools = {n: ThreadPoolExecutor(max_workers=1) for n in models}

    def _serve(self, name: str, r) -> dict:
        t0 = time.perf_counter()
        kv = teacher_forward_kv(self.models[name], torch.as_tensor(r.input_ids), torch.as_tensor(r.attention_mask),
                                layers=r.layers, logits_top_k=r.logits_top_k, token_logprobs=r.token_logprobs)
        payload = kv.to_wire(r.wire_dtype)
        time.sleep(max(0.0, self.delay_s - (time.perf_counter() - t0)))
        return payload

    def submit(self, name: str, request):
        return self.pools[name].submit(self._serve, name, request)

    def result(self, name: str, request, future) -> dict:
        return future.result()

    def close(self) -> None:
        for p in self.pools.values():
            p.shutdown(wait=True)


def _config(t_dir: Path, s_dir: Path, storage: Path, lag: int, batch: int, new_tokens: int, steps: int,
            engine: str = "hf"):
    return validate_config({
        "name": "bench-onpolicy",
        "teachers": [{"name": "teacher", "model": str(t_dir), "dtype": "float32"}],
        "student": {"model": str(s_dir), "dtype": "float32"},
        "data": {"num_train": 4 * batch * steps, "num_test": 4, "num_val": 4},
        "align": {"mode": "structured", "projector": {"kind": "linear", "dropout": 0.0}},
        "loss": {"logit_weight": 1.0, "logit_top_k": 16, "kv_weight": 0.1, "logit_divergence": "reverse_kl_sampled"},
        "onpolicy": {"fraction": 1.0, "max_new_tokens": new_tokens, "lag": lag, "engine": engine},
        "optim": {"lr_student": 1e-4, "lr_projector": 1e-4, "warmup_steps": 0, "schedule": "constant"},
        "train": {"steps": steps, "batch_size": batch, "max_length": 512},
        "ray": {"storage_path": str(storage), "num_workers": 1, "use_gpu": False},
    })


def _run(cfg, models: dict, delay_s: float, warmup: int) -> dict:
    """Median per-step seconds of one run (after `warmup` steps): step, sample, teacher wait, train (the rest)."""
    recipe = DistillRecipe(cfg, in_process_plans(cfg, models))
    recipe.setup()
    source = TimedSource(models, delay_s)
    data = recipe.data(source)
    rows = []
    tokens0 = None
    try:
        for step in range(1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            recipe.step(step, data.next_step(step))
            dt = time.perf_counter() - t0
            m = data.step_metrics()
            sample, wait = m[SAMPLE_S], m[TEACHER_WAIT_S]
            rows.append({"step_s": dt, "sample_s": sample, "wait_s": wait, "train_s": dt - sample - wait})
            if step == warmup:
                tokens0 = (data.sampler.tokens, data.sampler.seconds)
    finally:
        source.close()
        data.close()
    kept = rows[warmup:]
    tokens, seconds = data.sampler.tokens - tokens0[0], data.sampler.seconds - tokens0[1]
    return ({k: statistics.median(r[k] for r in kept) for k in kept[0]}
            | {"steps": len(kept), "tokens_per_s": tokens / seconds if seconds else 0.0})


@contextlib.contextmanager
def _models():
    """(temp dir, the teacher's dir, the student's dir, {"teacher": model}): the bench's tiny models."""
    with tempfile.TemporaryDirectory(prefix="kava-bench-onpolicy-") as tmp:
        tmp = Path(tmp)
        t_dir = build_tiny_model(tmp / "teacher", seed=1, **TEACHER)
        s_dir = build_tiny_model(tmp / "student", seed=2, **STUDENT)
        yield tmp, t_dir, s_dir, {"teacher": load_model(str(t_dir), dtype="float32")}


def run_onpolicy_bench(steps: int = 10, batch: int = 4, new_tokens: int = 32, warmup: int = 2) -> dict:
    t_start = time.perf_counter()
    with _models() as (tmp, t_dir, s_dir, models):
        def cfg(lag):
            return _config(t_dir, s_dir, tmp / "runs", lag, batch, new_tokens, steps)

        status("bench onpolicy: measuring sampling and training alone (lag 0, teachers instant)")
        alone = _run(cfg(0), models, 0.0, warmup)
        delay = alone["sample_s"] + alone["train_s"]
        status(f"bench onpolicy: teachers busy {delay:.2f} s per batch (= S + T); lag 0, then lag 1")
        lag0 = _run(cfg(0), models, delay, warmup)
        lag1 = _run(cfg(1), models, delay, warmup)
    hidden = max(lag1["sample_s"] + lag1["train_s"], delay)
    serial = lag0["sample_s"] + lag0["train_s"] + delay
    return {"alone": alone, "teacher_s": delay, "lag0": lag0, "lag1": lag1,
            "lag1_over_hidden": lag1["step_s"] / hidden, "lag0_over_serial": lag0["step_s"] / serial,
            "speedup": lag0["step_s"] / lag1["step_s"], "target": 1.10, "passes": lag1["step_s"] <= 1.10 * hidden,
            "batch": batch, "new_tokens": new_tokens, "steps": steps, "warmup": warmup,
            "wall_s": time.perf_counter() - t_start}


def run_engine_bench(engines: list[str], steps: int = 10, batch: int = 4, new_tokens: int = 32, warmup: int = 2
                     ) -> dict:
    """Each engine samples the same student's completions (tokens/s) in the on-policy step at lag 0
    and lag 1 (the teachers instant: what differs is the sampling), and the teacher scoring figure
    beside it."""
    from kava_ray.rollout.vllm_engine import require_vllm

    if "vllm" in engines:
        require_vllm("bench onpolicy --engine vllm")
    t_start = time.perf_counter()
    with _models() as (tmp, t_dir, s_dir, models):
        runs = {}
        for engine in engines:
            for lag in (0, 1):
                status(f"bench onpolicy: engine {engine}, lag {lag}")
                runs[f"{engine} lag {lag}"] = _run(_config(t_dir, s_dir, tmp / "runs", lag, batch, new_tokens, steps,
                                                           engine), models, 0.0, warmup)
        scoring = scoring_rates(s_dir, 8, 128, 16) if "vllm" in engines else None
    return {"engines": engines, "runs": runs, "scoring": scoring, "batch": batch, "new_tokens": new_tokens,
            "steps": steps, "warmup": warmup, "wall_s": time.perf_counter() - t_start}


def format_engine_bench(r: dict) -> str:
    rows = [[name, f"{d['tokens_per_s']:.1f}", f"{d['step_s']:.3f}", f"{d['sample_s']:.3f}", f"{d['train_s']:.3f}"]
            for name, d in r["runs"].items()]
    lines = [f"on-policy sampling engines, median over {r['steps'] - r['warmup']} steps after {r['warmup']} (the "
             f"student {STUDENT['num_layers']} layers x {STUDENT['hidden_size']}, batch {r['batch']}, "
             f"{r['new_tokens']} new tokens, teachers instant):",
             format_table(["engine", "sampled tok/s", "step s", "sample s", "train s"], rows)]
    base = r["runs"].get("hf lag 0")
    for name, d in r["runs"].items():
        if base and not name.startswith("hf"):
            lines.append(f"{name}: {d['tokens_per_s'] / base['tokens_per_s']:.2f}x hf lag 0's sampled tokens/s, "
                         f"step {d['step_s'] / base['step_s']:.2f}x")
    s = r.get("scoring")
    if s:
        lines.append(f"teacher scoring ({s['batch']} x {s['length']} positions, top-{s['k']}): HF forward "
                     f"{s['hf']:.0f} positions/s, vLLM prompt log-probs {s['vllm']:.0f} positions/s "
                     f"({s['vllm'] / s['hf']:.2f}x)")
    lines.append(f"wall {r['wall_s']:.0f} s")
    return "\n".join(lines)


def format_onpolicy_bench(r: dict) -> str:
    rows = [[name, f"{d['step_s']:.3f}", f"{d['sample_s']:.3f}", f"{d['wait_s']:.3f}", f"{d['train_s']:.3f}"]
            for name, d in (("alone (D = 0)", r["alone"]), ("lag 0", r["lag0"]), ("lag 1", r["lag1"]))]
    return "\n".join([
        f"on-policy step, median over {r['lag1']['steps']} steps after {r['warmup']} (batch {r['batch']}, "
        f"{r['new_tokens']} new tokens, teachers busy D = {r['teacher_s']:.3f} s per batch = S + T alone):",
        format_table(["run", "step s", "sample s", "teacher wait s", "train s"], rows),
        f"lag 1: step / max(S + T, D) = {r['lag1_over_hidden']:.2f} (target <= {r['target']:.2f}: "
        f"{'passes' if r['passes'] else 'FAILS'})",
        f"lag 0: step / (S + T + D) = {r['lag0_over_serial']:.2f} (serial); lag 1 is {r['speedup']:.2f}x faster",
        f"wall {r['wall_s']:.0f} s",
    ])
