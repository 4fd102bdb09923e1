"""Several Ray nodes on one machine (docs/cluster.md, "Several nodes on one machine"): a head with no CPUs, a
teacher node and a student node, each its own raylet and object store, all on 127.0.0.1, labelled the way
cluster.yaml labels its node types. What the multinode tests and `kava-ray bench feed`'s cross-node regime run on.

    RAY_AUTH_MODE=token python -m kava_ray.local_cluster [--stdin]

prints the GCS address, then keeps the nodes up until Ctrl+C (or, with --stdin, until its stdin closes).

Built on `ray.cluster_utils.Cluster`, the multi-raylet harness Ray's own object-manager and Train scheduling tests
use. Token authentication stays as the environment sets it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from typing import Iterator

from kava_ray.connect import single_machine_mode

TEACHER_NODE = {"kava-role": "teacher"}
STUDENT_NODE = {"kava-role": "student"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_cluster(teacher_cpus: int = 2, student_cpus: int = 3) -> Iterator[str]:
    """Start the three nodes; yields the GCS address (`kava-ray ... --address`, `ray.init(address=...)`); shuts
    every node down on exit."""
    single_machine_mode()  # 127.0.0.1 stays 127.0.0.1, for the nodes and for a driver in this process
    os.environ["DASHBOARD_METRIC_PORT"] = str(_free_port())  # fixed defaults another Ray here may hold
    os.environ["AUTOSCALER_METRIC_PORT"] = str(_free_port())
    from ray.cluster_utils import Cluster

    local = {"node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**local, "num_cpus": 0, "dashboard_host": "127.0.0.1",
                                      "dashboard_port": _free_port(), "labels": {"kava-role": "head"}})
    try:
        # 1 GiB object stores (the Cluster's default is 150 MiB: a few KV batches of a real teacher would fill it)
        cluster.add_node(**local, num_cpus=teacher_cpus, labels=TEACHER_NODE, object_store_memory=2**30)
        cluster.add_node(**local, num_cpus=student_cpus, labels=STUDENT_NODE, object_store_memory=2**30)
        cluster.wait_for_nodes()
        yield cluster.gcs_address
    finally:
        cluster.shutdown()


def main() -> None:
    with local_cluster() as address:
        print(address, flush=True)
        if "--stdin" in sys.argv:
            sys.stdin.read()
        else:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
