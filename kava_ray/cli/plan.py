"""`kava-ray plan`: the memory and KV-throughput plan of a config, and whether it fits the GPUs (exit 3 if not)."""

from __future__ import annotations

import sys
from pathlib import Path

from kava_ray.cli.shared import EXIT_DOES_NOT_FIT, add_config_args, add_output, job_config, quiet, show
from kava_ray.common.errors import KavaError
from kava_ray.common.files import first_line


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory / KV-throughput plan of a config; does it fit the GPUs?")
    add_config_args(p)
    p.add_argument("--gpu-mem", default=None, help="memory per GPU, e.g. 8GiB, 24GB, 80GiB")
    p.add_argument("--tokens-per-s", type=float, default=None, help="target student tokens/s for KV bandwidth")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", default=None, metavar="CLUSTER_YAML",
                       help="also place the job on the nodes this Ray cluster launcher config can bring up")
    where.add_argument("--address", default=None,
                       help="also place the job on the live nodes of this running Ray cluster (auto = local head)")
    add_output(p, plan)


def plan(args) -> int:
    from kava_ray.runtime.planner import format_plan, parse_bytes
    from kava_ray.runtime.planner import plan as make_plan

    cfg = job_config(args)
    nodes, source = plan_nodes(args)
    p = make_plan(cfg, parse_bytes(args.gpu_mem) if args.gpu_mem else None, args.tokens_per_s, nodes, source)
    show(args, format_plan(p), p)
    if p["fits"] is False:
        print(p["advice"], file=sys.stderr)  # the verdict: "does not fit gpu0 (... > ...): set ..."
        return EXIT_DOES_NOT_FIT
    return 0


def plan_nodes(args) -> tuple:
    """The nodes `plan` places the job on: a cluster.yaml's node types (no Ray), a running cluster's
    live nodes (--address), or none."""
    if args.cluster:
        return cluster_yaml(args.cluster), args.cluster
    if args.address:
        return live_nodes(args), f"the cluster at {args.address}"
    return None, ""


def cluster_yaml(path: str) -> list:
    """The node types of a Ray cluster launcher config (no Ray); a bad file is a one-line error."""
    import yaml

    from kava_ray.common.placement import cluster_yaml_nodes

    try:
        spec = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise KavaError(f"--cluster {path}: {first_line(e)}") from None
    try:
        return cluster_yaml_nodes(spec if isinstance(spec, dict) else {}, path)
    except (TypeError, ValueError) as e:
        raise KavaError(f"--cluster {first_line(e)}") from None


def live_nodes(args) -> list:
    """The live nodes of the running cluster at --address (connects, reads them, disconnects)."""
    from actors.pool import cluster_nodes
    from kava_ray.runtime.connect import ray_session

    with quiet(args, "plan"), ray_session(args.address, "kava-plan", client=True, require_cluster=True):
        return cluster_nodes()
