"""Training runs inside the bench's own process: the production step without Ray Train.

`train_in_process` builds the production `recipes.distill.DistillRecipe` (Distiller, optimizer,
schedule, resumable batch stream), feeds it teacher KV through the production `KVFeed` from any
source (the example-indexed KV cache, or teachers in this process), runs `steps` optimizer steps
and, on request, scores a held-out split every `eval_every` steps. What a Ray Train worker does per
step, minus the process boundary (which costs a TorchTrainer start, ~15 s here, per run): the
benches that compare many short runs use it.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from typing import Callable, Optional

from kava_ray.core.metric_names import GRAD_KV_RATIO, GRAD_KV_SHARE, LOSS
from kava_ray.recipes.distill import DistillRecipe
from kava_ray.recipes.fit_maps import fit_maps
from kava_ray.recipes.step_records import StepKind
from kava_ray.recipes.steps import NonFinite, run_steps


def run_key(obj) -> str:
    """16 hex digits naming a finished run by what defines it (a JSON-able dict: its config dump,
    ...): the name it is kept under, so that a re-run with the same output dir finds it (`bench
    heal`, `bench heal --onpolicy`)."""
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def train_in_process(cfg, plans: dict, source, steps: int, eval_every: Optional[int] = None,
                     evaluate: Optional[Callable] = None, device: str = "cpu", grad_share: bool = False,
                     stop: Optional[Callable[[list], bool]] = None) -> dict:
    """Run `steps` production steps (after `recipes.fit_maps.fit_maps`, as a Train worker does);
    returns {"recipe", "first" / "last" (the first / last step's metrics), "step_s" (median),
    "wall_step_s" (median of each step with its data: the teachers' forwards and any sampling),
    "curve" [(step, evaluate(recipe))] at step 0, every `eval_every` steps and at the end, "shares"
    / "ratios" (each step's grad/kv_share / grad/kv_ratio with `grad_share`), "sums" (each metric
    summed over the steps: `bench task`'s sampled tokens per training sample), "losses" (each step's
    loss), "records" (each step's metrics.jsonl record), "stopped" (the one line of a non-finite
    loss that ended the run, else None)}: the production step loop (`recipes.steps.run_steps`), each
    step's batches drawn before its clock. stop(curve): called after each evaluation; True ends the
    run there (a warm start that trains until its curve flattens)."""
    recipe = DistillRecipe(cfg, plans, device=device)
    recipe.setup()
    fit_maps(recipe, source)
    data = recipe.data(source, until=steps, depth=1)
    times, walls, last, curve, first, shares, ratios, sums, losses, records = [], [], {}, [], {}, [], [], {}, [], []
    if evaluate is not None:
        curve.append((0, evaluate(recipe)))

    def kind_of(step: int) -> StepKind:  # every step logged (its record kept); evaluated every `eval_every`
        return StepKind(log=True, save=False, eval=bool(eval_every) and (step % eval_every == 0 or step == steps))

    stopped = None
    try:  # the production loop, the teachers outside the clock (eager)
        for done in run_steps(recipe, data, steps, kind_of, grad_share=grad_share, eager=True):
            times.append(done.step_s)
            walls.append(done.wall_s)
            records.append(done.record)
            last = done.values
            first = first or {k: float(v) for k, v in last.items()}
            losses.append(float(last[LOSS]))
            for k, v in last.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            if grad_share:
                shares.append(float(last.get(GRAD_KV_SHARE, 0.0)))
                ratios.append(float(last.get(GRAD_KV_RATIO, 0.0)))
            if evaluate is not None and done.kind.eval:
                curve.append((done.step, evaluate(recipe)))
                if stop is not None and stop(curve):
                    break
    except NonFinite as e:  # a run that diverged ends there, its line kept (the step loop's stop)
        stopped = str(e)
    return {"recipe": recipe, "first": first, "last": last, "step_s": statistics.median(times) if times else None,
            "wall_step_s": statistics.median(walls) if walls else None, "curve": curve, "shares": shares,
            "ratios": ratios, "sums": sums, "losses": losses, "records": records, "stopped": stopped}
