"""What each step of a run does besides training, and the record it logs.

`step_kind`: which steps log, evaluate and save (train.log_steps / eval_steps / save_steps, and the
last); `step_record`: a step's metrics reduced over the ranks (`reduce_metrics`: counts summed,
every other figure the mean over the micro-batches that measured it) into its metrics.jsonl record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from kava_ray.common.config import TrainConfig
from kava_ray.core.metric_names import (
    COS_SIM,
    KV_TOKENS,
    LABEL_TOKENS,
    RKL,
    RKL_SUM,
    SAMPLED_TOKENS,
    SKIPPED_BATCHES,
    TOKENS,
    phase,
    summed,
)


@dataclass(frozen=True)
class StepKind:
    """What a step does besides training: log its metrics, evaluate (rank 0), save a checkpoint."""

    log: bool
    eval: bool
    save: bool


def step_kind(step: int, t: TrainConfig) -> StepKind:
    """Save every save_steps and at the end; evaluate every eval_steps, at the end and at every save
    a kept checkpoint is scored by (`train.checkpoint_score` eval/*); log every log_steps and at
    each of those."""
    save = step % t.save_steps == 0 or step == t.steps
    scored_by_eval = (t.checkpoint_score or "").startswith("eval/")
    evaluate = step % t.eval_steps == 0 or step == t.steps or (save and scored_by_eval)
    return StepKind(log=save or evaluate or step % t.log_steps == 0, eval=evaluate, save=save)


def evals_through(step: int, t: TrainConfig) -> int:
    """How many evaluations a run has made after step 0, up to and including `step` (a Tune scheduler's clock)."""
    return sum(step_kind(s, t).eval for s in range(1, step + 1))


def evals_before_end(t: TrainConfig) -> int:
    """The evaluations a run makes before its last step: the last rung a Tune scheduler may judge."""
    return evals_through(t.steps - 1, t)


def step_record(values: dict[str, torch.Tensor], step: int, dt: float, lrs: list, world: int,
                measured: Optional[dict[str, int]] = None) -> dict:
    """The step's train record for metrics.jsonl: metrics reduced over ranks (every rank joins the
    all-reduce; `measured`: `reduce_metrics`'), token counts turned into tokens_per_s, the phase,
    the learning rates of this step. A figure the step did not measure is absent, never 0 (the
    reverse KL of a step that sampled nothing)."""
    metrics = reduce_metrics(values, world, measured)
    metrics.pop(LABEL_TOKENS)
    metrics.pop(KV_TOKENS)
    metrics[SKIPPED_BATCHES] = int(metrics[SKIPPED_BATCHES])
    for k in [k for k in metrics if k.startswith(RKL_SUM + "/")]:  # on-policy: per sampled token
        total = metrics.pop(k)
        if metrics[SAMPLED_TOKENS] > 0:
            metrics[RKL + k[len(RKL_SUM):]] = total / metrics[SAMPLED_TOKENS]
    metrics.update(step=step, kind="train", time_s=dt, tokens_per_s=metrics.pop(TOKENS) / dt,
                   lr_student=lrs[0], lr_projector=lrs[-1])
    if COS_SIM in metrics:  # (a job whose teachers ship no KV has no KV phase)
        metrics["phase"] = phase(metrics[COS_SIM])
    return metrics


def reduce_metrics(values: dict[str, torch.Tensor], world: int, measured: Optional[dict[str, int]] = None
                   ) -> dict[str, float]:
    """Python numbers for logging: counts (SUMMED) summed over ranks, every other metric the mean
    over the micro-batches of every rank that measured it (`measured`: this rank's,
    `DistillRecipe.step`; 1 for a metric not in it). A metric no rank measured is absent; one only
    some ranks measured is theirs alone (not averaged with 0). Every rank calls it: one gather of
    the names (ranks may have measured different ones), one all-reduce."""
    if world == 1:
        keys = sorted(values)
        return dict(zip(keys, torch.stack([values[k].reshape(()) for k in keys]).tolist()))
    measured = measured or {}
    names: list = [None] * world
    dist.all_gather_object(names, sorted(values))
    keys = sorted(set().union(*names))
    weight = {k: float(measured.get(k, 1)) if k in values else 0.0 for k in keys}
    like = next(iter(values.values()))
    zero = torch.zeros((), dtype=torch.float64, device=like.device)
    flat = torch.stack([values[k].reshape(()).double() * (1.0 if summed(k) else weight[k]) if k in values else zero
                        for k in keys] + [zero + weight[k] for k in keys])
    dist.all_reduce(flat)
    totals, weights = flat[:len(keys)].tolist(), flat[len(keys):].tolist()
    return {k: t if summed(k) else t / w for k, t, w in zip(keys, totals, weights) if w > 0}
