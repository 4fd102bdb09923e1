"""The Ray Train workers' torch.distributed process group, with its store on loopback when the run is on one machine.

Ray Train's `TorchConfig` sets the group up through torch's `env://` rendezvous, whose `TCPStore` server (on
rank 0) listens on every interface (`::`), whatever MASTER_ADDR says — and the store has no authentication. Every
other server of an embedded (or `ray start --head` on 127.0.0.1) run listens on 127.0.0.1 only
(`kava_ray.runtime.connect.single_machine_mode`). `LoopbackTorchConfig` keeps it that way: when rank 0's node IP is a
loopback address, rank 0 serves the store from a socket it bound to 127.0.0.1 (`TCPStore(master_listen_fd=...)`)
and every rank joins the group through it; on a real multi-node cluster it sets the group up exactly as Ray's
TorchConfig does (there the store must be reachable from the other nodes: docs/cluster.md says which ports a job
opens and that the nodes belong on a private network). The Ray internals this relies on are listed, and checked
against the installed Ray, in `kava_ray.runtime.ray_private`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import ray
from ray.train.torch import TorchConfig

from kava_ray.runtime.ray_private import set_torch_distributed_env_vars

LOOPBACK = ("127.0.0.1", "::1", "localhost")
_STORE = None  # rank 0's store server, alive as long as its worker process


def _serve_store(world_size: int, timeout_s: int) -> int:
    """On rank 0: a TCPStore server on a socket bound to 127.0.0.1 (the store takes the socket over); its port."""
    import torch.distributed as dist

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
    import torch.distributed as dist

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
