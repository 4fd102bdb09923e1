"""The private Ray APIs kava-ray uses, in one place, written against Ray 2.60.

Ray has no public equivalent for these four; everything else goes through public APIs.
`tests/test_ray_private.py` fails loudly when the installed Ray is not the version below or one of these
attributes is gone, so an upgrade is a deliberate re-check of this file, not a silent break:

- `ray._private.ray_constants.ENABLE_RAY_CLUSTER`: read by Ray's IP resolution at call time; set to False
  (with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 for the processes Ray starts) it keeps a single-machine Ray on
  127.0.0.1 (`kava_ray.runtime.connect.single_machine_mode`).
- `ray._private.worker._global_node.get_logs_dir_path()`: the local session's logs dir, from which a run
  collects its workers' logs into `RUN_DIR/logs/ray/` (`kava_ray.runtime.console.collect_ray_logs`).
- `TorchTrainer._register_sigint_handler`: Ray Train V2 installs a SIGINT handler that aborts "gracefully"
  (~15 s, a traceback, exit 1); kava-ray replaces it with nothing so Ctrl-C is one line and exit 130
  (`kava_ray.recipes.train.fit`).
- Ray Train's torch backend (`TorchConfig().backend_cls`, whose `on_start` sets up the process group) and the
  worker group its `on_start` receives (`execute_single`, `execute_single_async`, `get_resources_per_worker`,
  `len`), and the function its `on_start` sets each worker's torchrun variables with
  (`ray.train.torch.config._set_torch_distributed_env_vars`): `kava_ray.runtime.process_group` subclasses the one and
  drives the other to bind the group's store to 127.0.0.1 on one machine (Ray's `TorchConfig` has no option for
  where the store listens).
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


def set_torch_distributed_env_vars() -> None:
    """On a Train worker: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, ACCELERATE_TORCH_DEVICE, as
    Ray Train's TorchConfig sets them before it creates the process group."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


def missing() -> list[str]:
    """The private attributes above that the installed Ray no longer has (empty when all are there)."""
    import ray.train.torch
    from ray._private import ray_constants, worker

    out = []
    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        out.append("ray._private.ray_constants.ENABLE_RAY_CLUSTER")
    if not hasattr(worker, "_global_node"):
        out.append("ray._private.worker._global_node")
    if not hasattr(ray.train.torch.TorchTrainer, "_register_sigint_handler"):
        out.append("TorchTrainer._register_sigint_handler")
    if not hasattr(ray.train.torch.TorchConfig().backend_cls, "on_start"):
        out.append("TorchConfig().backend_cls.on_start")
    import ray.train.torch.config as torch_config
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    if not hasattr(torch_config, "_set_torch_distributed_env_vars"):
        out.append("ray.train.torch.config._set_torch_distributed_env_vars")

    out += [f"WorkerGroup.{name}" for name in ("execute_single", "execute_single_async", "get_resources_per_worker",
                                               "__len__") if not hasattr(WorkerGroup, name)]
    return out
