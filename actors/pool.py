"""Start, find and stop the named teacher pool of a job config.

Actors are named `kava-teacher-<name>` in the config's Ray namespace, so any driver, train worker
or Tune trial on the cluster can find them. Each actor takes the GPUs/CPUs its teacher asks for
(fractional GPUs colocate small teachers; a teacher with several GPUs gets a PACK placement group,
i.e. all its GPUs on one node), restarts after a crash (`max_restarts`) and Ray retries the
request that was in flight (`max_task_retries`).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
import zlib
from typing import Optional

import ray
from ray.util import get_placement_group
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.teacher import TeacherActor
from kava_ray.common import placement, resources
from kava_ray.common.config import JobConfig, TeacherConfig, replica_label
from kava_ray.common.errors import KavaError
from kava_ray.common.files import first_line
from kava_ray.core.kv import kv_bytes_per_token
from kava_ray.core.models import KVGeometry
from kava_ray.core.plans import logits_top_k

ACTOR_PREFIX = "kava-teacher-"
TASK_RETRIES = 5
RemoteTeacher = ray.remote(TeacherActor)


def vllm_limits(cfg: JobConfig) -> dict:
    """What a vLLM teacher's engine must allow for this job: max_logprobs (its top-k) and
    max_model_len (its longest sequence, + the one token a prompt-log-prob request generates)."""
    return {"max_logprobs": logits_top_k(cfg.loss), "max_model_len": cfg.train.max_length + 1}


def _remote(t: TeacherConfig, cfg: JobConfig, options: dict):
    """A teacher actor for `t`: `TeacherActor`, with `engine: vllm` `VLLMTeacherActor` (imported
    only then: the module needs vLLM at call time, not at import), with `engine: openai`
    `URLTeacherActor`."""
    if t.engine == "openai":
        from actors.url_teacher import URLTeacherActor

        return ray.remote(URLTeacherActor).options(**options).remote(t.model_dump(), key_space=cfg.align.key_space)
    if t.engine != "vllm":
        return RemoteTeacher.options(**options).remote(t.model_dump(), key_space=cfg.align.key_space)
    from actors.vllm_teacher import VLLMTeacherActor

    engine = dict(vllm_limits(cfg), kv_cache_mb=t.vllm_kv_cache_mb,
                  gpu_memory_utilization=t.vllm_gpu_memory_utilization)
    return ray.remote(VLLMTeacherActor).options(**options).remote(t.model_dump(), key_space=cfg.align.key_space,
                                                                   engine=engine)


def actor_name(teacher_name: str, replica: int = 0) -> str:
    """The Ray actor name of a teacher's replica: `kava-teacher-<name>`, then `kava-teacher-<name>#1`, ..."""
    return f"{ACTOR_PREFIX}{replica_label(teacher_name, replica)}"


_BATCH_INDEX = re.compile(r"/e(\d+)/b(\d+)(?:/|$)")


def replica_for(key: Optional[str], n: int) -> Optional[int]:
    """The replica that serves batch `key` of a teacher with n replicas; None for key None (any replica).

    A function of the key alone, so every consumer of a batch (DDP ranks, Tune trials) asks the same
    replica and its LRU serves them all from one forward. A `batch_key` goes by its global batch
    index mod n: consecutive batches take turns, so a feed with n batches in flight keeps all n
    replicas busy (a hash would send ~1/n of neighbouring batches to one replica). Any other key
    goes by its CRC32.
    """
    if n == 1:
        return 0
    if key is None:
        return None
    m = _BATCH_INDEX.search(key)
    if m:
        return int(m.group(2)) % n
    return zlib.crc32(key.encode()) % n


