"""Ray Train's placement-group cleaner, made to remove a run's group only when its controller is known dead.

Ray Train 2.60 starts a detached `PlacementGroupCleaner` beside each run's controller; it polls the
state API and removes the run's placement group once the controller is not alive. Its check,
`is_actor_alive`, reads a missing record as dead (`actor_state and ...`; flagged in ray-project/ray
PR 65447's review), so one empty answer from a busy dashboard removes the group of a live run: its
workers die ("Destroying worker since its placement group was removed") and the run fails.
kava-ray's CI met it on a loaded 2-core box (a job submitted to a `ray start --head`, 18 s into
training). `ConfirmingCleaner` removes the group only when the state API holds the controller's
record and it says DEAD, asked twice; otherwise it keeps the group and stops watching (the group
then lives as long as the job that made it, as before Ray added the cleaner). Why this is a private
API: docs/internals/runtime.md#ray-private.
"""

from __future__ import annotations

import logging
import time

import ray
from ray._common.constants import HEAD_NODE_RESOURCE_NAME
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner
from ray.util.state import get_actor
from ray.util.state.exception import RayStateApiException

logger = logging.getLogger(__name__)


def controller_dead(actor_id: str, timeout_s: float, asks: int = 2, wait_s: float = 1.0,
                    address: str | None = None) -> bool:
    """True when the state API of the Ray at `address` (default: this process's), asked `asks` times
    `wait_s` apart, each time holds the actor's record as DEAD; a missing record or a failed query
    counts as not dead."""
    if address is None and ray.is_initialized():
        address = ray.get_runtime_context().gcs_address  # explicit: a machine may run several Rays
    for i in range(asks):
        if i:
            time.sleep(wait_s)
        try:
            state = get_actor(actor_id, address=address, timeout=timeout_s)
        except (RayStateApiException, ConnectionError):
            return False
        if state is None or state.state != "DEAD":
            return False
    return True


class ConfirmingCleaner(PlacementGroupCleaner):
    """`PlacementGroupCleaner` that re-checks the controller's death before it removes the group."""

    def _cleanup_placement_group(self, placement_group) -> None:
        if placement_group is not None and not controller_dead(self._controller_actor_id,
                                                               self._get_actor_timeout_s):
            logger.warning(f"the state API had no DEAD record of Ray Train controller {self._controller_actor_id}: "
                           f"placement group {placement_group.id} kept")
            return
        super()._cleanup_placement_group(placement_group)


class ConfirmingCleanerCallback(PlacementGroupCleanerCallback):
    """Ray Train's cleaner callback, starting a `ConfirmingCleaner` (same options as Ray's own)."""

    def after_controller_start(self, train_run_context) -> None:
        self._controller_actor_id = ray.get_runtime_context().get_actor_id()
        try:
            self._cleaner = ray.remote(num_cpus=0)(ConfirmingCleaner).options(
                lifetime="detached", get_if_exists=False, resources={HEAD_NODE_RESOURCE_NAME: 0.001},
                scheduling_strategy="DEFAULT",
            ).remote(controller_actor_id=self._controller_actor_id, check_interval_s=self._check_interval_s,
                     get_actor_timeout_s=self._get_actor_timeout_s, stop_timeout=self._stop_timeout)
        except Exception as e:  # as Ray's: a run without a cleaner still trains
            logger.warning(f"no placement group cleaner: {e}")
            self._cleaner = None
            return
        self._cleaner.start_monitoring.remote()


def swap_cleaner(callbacks: list) -> list:
    """`callbacks` (a trainer's default list) with Ray's cleaner callback replaced by `ConfirmingCleanerCallback`."""
    return [ConfirmingCleanerCallback() if type(cb) is PlacementGroupCleanerCallback else cb for cb in callbacks]
