"""Connecting to Ray: an existing cluster (`--address auto` / `ray://...` / host:port) or an embedded one.

Token authentication stays on (Ray 2.60's default): an embedded Ray generates a token in
~/.ray/auth_token; a client of a remote cluster needs that cluster's token (README: "Token auth").
"""

from __future__ import annotations

import os
from typing import Optional

import ray

from kava_ray._io import first_line
from kava_ray.errors import KavaError

# Ray Train V2's controller takes one `ray.train.report` per worker per poll, every 2 s by default: a
# run that reports every step would be throttled to one step per 2 s. Poll faster on our own Ray.
EMBEDDED_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "TRANSFORMERS_VERBOSITY": "error"}


def connect(address: Optional[str], namespace: str, num_cpus: Optional[int] = None,
            require_cluster: bool = False, worker_env: Optional[dict] = None) -> str:
    """Initialise Ray once per process; returns 'embedded' or the address connected to.

    address None -> an embedded local Ray with `num_cpus` logical CPUs (may exceed the physical
    cores: Ray only counts them), unless `require_cluster` (service mode needs a lasting cluster).
    `worker_env`: extra environment variables for every worker and actor of an embedded Ray.
    """
    if ray.is_initialized():
        return "existing"
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None:
        if require_cluster:
            raise KavaError("this command needs a running Ray cluster: start one with `ray start --head` "
                            "and pass --address auto")
        # The dashboard process also serves Ray's state API, which Train's controller and
        # `teachers status` (restart counts) query; workers log at WARNING so progress stays readable.
        # single-machine mode: every Ray server listens on 127.0.0.1 only (Ray's own switch for it)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # address="local": a Ray of our own even when a `ray start --head` (or the stale file of a killed
        # one) is on this machine; without it ray.init joins that cluster and refuses num_cpus
        ray.init(address="local", num_cpus=num_cpus, namespace=namespace, logging_level="WARNING",
                 logging_config=ray.LoggingConfig(log_level="WARNING"),
                 runtime_env={"env_vars": {**EMBEDDED_ENV, **(worker_env or {})}})
        return "embedded"
    try:
        ray.init(address=address, namespace=namespace, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise KavaError(f"cannot connect to Ray at {address!r}: {first_line(e)}") from None
    return address


def resolve_use_gpu(use_gpu) -> bool:
    """`ray.use_gpu: auto` -> True when the cluster has GPUs, else False."""
    if use_gpu == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return bool(use_gpu)
