"""The other ranks' wait while rank 0 runs `train.eval_tasks` on the student.

Without it they would run on to the next step and wait in its first collective on the training
group, whose timeout (Ray Train's `TorchConfig.timeout_s`, 30 min) a long harness task can pass:
the run then dies of a collective timeout. Instead every rank meets rank 0 at a barrier on a gloo
group of its own, created once by every rank, whose timeout is `TASKS_TIMEOUT_S`. A rank that dies
meanwhile still ends the run: Ray Train tears the worker group down.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch.distributed as dist

TASKS_TIMEOUT_S = 6 * 3600  # the longest rank 0 may spend on the harness tasks of one evaluation


def rank_zero_wait(eval_tasks: list, world: int, timeout_s: float = TASKS_TIMEOUT_S) -> Callable[[], None]:
    """A function every rank calls after each evaluation (rank 0's tasks included): a barrier on a
    gloo group with `timeout_s`; a no-op without eval tasks or other ranks. Every rank must call
    this once, at the same point (it creates the group)."""
    if not eval_tasks or world < 2 or not dist.is_initialized():
        return lambda: None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return lambda: dist.barrier(group=group)
