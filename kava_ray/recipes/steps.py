"""The one step loop: a recipe's optimizer steps over its step source, as a Ray Train worker
(`distill.train_loop_per_worker`) and the in-process benches (`bench.inprocess.train_in_process`)
both run them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.nonfinite import FirstBad
from kava_ray.recipes.step_records import StepKind, step_record


class NonFinite(KavaError):
    """A non-finite loss stopped the run at log step `step` (its one line names the first bad step and the terms)."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


@dataclass
class StepDone:
    """One finished step: its metrics (device tensors: the recipe's, with the data side's figures),
    the optimizer step's seconds alone and with drawing its micro-batches (the teachers' forwards,
    any sampling), and at a log step its metrics.jsonl record (`step_records.step_record`)."""

    step: int
    kind: StepKind
    values: dict[str, torch.Tensor]
    step_s: float
    wall_s: float
    record: Optional[dict] = None


def run_steps(recipe, data, until: int, kind_of: Callable[[int], StepKind], *, grad_share: bool = False,
              eager: bool = False) -> Iterator[StepDone]:
    """Steps `recipe.start_step + 1 .. until`: `recipe.step` on `data.next_step(step)` (drawn before
    the clock with `eager`, as the benches time the step alone; else one micro-batch at a time, as a
    worker holds them), the data side's figures added (`data.step_metrics()`: the teachers' wait,
    the skips). grad_share: grad/kv_share at the log steps. A non-finite loss is tracked on the
    device (`FirstBad`) and checked at the log steps, where the loop syncs anyway: the first log
    step after it raises `NonFinite`, naming the checkpoint that stays the latest."""
    bad, saved = FirstBad(), recipe.start_step
    for step in range(recipe.start_step + 1, until + 1):
        kind, t_wall = kind_of(step), time.perf_counter()
        micro = list(data.next_step(step)) if eager else data.next_step(step)
        t0 = time.perf_counter()
        values = recipe.step(step, micro, grad_share and kind.log)
        step_s = time.perf_counter() - t0
        values.update({k: torch.tensor(v, dtype=torch.float64, device=values["grad_norm"].device)
                       for k, v in data.step_metrics().items()})
        bad.update(values, step)
        if not kind.log:
            yield StepDone(step, kind, values, step_s, time.perf_counter() - t_wall)
            continue
        try:
            bad.check(saved)  # every rank at the same step (the norms are all-reduced)
        except KavaError as e:
            raise NonFinite(step, str(e)) from None
        saved = step if kind.save else saved
        wall_s = time.perf_counter() - t_wall
        record = step_record(values, step, wall_s, recipe.last_lrs, recipe.world, recipe.measured)
        yield StepDone(step, kind, values, step_s, wall_s, record)
