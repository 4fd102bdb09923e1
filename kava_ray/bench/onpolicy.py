"""`kava-ray bench onpolicy`: does one-step-off sampling (`onpolicy.lag: 1`) hide the teachers' scoring?

The production DistillRecipe and KVFeed with `onpolicy.fraction: 1` on tiny models: the student samples each batch's
completions on this process and trains; the teachers are timed stand-ins for teachers on GPUs of their own -- each
answers the production request with the real tiny teacher's payload (KV, top-k, token log-probs), padded to `D`
seconds per batch in a thread of its own (one batch at a time, like an actor), so they use no CPU while "busy".
First lag 0 with D = 0 measures S (sampling) and T (training) per step; then D is set to S + T (the regime where
overlap matters most: hidden, the step is max(S + T, D); serial, S + T + D), and lag 0 and lag 1 run side by side.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kava_ray.common.config import validate_config
from kava_ray.common.files import format_table
from kava_ray.core.kv import teacher_forward_kv
from kava_ray.core.metric_names import SAMPLE_S, TEACHER_WAIT_S
from kava_ray.core.models import load_model
from kava_ray.core.plans import in_process_plans
from kava_ray.recipes.distill import DistillRecipe
from kava_ray.runtime.console import status
from kava_ray.testing.tiny import build_tiny_model

TEACHER = dict(family="qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
STUDENT = dict(family="qwen2", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2)


class TimedSource:
    """KV source of teachers each busy `delay_s` per batch (their real tiny forward, then asleep), one batch at a
    time per teacher in its own thread: `submit` starts the work, `result` waits for it."""

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


def _config(t_dir: Path, s_dir: Path, storage: Path, lag: int, batch: int, new_tokens: int, steps: int):
    return validate_config({
        "name": "bench-onpolicy",
        "teachers": [{"name": "teacher", "model": str(t_dir), "dtype": "float32"}],
        "student": {"model": str(s_dir), "dtype": "float32"},
        "data": {"num_train": 4 * batch * steps, "num_test": 4, "num_val": 4},
        "align": {"mode": "structured", "projector": {"kind": "linear", "dropout": 0.0}},
        "loss": {"logit_weight": 1.0, "logit_top_k": 16, "kv_weight": 0.1, "logit_divergence": "reverse_kl_sampled"},
        "onpolicy": {"fraction": 1.0, "max_new_tokens": new_tokens, "lag": lag},
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
    try:
        for step in range(1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            recipe.step(step, data.next_step(step))
            dt = time.perf_counter() - t0
            m = data.step_metrics()
            sample, wait = m[SAMPLE_S], m[TEACHER_WAIT_S]
            rows.append({"step_s": dt, "sample_s": sample, "wait_s": wait, "train_s": dt - sample - wait})
    finally:
        source.close()
    kept = rows[warmup:]
    return {k: statistics.median(r[k] for r in kept) for k in kept[0]} | {"steps": len(kept)}


def run_onpolicy_bench(steps: int = 10, batch: int = 4, new_tokens: int = 32, warmup: int = 2) -> dict:
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kava-bench-onpolicy-") as tmp:
        tmp = Path(tmp)
        t_dir = build_tiny_model(tmp / "teacher", seed=1, **TEACHER)
        s_dir = build_tiny_model(tmp / "student", seed=2, **STUDENT)
        models = {"teacher": load_model(str(t_dir), dtype="float32")}

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
