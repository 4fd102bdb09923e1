"""Ray Train's placement-group cleaner, as kava-ray starts it (`kava_ray.runtime.pg_cleaner`): a live run's group
stays when the state API has no record of its controller (Ray's own check reads that as dead, and CI once lost a
run's workers to it); a dead controller's group goes."""

import time

import ray
from ray.util.placement_group import placement_group, placement_group_table

import kava_ray.runtime.pg_cleaner as pgc
from kava_ray.runtime.ray_private import trim_train_callbacks


@ray.remote(num_cpus=0)
class Controller:
    def ping(self):
        return 1


def _state(pg) -> str:
    return placement_group_table(pg)["state"]


def test_a_live_controllers_group_is_kept_when_the_state_api_misses_it_and_a_dead_ones_is_removed(ray_session,
                                                                                                 monkeypatch):
    from ray.train.v2._internal.state import util

    controller = Controller.remote()
    ray.get(controller.ping.remote())
    actor_id = controller._actor_id.hex()
    pg = placement_group([{"CPU": 0.01}])
    ray.get(pg.ready(), timeout=60)
    cleaner = pgc.ConfirmingCleaner(controller_actor_id=actor_id, check_interval_s=0.1, get_actor_timeout_s=10,
                                    stop_timeout=1.0)
    try:
        # a state API that answers with no record: Ray's own check calls the controller dead ...
        monkeypatch.setattr(util, "get_actor", lambda *a, **k: None)
        monkeypatch.setattr(pgc, "get_actor", lambda *a, **k: None)
        assert not util.is_actor_alive(actor_id, timeout=10)
        # ... the confirming cleaner keeps the group
        cleaner._cleanup_placement_group(pg)
        assert _state(pg) == "CREATED"
        monkeypatch.undo()
        # the real state API, the controller alive: kept
        cleaner._cleanup_placement_group(pg)
        assert _state(pg) == "CREATED"
        # the controller dead (its record says so): removed
        ray.kill(controller, no_restart=True)
        deadline = time.monotonic() + 30
        while not pgc.controller_dead(actor_id, timeout_s=10, asks=1) and time.monotonic() < deadline:
            time.sleep(0.2)
        cleaner._cleanup_placement_group(pg)
        assert _state(pg) == "REMOVED"
    finally:
        if _state(pg) != "REMOVED":
            ray.util.remove_placement_group(pg)


def test_every_run_starts_the_confirming_cleaner_instead_of_rays_and_no_dataset_manager(ray_session):
    """Ray's cleaner swapped for the confirming one; Ray's datasets callback (a DatasetManager actor per worker
    group) dropped when the trainer has no Ray Dataset, kept when it has one."""
    import ray.data
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    trainer = TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    kinds = [type(cb) for cb in trainer._create_default_callbacks()]
    assert PlacementGroupCleanerCallback in kinds and DatasetsCallback in kinds
    trim_train_callbacks(trainer)
    kinds = [type(cb) for cb in trainer._create_default_callbacks()]
    assert pgc.ConfirmingCleanerCallback in kinds and PlacementGroupCleanerCallback not in kinds
    assert DatasetsCallback not in kinds
    with_data = TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                             datasets={"train": ray.data.range(4)})
    trim_train_callbacks(with_data)
    kinds = [type(cb) for cb in with_data._create_default_callbacks()]
    assert pgc.ConfirmingCleanerCallback in kinds and DatasetsCallback in kinds