class TeacherReplicas:
    """The actor handles of one teacher's replicas (`teachers[].replicas`), in replica order.

    `route(key)` picks the replica for a batch (`replica_for`; key None: round robin). Anything else
    — `geometry`, `ping`, `stats` — is replica 0's: replicas of one teacher are the same model.
    """

    def __init__(self, name: str, handles: list):
        if not handles:
            raise ValueError("a teacher needs at least one replica")
        self.name, self.handles = name, list(handles)
        self._next = itertools.count()

    def __len__(self) -> int:
        return len(self.handles)

    def route(self, key: Optional[str]):
        r = replica_for(key, len(self.handles))
        return self.handles[next(self._next) % len(self.handles) if r is None else r]

    def __getattr__(self, attr):  # geometry / ping / stats / kv of replica 0
        if attr.startswith("__") or attr in ("name", "handles", "_next"):
            raise AttributeError(attr)
        return getattr(self.handles[0], attr)

    def __reduce__(self):  # the round-robin counter does not travel
        return TeacherReplicas, (self.name, self.handles)


def check_resources(cfg: JobConfig, extra: Optional[dict] = None, workers: Optional[dict] = None) -> None:
    """Fail fast, with one line, when the cluster cannot ever hold the pool (+ `extra`, e.g. the
    students), in all and node by node (each teacher replica, and each Ray Train worker of `workers`
    resources, on one node its label selector admits: kava_ray.common.placement).

    Ray would otherwise wait forever for resources that do not exist.
    """
    total = ray.cluster_resources()
    need = resources.pool(cfg)
    for k, v in (extra or {}).items():
        need[k] = need.get(k, 0) + v
    for t in cfg.teachers:
        if t.num_gpus > total.get("GPU", 0):
            raise KavaError(f"teacher '{t.name}' asks for {t.num_gpus:g} GPUs but the cluster has "
                            f"{total.get('GPU', 0):g}")
    for res, amount in need.items():
        have = total.get(res, 0)
        if amount > have + 1e-9:
            raise KavaError(f"job needs {amount:g} {res} (teachers {'+ students ' if extra else ''}together) "
                            f"but the cluster has {have:g}")
    problem = placement.fit(cluster_nodes(), resources.demands(cfg, workers))
    if problem:
        raise KavaError(problem)


def unplaceable(cfg: JobConfig, teacher: str) -> Optional[str]:
    """Why `teacher` could not run now, or None: no live node that its selector admits can hold one
    replica on its totals (`placement`) — its node died and none other is there to take it. Names
    the dead nodes it could have run on. Asked by the feed while an answer is late (`ActorSource`).
    On totals, not on what is free: a node whose resources other actors hold would still be waited
    on."""
    t = cfg.teacher(teacher)
    demand = dataclasses.replace(resources.demands(cfg)[cfg.teachers.index(t)], count=1)
    why = placement.fit(cluster_nodes(), [demand])
    if why is None:
        return None
    gone = [n for n in cluster_nodes(alive=False) if placement.matches(demand.selector, n.labels)]
    gone = [f"node {n.node_id[:8]} ({n.address})" for n in gone]  # (a dead node reports no resources)
    where = f"the nodes it ran on or could run on are gone ({', '.join(gone)})" if gone else "it has no node"
    return f"teacher '{t.name}' cannot run again: {where}, and {why}"


def cluster_nodes(alive: bool = True) -> list:
    """The cluster's live (or dead) nodes, their total resources and labels (`ray.nodes()`), for
    `kava_ray.common.placement`."""
    return [placement.Node(n["NodeID"], n.get("NodeManagerAddress", "?"), dict(n.get("Resources") or {}),
                           dict(n.get("Labels") or {})) for n in ray.nodes() if bool(n.get("Alive")) == alive]


def _actor_options(t: TeacherConfig, namespace: str, detached: bool, replica: int = 0) -> dict:
    opts = dict(
        name=actor_name(t.name, replica),
        namespace=namespace,
        num_cpus=t.num_cpus,
        num_gpus=t.num_gpus,
        max_restarts=t.max_restarts,
        max_task_retries=TASK_RETRIES,
        get_if_exists=True,
        lifetime="detached" if detached else None,
        # not inside the caller's placement group (a Tune trial's): teachers ask for their own resources
        scheduling_strategy="DEFAULT",
    )
    if t.num_gpus > 1:  # one teacher across several GPUs: keep them on one node (the bundle's selector places it)
        pg = placement_group([{"GPU": t.num_gpus, "CPU": t.num_cpus}], strategy="PACK",
                             name=f"{actor_name(t.name, replica)}-pg", lifetime="detached" if detached else None,
                             bundle_label_selector=[dict(t.label_selector)] if t.label_selector else None)
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
    elif t.label_selector:
        opts["label_selector"] = dict(t.label_selector)
    return opts


