"""A three-node Ray cluster on this machine (docs/cluster.md, "Several nodes on one machine"): a head with no CPUs,
a teacher node and a student node, each its own raylet and object store, all on 127.0.0.1, labelled the way
cluster.yaml labels its node types. Prints the GCS address, then runs until Ctrl+C (SIGINT/SIGTERM) or, with
--stdin, until its stdin closes (what the tests use).

    RAY_AUTH_MODE=token python tests/multinode_cluster.py [--stdin]
"""

import os
import signal
import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's single-machine mode: 127.0.0.1 stays
    os.environ["DASHBOARD_METRIC_PORT"] = str(_free_port())  # fixed defaults another Ray here may hold
    os.environ["AUTOSCALER_METRIC_PORT"] = str(_free_port())
    from ray.cluster_utils import Cluster

    local = {"node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**local, "num_cpus": 0, "dashboard_host": "127.0.0.1",
                                      "dashboard_port": _free_port(), "labels": {"kava-role": "head"}})
    try:
        cluster.add_node(**local, num_cpus=2, labels={"kava-role": "teacher"})
        cluster.add_node(**local, num_cpus=3, labels={"kava-role": "student"})
        cluster.wait_for_nodes()
        print(cluster.gcs_address, flush=True)
        if "--stdin" in sys.argv:
            sys.stdin.read()
        else:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
