"""The local paths a job reads on other nodes than the driver's, looked at on those nodes before anything starts.

A zero-CPU task on every other node that could run a reader looks at each path and compares it with
the driver's; one line names the first key and node where it is missing or differs. Why:
docs/internals/runtime.md#node-paths.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.pool import cluster_nodes
from kava_ray.common import placement, resources
from kava_ray.common.config import JobConfig
from kava_ray.common.errors import KavaError
from kava_ray.common.files import first_line
from kava_ray.runtime.path_look import look, look_all
from kava_ray.runtime.preflight import data_splits

PROBE_TIMEOUT_S = 120.0
MARKER = ".kava-shared-check"
WORKERS = "the Ray Train workers"


@dataclass
class Read:
    key: str  # the config key, for the message
    path: str  # absolute
    who: str  # who reads it there: "the Ray Train workers", "teacher 'q'"
    demand: placement.Demand  # where that reader can run
    writes: bool = False  # written on the node (ray.storage_path, a KV cache), so it must be the driver's own dir
    does: str = "read it"  # what `who` does with it there, for the message
    # the driver reads it too (data, the student), so a node's copy must be the driver's; a
    # teacher's model (which a driver on a CPU head need not have) must only be there: replicas'
    # weights are compared with each other by the identity check once they load
    driver_reads: bool = True


def _local(spec: Optional[str]) -> bool:
    return bool(spec) and "://" not in spec and os.path.isabs(spec)


def _worker_demand(cfg: JobConfig, use_gpu: bool) -> placement.Demand:
    """Where a Ray Train worker can run (its resources and `ray.worker_label_selector`)."""
    return resources.demands(cfg, resources.worker(cfg, use_gpu))[-1]


def reads(cfg: JobConfig, command: str = "", use_gpu: bool = False) -> list[Read]:
    """What each kind of process of the job reads from a local path, and where it can run: teachers
    their models when they run live; for `command` train or tune, the Ray Train workers the job's
    inputs; for tune, each trial (a driver of 0.01 CPU, anywhere) its layer map. Other commands read
    their student side here."""
    out = []
    if cfg.data.kv_source != "cache":
        for t, demand in zip(cfg.teachers, resources.demands(cfg)):
            key = f"teachers[{t.name}].tokenizer" if t.engine == "openai" else f"teachers[{t.name}].model"
            if _local(t.served_from()):
                out.append(Read(key, t.served_from(), f"teacher '{t.name}'", demand,
                                driver_reads=False))
    if command not in ("train", "tune"):
        return out
    w = _worker_demand(cfg, use_gpu)
    d = cfg.data
    if _local(cfg.student.model):
        out.append(Read("student.model", cfg.student.model, WORKERS, w))
    if _local(d.source):
        for path in dict.fromkeys(d.source.replace("{split}", s) for s in data_splits(cfg, command)):
            out.append(Read("data.source", path, WORKERS, w))
    if d.kv_source == "cache":  # with the tokenizers of the teachers aligned by characters
        out.append(Read("data.kv_cache_dir", d.kv_cache_dir, WORKERS, w))
    if _local(cfg.ray.storage_path):
        out.append(Read("ray.storage_path", cfg.ray.storage_path, WORKERS, w, writes=True, does="write checkpoints"))
    if command == "tune" and cfg.align.layer_map == "cka" and _local(cfg.align.cka_path):
        trial = placement.Demand("a Tune trial", {"CPU": resources.TRIAL_CPUS})
        out.append(Read("align.cka_path", cfg.align.cka_path, "the Tune trials", trial))
    return out


def tokenizer_reads(cfg: JobConfig, plans: dict, use_gpu: bool = False) -> list[Read]:
    """The tokenizers of the live teachers aligned by characters (known once they report theirs):
    the workers load each from the teacher's model path."""
    w = _worker_demand(cfg, use_gpu)
    return [Read(f"teachers[{n}].model", p.tokenizer, f"{WORKERS} (its tokenizer)", w, driver_reads=False)
            for n, p in plans.items() if p.aligned and cfg.data.kv_source != "cache" and _local(p.tokenizer)]


def problem(r: Read, node: placement.Node, seen: Optional[str], here: Optional[str]) -> Optional[str]:
    """One line when what `node` sees at `r.path` is not what the driver sees (`here`; for a path
    the driver does not read: when the node sees nothing there, or cannot read it), else None."""
    if (seen == here) if r.driver_reads else (seen is not None and not seen.startswith("unreadable")):
        return None
    fix = "put it on storage that every node mounts at the same path, or copy it there"
    if r.writes:
        uri = ", or use a URI (s3://...)" if r.key == "ray.storage_path" else ""
        return (f"{r.key} {r.path} is not shared with {node.describe()}, where {r.who} {r.does}: mount shared "
                f"storage (NFS, EFS) at that path on every node{uri}")
    if seen is None:
        return f"{r.key} {r.path} is not on {node.describe()}, where {r.who} {r.does}: {fix}"
    if seen.startswith("unreadable"):
        return f"{r.key} {r.path} on {node.describe()} is {seen}, where {r.who} {r.does}"
    return f"{r.key} {r.path} on {node.describe()} differs from the driver's, where {r.who} {r.does}: {fix}"


def check_node_paths(wanted: list[Read], only: Optional[set[str]] = None) -> None:
    """KavaError (one line naming every such path) when a local path of `wanted` (`reads`,
    `tokenizer_reads`) is missing or different on another node that can read it, or
    `ray.storage_path` is not shared with a node its workers can run on. `only`: look on these node
    ids alone. Nothing runs when there is nothing to look at or the cluster has only the driver's
    node."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in cluster_nodes() if n.node_id != here and (only is None or n.node_id in only)]
    if not wanted or not nodes:
        return
    looked_at = [r.path for r in wanted]  # what is looked at for each read: the path, or the storage's marker
    markers = []
    try:
        for i, r in enumerate(wanted):
            if r.writes:  # a file only this driver writes: the node sees it only through shared storage
                Path(r.path).mkdir(parents=True, exist_ok=True)
                markers.append(Path(r.path) / f"{MARKER}-{uuid.uuid4().hex}")
                markers[-1].write_text(markers[-1].name)
                looked_at[i] = str(markers[-1])
        readers = {n.node_id: [i for i, r in enumerate(wanted) if placement.admits(r.demand, n)] for n in nodes}
        asked = {nid: look_all.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False))
                 .remote(sorted({looked_at[i] for i in idx})) for nid, idx in readers.items() if idx}
        try:
            seen = dict(zip(asked, ray.get(list(asked.values()), timeout=PROBE_TIMEOUT_S)))
        except ray.exceptions.GetTimeoutError:
            raise KavaError(f"the job's local paths could not be looked at on the cluster's nodes within "
                            f"{PROBE_TIMEOUT_S:.0f} s (are they up? `ray status`)") from None
        except ray.exceptions.RayError as e:  # e.g. a node that died since it was listed
            raise KavaError(f"the job's local paths could not be looked at on the cluster's nodes: "
                            f"{first_line(e)}") from None
        problems = []  # one per path (its first node), all in the line: a driver's local data and its storage path
        for i, r in enumerate(wanted):  # are fixed in one go, not one run each; in the order of `reads`
            mine = look(looked_at[i])
            lines = (problem(r, n, seen[n.node_id][looked_at[i]], mine) for n in nodes if i in readers[n.node_id])
            first = next((line for line in lines if line), None)
            if first:
                problems.append(first)
        if problems:
            raise KavaError("; ".join(problems))
    finally:
        for m in markers:
            m.unlink(missing_ok=True)