def start_pool(cfg: JobConfig, detached: bool = False, timeout_s: float = 600.0) -> dict:
    """Start (or attach to) every teacher of `cfg`, every replica; returns {name: TeacherReplicas}
    once all are loaded.

    Raises KavaError with one line if a teacher cannot be scheduled or cannot load its model.
    """
    check_resources(cfg)
    replicas = {}
    for t in cfg.teachers:
        replicas[t.name] = TeacherReplicas(t.name, [
            _remote(t, cfg, _actor_options(t, cfg.ray.namespace, detached, r)) for r in range(t.replicas)])
    wait_ready({replica_label(n, r): h for n, rs in replicas.items() for r, h in enumerate(rs.handles)}, timeout_s)
    return replicas


def wait_ready(handles: dict, timeout_s: float = 600.0) -> None:
    """Block until every teacher has loaded; a load error kills the pool and becomes a KavaError."""
    deadline = time.monotonic() + timeout_s
    pings = {name: h.ping.remote() for name, h in handles.items()}
    for name, ref in pings.items():
        try:
            err = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise KavaError(f"teacher '{name}' did not start within {timeout_s:.0f} s "
                            f"(not enough free resources on the cluster?)") from None
        except ray.exceptions.RayActorError as e:
            raise KavaError(f"teacher '{name}' died while loading: {first_line(e)}") from None
        if err is not None:
            for h in handles.values():
                ray.kill(h, no_restart=True)
            raise KavaError(f"teacher '{name}': {err}")


def find_pool(cfg: JobConfig, names: Optional[list[str]] = None) -> dict:
    """{name: TeacherReplicas} of a running pool (all teachers of cfg, or `names`), as many replicas
    as the config asks for; KavaError naming a missing one."""
    wanted = names if names is not None else [t.name for t in cfg.teachers]
    found = {}
    for name in wanted:
        t = cfg.teacher(name)  # unknown teacher name -> KavaError listing the known ones
        handles = []
        for r in range(t.replicas):
            try:
                handles.append(ray.get_actor(actor_name(name, r), namespace=cfg.ray.namespace))
            except ValueError:
                raise KavaError(f"teacher '{replica_label(name, r)}' is not running in namespace "
                                f"'{cfg.ray.namespace}' (start it with: kava-ray teachers up --config ...)") from None
        found[name] = TeacherReplicas(name, handles)
    return found


def _running_replicas(t: TeacherConfig, namespace: str) -> list[tuple[int, object]]:
    """(replica, handle) of every running replica of t: the config's count, and any more a pool
    started with a larger `replicas` left running."""
    out, r = [], 0
    while True:
        try:
            out.append((r, ray.get_actor(actor_name(t.name, r), namespace=namespace)))
        except ValueError:
            if r >= t.replicas:
                return out
        r += 1


def missing_replicas(cfg: JobConfig) -> list[str]:
    """Labels (`qwen`, `qwen#1`) of the replicas of cfg's teachers that are not running: what
    `start_pool` would start, so a command can stop exactly those when it is done."""
    out = []
    for t in cfg.teachers:
        running = {r for r, _ in _running_replicas(t, cfg.ray.namespace)}
        out += [replica_label(t.name, r) for r in range(t.replicas) if r not in running]
    return out


