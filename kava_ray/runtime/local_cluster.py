"""Several Ray nodes on one machine (a CPU-less head, a teacher node, a student node), as cluster.yaml labels them.

    RAY_AUTH_MODE=token python -m kava_ray.runtime.local_cluster [--stdin]

prints the GCS address and keeps the nodes up; with --stdin it takes `add teacher` / `add student` /
`remove NODE_ID` per line. Details: docs/internals/runtime.md#local-cluster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Iterator

from ray.cluster_utils import Cluster

from kava_ray.runtime.connect import free_port, single_machine_mode

TEACHER_NODE = {"kava-role": "teacher"}
STUDENT_NODE = {"kava-role": "student"}


KINDS = {"teacher": (TEACHER_NODE, 2), "student": (STUDENT_NODE, 3)}  # labels, CPUs


def add_node(cluster, kind: str):
    """Another node of `kind` ('teacher' or 'student'), with a 1 GiB object store (the Cluster's
    default is 150 MiB: a few KV batches of a real teacher would fill it)."""
    labels, cpus = KINDS[kind]
    return cluster.add_node(node_ip_address="127.0.0.1", num_cpus=cpus, labels=labels, object_store_memory=2**30)


def serve(cluster, lines) -> None:
    """Answer the commands of `lines` (the module docstring), one line each, until they end."""
    for line in lines:
        word, _, arg = line.strip().partition(" ")
        if word == "add" and arg in KINDS:
            node = add_node(cluster, arg)  # (Cluster.add_node waits until the node is alive)
            print(node.node_id, flush=True)
        elif word == "remove":
            node = next((n for n in cluster.worker_nodes if n.node_id == arg), None)
            if node is not None:
                cluster.remove_node(node, allow_graceful=False)
            print("removed" if node is not None else f"no node {arg}", flush=True)
        elif line.strip():
            print(f"unknown command {line.strip()!r} (add teacher | add student | remove NODE_ID)", flush=True)


@contextlib.contextmanager
def local_cluster() -> Iterator:
    """Start the three nodes; yields the `Cluster` (its `gcs_address` for `kava-ray ... --address`
    and `ray.init(address=...)`); shuts every node down on exit."""
    single_machine_mode()  # 127.0.0.1 stays 127.0.0.1, for the nodes and for a driver in this process
    # a node whose raylet is gone is marked dead after 5 failed health checks 1 s apart (Ray's
    # default: 3 s apart, ~15 s): the GCS refuses a dead raylet's connection at once, a live but
    # busy one has each check's timeout
    for key, value in (("RAY_health_check_period_ms", "1000"), ("RAY_health_check_failure_threshold", "5")):
        os.environ.setdefault(key, value)
    os.environ["DASHBOARD_METRIC_PORT"] = str(free_port())  # fixed defaults another Ray here may hold
    os.environ["AUTOSCALER_METRIC_PORT"] = str(free_port())
    local = {"node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**local, "num_cpus": 0, "dashboard_host": "127.0.0.1",
                                      "dashboard_port": free_port(), "labels": {"kava-role": "head"}})
    try:
        add_node(cluster, "teacher")
        add_node(cluster, "student")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def main() -> None:
    with local_cluster() as cluster:
        print(cluster.gcs_address, flush=True)
        if "--stdin" in sys.argv:
            serve(cluster, sys.stdin)
        else:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
