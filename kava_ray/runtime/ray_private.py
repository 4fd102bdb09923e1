"""The private Ray APIs kava-ray uses, in one place, written against Ray 2.60.

`tests/test_ray_private.py` fails loudly when the installed Ray is another version or an attribute
is gone. Each is imported inside the function that uses it, so a Ray that lacks one fails in
`missing()`, which names it, not at import; `_global_node` is read when called (ray.init sets it).
Which APIs and why each has no public equivalent: docs/internals/runtime.md#ray-private.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

RAY_VERSION = "2.60"  # the Ray these were checked against (major.minor)


def set_single_machine_constant() -> None:
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def session_logs_dir() -> Optional[Path]:
    """This process's Ray session logs dir (None if Ray keeps none on this machine)."""
    from ray._private.worker import _global_node

    return Path(_global_node.get_logs_dir_path()) if _global_node is not None else None


def drop_train_sigint_handler(trainer) -> None:
    trainer._register_sigint_handler = lambda controller: None


def trim_train_callbacks(trainer) -> None:
    """Ray Train's default controller callbacks (the trainer's `_create_default_callbacks` list),
    changed twice: its placement-group cleaner replaced by one that removes a run's group only once
    its controller reads DEAD (`kava_ray.runtime.pg_cleaner`; Ray's reads a missing state-API record
    as a dead controller), and its datasets callback dropped when the trainer has no Ray Dataset
    (kava-ray passes none: each worker reads its own split). That callback starts a `DatasetManager`
    actor for every worker group, datasets or not (a process start, ~1 CPU-s, per run and per
    restart) and imports `ray.data` into every worker."""
    from ray.train.v2._internal.callbacks import DatasetsCallback

    from kava_ray.runtime.pg_cleaner import swap_cleaner

    make = getattr(trainer, "_create_default_callbacks", None)
    if make is None:  # (a stand-in trainer of a test has none)
        return
    unused = () if getattr(trainer, "datasets", None) else (DatasetsCallback,)
    trainer._create_default_callbacks = lambda: [cb for cb in swap_cleaner(make()) if type(cb) not in unused]


def wait_for_tune_reports(timeout_s: float = 60.0, settle_s: float = 0.5) -> None:
    """In a Tune trial whose TorchTrainer reported through `TuneReportCallback`: return once the
    trial's actor has taken every report from the callback's inter-actor queue
    (`_TrainSession._inter_actor_queue`). A report that lands there after the trial function
    returned deadlocks Ray 2.60's function trainable: its main thread takes it and blocks putting it
    into a result queue that already holds the function's end (the trial stays RUNNING and the sweep
    never ends; seen on a loaded box). `settle_s`: the taken report's hand-over to Tune."""
    import time

    from ray.train._internal.session import get_session

    session = get_session()
    queue = getattr(session, "_inter_actor_queue", None) if session is not None else None
    if queue is None:
        return
    deadline = time.monotonic() + timeout_s
    while not queue.empty() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(settle_s)


def set_torch_distributed_env_vars() -> None:
    """On a Train worker: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK,
    ACCELERATE_TORCH_DEVICE, as Ray Train's TorchConfig sets them before it creates the process
    group."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


def missing() -> list[str]:
    """The private attributes above that the installed Ray no longer has (empty when all are there)."""
    import ray.train.torch
    from ray._private import ray_constants, worker

    out = []
    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        out.append("ray._private.ray_constants.ENABLE_RAY_CLUSTER")
    from ray.train._internal import session

    if not hasattr(session._TrainSession, "_get_or_create_inter_actor_queue"):
        out.append("ray.train._internal.session._TrainSession._inter_actor_queue")
    if not hasattr(worker, "_global_node"):
        out.append("ray._private.worker._global_node")
    if not hasattr(ray.train.torch.TorchTrainer, "_register_sigint_handler"):
        out.append("TorchTrainer._register_sigint_handler")
    if not hasattr(ray.train.torch.TorchTrainer, "_create_default_callbacks"):
        out.append("TorchTrainer._create_default_callbacks")
    try:
        from ray.train.v2._internal.callbacks import DatasetsCallback  # noqa: F401
    except ImportError:
        out.append("ray.train.v2._internal.callbacks.DatasetsCallback")
    try:
        from kava_ray.runtime.pg_cleaner import ConfirmingCleaner, ConfirmingCleanerCallback
    except ImportError as e:  # a Ray without the cleaner's classes
        return out + [f"kava_ray.runtime.pg_cleaner: {e}"]
    cleaner = ConfirmingCleaner(controller_actor_id="x", check_interval_s=1.0, get_actor_timeout_s=1.0,
                                stop_timeout=1.0)
    callback = ConfirmingCleanerCallback()
    out += [f"PlacementGroupCleaner.{name}" for name in ("_controller_actor_id", "_get_actor_timeout_s")
            if not hasattr(cleaner, name)]
    out += [f"PlacementGroupCleanerCallback.{name}" for name in ("_cleaner", "_controller_actor_id",
                                                                 "_check_interval_s", "_get_actor_timeout_s",
                                                                 "_stop_timeout") if not hasattr(callback, name)]
    if "_cleanup_placement_group" not in vars(ConfirmingCleaner.__mro__[1]):
        out.append("PlacementGroupCleaner._cleanup_placement_group")
    if not hasattr(ray.train.torch.TorchConfig().backend_cls, "on_start"):
        out.append("TorchConfig().backend_cls.on_start")
    import ray.train.torch.config as torch_config
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    if not hasattr(torch_config, "_set_torch_distributed_env_vars"):
        out.append("ray.train.torch.config._set_torch_distributed_env_vars")

    out += [f"WorkerGroup.{name}" for name in ("execute_single", "execute_single_async", "get_resources_per_worker",
                                               "__len__") if not hasattr(WorkerGroup, name)]
    return out