def start_missing(cfg: JobConfig, timeout_s: float = 600.0) -> tuple[dict, list[str]]:
    """`start_pool` that also says which replicas it started (`missing_replicas` before it):
    (handles, labels), so that whoever started them stops exactly those (`stop_pool(cfg,
    only=labels)`) and a pool it found stays."""
    started = missing_replicas(cfg)
    return start_pool(cfg, timeout_s=timeout_s), started


def stop_pool(cfg: JobConfig, only: Optional[list[str]] = None) -> list[str]:
    """Kill the running teachers of cfg (and their placement groups), or only the replicas labelled
    in `only` (those a command started); returns the labels stopped."""
    stopped = []
    for t in cfg.teachers:
        for r, h in _running_replicas(t, cfg.ray.namespace):
            if only is not None and replica_label(t.name, r) not in only:
                continue
            ray.kill(h, no_restart=True)
            stopped.append(replica_label(t.name, r))
            if t.num_gpus > 1:
                try:
                    remove_placement_group(get_placement_group(f"{actor_name(t.name, r)}-pg"))
                except ValueError:
                    pass
    return stopped


def pool_status(cfg: JobConfig) -> list[dict]:
    """One row per teacher of cfg: geometry, device, counters; `running: False` for a missing one."""
    rows = []
    for t in cfg.teachers:
        running = dict(_running_replicas(t, cfg.ray.namespace))
        for r in sorted(set(range(t.replicas)) | set(running)):
            row = dict(name=replica_label(t.name, r), model=t.model, quantization=t.quantization, running=False)
            rows.append(row)
            try:
                geom, stats = ray.get([running[r].geometry.remote(), running[r].stats.remote()], timeout=60)
            except (KeyError, ray.exceptions.RayError):
                continue
            g = KVGeometry.from_dict(geom)
            row.update(running=True, device=geom["device"], dtype=geom["dtype"],
                       geometry=f"{g.num_layers}x{g.num_kv_heads}x{g.head_dim}",
                       kv_bytes_per_token=kv_bytes_per_token(g, "bf16", t.layers),
                       restarts=_num_restarts(actor_name(t.name, r), cfg.ray.namespace), **stats)
    return rows


def pool_stats(handles: dict, since: Optional[dict] = None) -> dict:
    """{teacher: its counters summed over its replicas} (requests, forwards, hits, bytes, ...), and
    `replicas`: how many answered. Accepts bare actor handles too. `since`: an earlier answer of
    this function; the counters are then what happened after it (a pool found running has served
    other runs before; a counter that went down belongs to a restarted actor and counts from its
    restart)."""
    flat = [(n, h) for n, hs in handles.items() for h in getattr(hs, "handles", [hs])]
    out: dict = {}
    for (n, _), st in zip(flat, ray.get([h.stats.remote() for _, h in flat])):
        acc = out.setdefault(n, {"replicas": 0})
        acc["replicas"] += 1
        for k, v in st.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "mean_forward_ms":
                acc[k] = acc.get(k, 0) + v
    for n, acc in out.items():
        before = (since or {}).get(n, {})
        for k, v in acc.items():
            if k != "replicas" and before.get(k, 0) <= v:
                acc[k] = v - before.get(k, 0)
        acc["mean_forward_ms"] = 1000 * acc["forward_s"] / acc["forwards"] if acc.get("forwards") else 0.0
    return out


def _num_restarts(name: str, namespace: str):
    """Restart count from Ray's state API (needs the dashboard); '?' when it is not available."""
    try:
        from ray.util.state import list_actors  # needs ray[default] (the dashboard's packages): '?' without it

        # the cluster this driver is connected to (auto-detection fails when a machine runs two Rays)
        found = list_actors(address=ray.get_runtime_context().gcs_address, timeout=5, raise_on_missing_output=False,
                            detail=True,  # num_restarts is a detail field (None without it)
                            filters=[("name", "=", name), ("ray_namespace", "=", namespace)])
        alive = [a for a in found if a.state != "DEAD"] or found
        return int(alive[0].num_restarts) if alive else "?"
    except Exception:  # noqa: BLE001 - status must not fail because the dashboard is off
        return "?"
