"""The Ray Train workers' torch.distributed process group, with its store on loopback when the run is on one machine.

`LoopbackTorchConfig`: on a loopback rank 0 the TCPStore (no authentication) listens on 127.0.0.1
only, as every other server of an embedded run; on a real cluster it is Ray's TorchConfig. Why:
docs/internals/runtime.md#process-group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import ray
import torch.distributed as dist
from ray.train.torch import TorchConfig

from kava_ray.runtime.ray_private import set_torch_distributed_env_vars

LOOPBACK = ("127.0.0.1", "::1", "localhost")
_STORE = None  # rank 0's store server, alive as long as its worker process


def _serve_store(world_size: int, timeout_s: int) -> int:
    """On rank 0: a TCPStore server on a socket bound to 127.0.0.1 (the store takes the socket over); its port."""
    global _STORE
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    _STORE = dist.TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=timeout_s),
                           wait_for_workers=False, master_listen_fd=sock.detach(), use_libuv=True)
    return port


def _join(backend: str, port: int, timeout_s: int) -> None:
    """On every rank (after Ray Train's own torchrun variables, `_set_torch_distributed_env_vars`): the group."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # as Ray's TorchConfig: fail on a hung collective
    store = _STORE if rank == 0 else dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


class _LoopbackBackend(TorchConfig().backend_cls):
    def on_start(self, worker_group, backend_config: "LoopbackTorchConfig") -> None:
        if worker_group.execute_single(0, ray.util.get_node_ip_address) not in LOOPBACK:
            return super().on_start(worker_group, backend_config)
        backend = backend_config.backend or ("nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0
                                             else "gloo")
        port = worker_group.execute_single(0, _serve_store, len(worker_group), backend_config.timeout_s)
        worker_group.execute(set_torch_distributed_env_vars)  # RANK, WORLD_SIZE, LOCAL_RANK, ... as Ray sets them
        ray.get([worker_group.execute_single_async(i, _join, backend, port, backend_config.timeout_s)
                 for i in range(len(worker_group))])


@dataclass
class LoopbackTorchConfig(TorchConfig):
    """Ray Train's TorchConfig, with the process group's store on 127.0.0.1 when the run is on one machine."""

    @property
    def backend_cls(self):
        return _LoopbackBackend
