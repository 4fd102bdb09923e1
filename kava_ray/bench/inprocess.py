"""Training runs inside the bench's own process: the production step without Ray Train.

`train_in_process` builds the production `recipes.distill.DistillRecipe` (Distiller, optimizer, schedule, resumable
batch stream), feeds it teacher KV through the production `KVFeed` from any source (the example-indexed KV
cache, or teachers in this process), runs `steps` optimizer steps and, on request, scores a held-out split
every `eval_every` steps. What a Ray Train worker does per step, minus the process boundary (which costs a
TorchTrainer start, ~15 s here, per run): the benches that compare many short runs use it.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from typing import Callable, Optional

from kava_ray.core.metric_names import GRAD_KV_RATIO, GRAD_KV_SHARE, LOSS
from kava_ray.recipes.distill import DistillRecipe
from kava_ray.recipes.fit_maps import fit_maps


def run_key(obj) -> str:
    """16 hex digits naming a finished run by what defines it (a JSON-able dict: its config dump, ...): the name it
    is kept under, so that a re-run with the same output dir finds it (`bench heal`, `bench heal --onpolicy`)."""
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def train_in_process(cfg, plans: dict, source, steps: int, eval_every: Optional[int] = None,
                     evaluate: Optional[Callable] = None, device: str = "cpu", grad_share: bool = False,
                     stop: Optional[Callable[[list], bool]] = None) -> dict:
    """Run `steps` production steps (after `recipes.fit_maps.fit_maps`, as a Train worker does); returns {"recipe",
    "first" / "last" (the first / last step's metrics), "step_s" (median), "wall_step_s" (median of each step with
    its data: the teachers' forwards and any sampling), "curve" [(step, evaluate(recipe))] at step 0, every
    `eval_every` steps and at the end, "shares" / "ratios" (each step's grad/kv_share / grad/kv_ratio with
    `grad_share`), "sums" (each metric summed over the steps: `bench task`'s sampled tokens per training sample),
    "losses" (each step's loss)}. stop(curve): called after each evaluation; True ends the run there (a warm start
    that trains until its curve flattens)."""
    recipe = DistillRecipe(cfg, plans, device=device)
    recipe.setup()
    fit_maps(recipe, source)
    data = recipe.data(source, until=steps, depth=1)
    times, walls, last, curve, first, shares, ratios, sums, losses = [], [], {}, [], {}, [], [], {}, []
    if evaluate is not None:
        curve.append((0, evaluate(recipe)))
    for step in range(1, steps + 1):
        t_wall = time.perf_counter()
        micro = list(data.next_step(step))  # teachers: outside the clock
        t0 = time.perf_counter()
        last = recipe.step(step, micro, grad_share)
        times.append(time.perf_counter() - t0)
        walls.append(time.perf_counter() - t_wall)
        first = first or {k: float(v) for k, v in last.items()}
        losses.append(float(last[LOSS]))
        for k, v in last.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        if grad_share:
            shares.append(float(last.get(GRAD_KV_SHARE, 0.0)))
            ratios.append(float(last.get(GRAD_KV_RATIO, 0.0)))
        if evaluate is not None and eval_every and (step % eval_every == 0 or step == steps):
            curve.append((step, evaluate(recipe)))
            if stop is not None and stop(curve):
                break
    return {"recipe": recipe, "first": first, "last": last, "step_s": statistics.median(times) if times else None,
            "wall_step_s": statistics.median(walls) if walls else None, "curve": curve, "shares": shares,
            "ratios": ratios, "sums": sums, "losses": losses}
