"""Start, find and stop the named teacher pool of a job config.

Actors are named `kava-teacher-<name>` in the config's Ray namespace, so any driver, train worker
or Tune trial on the cluster can find them. Each actor takes the GPUs/CPUs its teacher asks for
(fractional GPUs colocate small teachers; a teacher with several GPUs gets a PACK placement group,
i.e. all its GPUs on one node), restarts after a crash (`max_restarts`) and Ray retries the
request that was in flight (`max_task_retries`).
"""

from __future__ import annotations

import time
from typing import Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.teacher import TeacherActor
from kava_ray._io import first_line
from kava_ray.config import JobConfig, TeacherConfig
from kava_ray.errors import KavaError

ACTOR_PREFIX = "kava-teacher-"
TASK_RETRIES = 5
RemoteTeacher = ray.remote(TeacherActor)


def actor_name(teacher_name: str) -> str:
    return f"{ACTOR_PREFIX}{teacher_name}"


def check_resources(cfg: JobConfig, extra: Optional[dict] = None) -> None:
    """Fail fast, with one line, when the cluster cannot ever hold the pool (+ `extra`, e.g. the students).

    Ray would otherwise wait forever for resources that do not exist.
    """
    total = ray.cluster_resources()
    need = {"GPU": sum(t.num_gpus for t in cfg.teachers), "CPU": sum(t.num_cpus for t in cfg.teachers)}
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


def _actor_options(t: TeacherConfig, namespace: str, detached: bool) -> dict:
    opts = dict(
        name=actor_name(t.name),
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
    if t.num_gpus > 1:  # one teacher across several GPUs: keep them on one node
        pg = placement_group([{"GPU": t.num_gpus, "CPU": t.num_cpus}], strategy="PACK",
                             name=f"{actor_name(t.name)}-pg", lifetime="detached" if detached else None)
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
    return opts


def start_pool(cfg: JobConfig, detached: bool = False, timeout_s: float = 600.0) -> dict:
    """Start (or attach to) every teacher of `cfg`; returns {name: actor handle} once all are loaded.

    Raises KavaError with one line if a teacher cannot be scheduled or cannot load its model.
    """
    check_resources(cfg)
    handles = {}
    for t in cfg.teachers:
        handles[t.name] = RemoteTeacher.options(**_actor_options(t, cfg.ray.namespace, detached)).remote(
            t.model_dump(), key_space=cfg.align.key_space)
    wait_ready(handles, timeout_s)
    return handles


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
    """Handles of a running pool (all teachers of cfg, or `names`); KavaError naming a missing one."""
    wanted = names if names is not None else [t.name for t in cfg.teachers]
    handles = {}
    for name in wanted:
        cfg.teacher(name)  # unknown teacher name -> KavaError listing the known ones
        try:
            handles[name] = ray.get_actor(actor_name(name), namespace=cfg.ray.namespace)
        except ValueError:
            raise KavaError(f"teacher '{name}' is not running in namespace '{cfg.ray.namespace}' "
                            f"(start it with: kava-ray teachers up --config ...)") from None
    return handles


def stop_pool(cfg: JobConfig) -> list[str]:
    """Kill every running teacher of cfg (and its placement group); returns the names stopped."""
    from ray.util import get_placement_group

    stopped = []
    for t in cfg.teachers:
        try:
            h = ray.get_actor(actor_name(t.name), namespace=cfg.ray.namespace)
        except ValueError:
            continue
        ray.kill(h, no_restart=True)
        stopped.append(t.name)
        if t.num_gpus > 1:
            try:
                remove_placement_group(get_placement_group(f"{actor_name(t.name)}-pg"))
            except ValueError:
                pass
    return stopped


def pool_status(cfg: JobConfig) -> list[dict]:
    """One row per teacher of cfg: geometry, device, counters; `running: False` for a missing one."""
    from kava_ray.kv import kv_bytes_per_token
    from kava_ray.models import KVGeometry

    rows = []
    for t in cfg.teachers:
        row = dict(name=t.name, model=t.model, quantization=t.quantization, running=False)
        try:
            h = ray.get_actor(actor_name(t.name), namespace=cfg.ray.namespace)
            geom, stats = ray.get([h.geometry.remote(), h.stats.remote()], timeout=60)
        except (ValueError, ray.exceptions.RayError):
            rows.append(row)
            continue
        g = KVGeometry.from_dict(geom)
        row.update(running=True, device=geom["device"], dtype=geom["dtype"],
                   geometry=f"{g.num_layers}x{g.num_kv_heads}x{g.head_dim}",
                   kv_bytes_per_token=kv_bytes_per_token(g, "bf16", t.layers),
                   restarts=_num_restarts(actor_name(t.name), cfg.ray.namespace), **stats)
        rows.append(row)
    return rows


def _num_restarts(name: str, namespace: str):
    """Restart count from Ray's state API (needs the dashboard); '?' when it is not available."""
    try:
        from ray.util.state import list_actors

        # the cluster this driver is connected to (auto-detection fails when a machine runs two Rays)
        found = list_actors(address=ray.get_runtime_context().gcs_address, timeout=5, raise_on_missing_output=False,
                            detail=True,  # num_restarts is a detail field (None without it)
                            filters=[("name", "=", name), ("ray_namespace", "=", namespace)])
        alive = [a for a in found if a.state != "DEAD"] or found
        return int(alive[0].num_restarts) if alive else "?"
    except Exception:  # noqa: BLE001 - status must not fail because the dashboard is off
        return "?"
