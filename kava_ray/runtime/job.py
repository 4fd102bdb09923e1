"""From a job config to Ray: the embedded Ray's size, the teacher pool (found, started,
identity-checked), the plans of a running pool or a KV cache, KV sources and precompute.

The one orchestration path: `kava-ray train`, `tune`, `eval`, `teachers precompute`, `align cka`,
`demo` and the benches all call these functions, so they agree on how many CPUs an embedded Ray
declares, which teachers run and where a worker's teacher KV comes from. The Ray-free half (plans,
logit rules, splits, seeds) is `kava_ray.core.plans`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm import tqdm

from actors.kv_cache import CacheSource, CacheWriter, KVCache, cache_meta, check_logits
from actors.kv_cache import precompute as write_cache
from actors.pool import (
    check_resources,
    find_pool,
    pool_status,
    start_missing,
    start_pool,
    stop_pool,
    unplaceable,
    vllm_limits,
)
from kava_ray.common import placement, resources
from kava_ray.common.config import JobConfig, derive
from kava_ray.common.errors import KavaError, root_cause
from kava_ray.core.kv import kv_bytes_per_token
from kava_ray.core.plans import (
    TeacherPlan,
    check_vocab,
    logits_top_k,
    student_geometry,
    student_tokenizer,
    teacher_logits_top_k,
    teacher_plans,
    teacher_tokenizers,
    vocab_maps,
    wants_hidden,
)
from kava_ray.data.splits import load_splits, load_test_split
from kava_ray.data.tokenize import portable
from kava_ray.rollout.feed import ActorSource
from kava_ray.runtime.connect import connect, owned_ray, resolve_use_gpu
from kava_ray.runtime.console import status
from kava_ray.runtime.node_paths import Read, check_node_paths, reads, tokenizer_reads
from kava_ray.runtime.planner import check_fits
from kava_ray.runtime.preflight import preflight

# ----------------------------------------------------------------------------------------- Ray


def connect_job(cfg: JobConfig, address: Optional[str] = None, concurrent_runs: int = 1,
                require_cluster: bool = False) -> str:
    """Connect to the job's Ray (`address`, else `ray.address`, else an embedded one sized for the job)."""
    return connect(address or cfg.ray.address, cfg.ray.namespace,
                   num_cpus=cfg.ray.num_cpus or resources.embedded_cpus(cfg, concurrent_runs),
                   require_cluster=require_cluster)


def job_session(cfg: JobConfig, address: Optional[str] = None, concurrent_runs: int = 1,
                require_cluster: bool = False, client: bool = False):
    """`with job_session(cfg) as connected:` the job's Ray (`connect_job`) for the block; on exit
    the Ray it started is shut down (`connect.owned_ray`; `client`: always left, a cluster's
    client)."""
    return owned_ray(connect_job(cfg, address, concurrent_runs, require_cluster), client)


# ------------------------------------------------------------------------------------ teachers


@dataclass
class JobTeachers:
    """What `job_teachers` yields: the pool's handles (None when the KV cache serves the teachers),
    the plans, the replicas started here (labels; empty when the whole pool was running), and how
    Ray was reached (`connect`'s answer)."""

    cfg: JobConfig
    handles: Optional[dict]
    plans: dict[str, TeacherPlan]
    started: list[str]
    connected: str
    setup_s: float = 0.0
    use_gpu: Optional[bool] = None  # whether Train workers would get GPUs (ray.use_gpu resolved on this cluster)

    def source(self, data_fingerprint: Optional[str] = None):
        """The KV source of this job (the cache, or these handles)."""
        return kv_source(self.cfg, self.plans, data_fingerprint, handles=self.handles)


@contextlib.contextmanager
def job_teachers(cfg: JobConfig, address: Optional[str] = None, restart: bool = False, concurrent_runs: int = 1,
                 command: str = "") -> Iterator[JobTeachers]:
    """The one way a command holds its teachers: connect to the job's Ray (or join one), find or
    start the pool and check its identity (`setup_teachers`; the KV cache when `data.kv_source:
    cache`), yield the plans and the KV source. On exit it stops only the teacher replicas it
    started (a pool that was running, or the part of it that was, stays up) and shuts down only a
    Ray it started (whose teachers go with it).

    command: "train" / "tune" when Ray Train workers will run: once Ray is up and before any teacher
    starts, the run's actors must fit the cluster (`check_run_fits`) and, on a cluster, the local
    paths they and the teachers read are looked at on the nodes that read them
    (`kava_ray.runtime.node_paths`).
    """
    t0 = time.time()
    with job_session(cfg, address, concurrent_runs) as connected:
        use_gpu = resolve_use_gpu(cfg.ray.use_gpu)
        if command in ("train", "tune"):
            check_run_fits(cfg, command, connected, t0, use_gpu)
        on_nodes = connected != "embedded"  # other nodes than this one may read the job's local paths
        if on_nodes:
            check_node_paths(reads(cfg, command, use_gpu))
        t0 = time.time()
        handles, plans, started = setup_teachers(cfg, restart=restart)
        try:
            if on_nodes and command in ("train", "tune"):
                check_node_paths(tokenizer_reads(cfg, plans, use_gpu))
            yield JobTeachers(cfg, handles, plans, started, connected, time.time() - t0, use_gpu)
        finally:
            # an embedded Ray's teachers go with its shutdown (`owned_ray`); stopping them here
            # would ask its GCS, which a SIGTERM to the whole process group (Slurm, `timeout`) has
            # ended: 60 s, then the process dies
            if started and connected != "embedded":
                stop_pool(cfg, only=started)


def check_run_fits(cfg: JobConfig, command: str, connected: str, t0: float, use_gpu: bool) -> None:
    """Ray is up, no teacher has started: the teachers and a run's Train workers (`train`: with the
    run's controller, and its planned memory on the smallest GPU) must fit, node by node."""
    status(f"connecting: {describe_ray(connected)} in {time.time() - t0:.0f} s")
    if command == "tune":  # the teachers and one trial's Train workers
        check_resources(cfg, workers=resources.worker(cfg, use_gpu))
        return
    check_resources(cfg, extra=resources.run(cfg, use_gpu), workers=resources.worker(cfg, use_gpu))
    if use_gpu:
        check_gpu_memory(cfg)


def check_gpu_memory(cfg: JobConfig) -> None:
    """Refuse a config the planner says cannot fit the cluster's smallest GPU (one line + the fix)."""
    @ray.remote(num_gpus=0.001, num_cpus=0)
    def gpu_memory() -> int:  # runs on a GPU node: the driver may be a CPU-only head
        return torch.cuda.get_device_properties(0).total_memory

    check_fits(cfg, int(ray.get(gpu_memory.remote(), timeout=120)))


def describe_ray(connected: str) -> str:
    """`embedded Ray (8 CPUs, 127.0.0.1)` / `Ray at ADDRESS (16 CPUs, 2 GPUs)`."""
    res = ray.cluster_resources()
    parts = [f"{res.get('CPU', 0):.0f} CPUs"] + ([f"{res['GPU']:.0f} GPUs"] if res.get("GPU") else [])
    if connected in ("embedded", "existing"):
        with contextlib.suppress(Exception):
            parts.append(ray.util.get_node_ip_address())
        kind = "embedded Ray" if connected == "embedded" else "this process's Ray"
        return f"{kind} ({', '.join(parts)})"
    return f"Ray at {connected} ({', '.join(parts)})"


def teacher_geometries(handles: dict) -> dict[str, dict]:
    """{teacher: geometry dict} as the running actors report it (layers, heads, dims, tokenizer...)."""
    return dict(zip(handles, ray.get([h.geometry.remote() for h in handles.values()])))


def live_plans(cfg: JobConfig, handles: dict) -> dict[str, TeacherPlan]:
    """Plans for a running pool: its geometries; teachers of another tokenizer are aligned by characters."""
    geoms = teacher_geometries(handles)
    s_geom = student_geometry(cfg.student)
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, s_geom, student_tokenizer(cfg.student)[1])
    check_vocab(cfg.loss, plans)
    return plans


def teacher_weights(handles: dict) -> dict[str, list[dict]]:
    """{teacher: [{loaded, now, node} of each replica]}, each read by the replica on its own node
    (`TeacherActor.weights_now`)."""
    hs = {n: list(getattr(h, "handles", [h])) for n, h in handles.items()}
    got = iter(ray.get([r.weights_now.remote() for rs in hs.values() for r in rs]))
    return {n: [next(got) for _ in rs] for n, rs in hs.items()}


def identity_mismatch(cfg: JobConfig, teacher_geoms: dict[str, dict], weights: dict[str, list[dict]]) -> Optional[str]:
    """Why a running pool cannot serve this config (the first differing field, one line), or None.

    A pool is found by name; this checks it is the teacher the config describes: same model,
    quantization, dtype and key space, and (`weights`, from `teacher_weights`) the same weights as
    its model path holds now on the node of each replica — compared by content, so copies of the
    same weights on several nodes pass — with every replica holding the same weights.
    """
    for t in cfg.teachers:
        g = teacher_geoms[t.name]
        wanted = {"model": t.model, "quantization": t.quantization, "dtype": t.dtype, "engine": t.engine,
                  "key_space": cfg.align.key_space}
        served = {"model": g.get("model"), "quantization": g.get("quantization"), "dtype": g.get("requested_dtype"),
                  "engine": g.get("engine", "hf"), "key_space": g.get("key_space")}
        for field, want in wanted.items():
            if served[field] != want:
                key = "align.key_space" if field == "key_space" else f"teachers[{t.name}].{field}"
                return (f"running teacher '{t.name}' was started with {field}={served[field]!r}, the config asks for "
                        f"{key}={want!r}")
        if t.engine == "vllm":  # its engine's limits, set when it started (`vllm_limits`)
            for field, want in vllm_limits(cfg).items():
                if g.get(field, 0) < want:
                    return (f"running teacher '{t.name}' was started with vLLM's {field} {g.get(field)}, this job "
                            f"needs {want} (loss.logit_top_k / train.max_length): restart it (kava-ray teachers "
                            f"down)")
        replicas = weights[t.name]
        for i, w in enumerate(replicas):
            if w["now"] is not None and w["loaded"] not in (None, w["now"]):
                where = f"replica {i}, " if len(replicas) > 1 else ""
                return (f"running teacher '{t.name}' ({where}node {w['node']}) loaded other weights than {t.model!r} "
                        f"holds there now (rewritten since?)")
        loaded = {w["loaded"] for w in replicas if w["loaded"] is not None}
        if len(loaded) > 1:
            nodes = ", ".join(f"replica {i} on node {w['node']}" for i, w in enumerate(replicas))
            return (f"teacher '{t.name}': its replicas loaded different weights from {t.model!r} ({nodes}): the "
                    f"copies on those nodes differ")
    return None


def setup_teachers(cfg: JobConfig, restart: bool = False) -> tuple[Optional[dict], dict[str, TeacherPlan], list[str]]:
    """(pool handles or None, teacher plans, the replicas started here): a running pool, a new one
    (or the part of it that was not running), or the KV cache.

    A running pool started for another config (model, weights, quantization, dtype, key space) is
    refused in one line, or replaced with `restart` (`--restart-teachers`).
    """

    if cfg.data.kv_source == "cache":
        cache = KVCache(cfg.data.kv_cache_dir)
        check_logits(cache.root, cache.meta, logits_top_k(cfg.loss))
        meta = cache.meta["teachers"]
        missing = [t.name for t in cfg.teachers if t.name not in meta]
        if missing:
            raise KavaError(f"KV cache {cfg.data.kv_cache_dir} has no teacher {missing[0]!r}")
        student_fp = student_tokenizer(cfg.student)[1]
        # a teacher of another tokenizer: the cache holds a copy of its tokenizer (no teacher model needed)
        geoms = {n: dict(t["geometry"], tokenizer_fingerprint=t.get("tokenizer_fingerprint", student_fp))
                 for n, t in meta.items()}
        dirs = {n: str(cache.root / t["tokenizer"]) for n, t in meta.items() if t.get("tokenizer")}
        s_geom = student_geometry(cfg.student)
        plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, s_geom, student_fp, dirs)
        check_vocab(cfg.loss, plans)
        return None, plans, []
    try:
        handles, started = find_pool(cfg), []
    except KavaError:  # none or part of the pool runs (fewer replicas): attach to what runs, start the rest
        handles, started = start_missing(cfg)  # start_pool checks the resources first
    mismatch = identity_mismatch(cfg, teacher_geometries(handles), teacher_weights(handles))
    if mismatch is not None:
        if not restart:
            raise KavaError(f"{mismatch}; stop it (kava-ray teachers down) or pass --restart-teachers")
        stop_pool(cfg)
        handles, started = start_missing(cfg)  # all of them now
    return handles, live_plans(cfg, handles), started


def kv_source(cfg: JobConfig, plans: dict[str, TeacherPlan], data_fingerprint: Optional[str] = None,
              handles: Optional[dict] = None):
    """Where a consumer's teacher KV comes from: the on-disk cache (`data.kv_source: cache`, checked
    against this job when `data_fingerprint`, the training split's fingerprint, is given) or the
    live actors (`handles`, else found by name)."""

    if cfg.data.kv_source == "cache":
        meta = (cache_meta(cfg, plans, data_fingerprint, logits_top_k(cfg.loss), wants_hidden(cfg.loss))
                if data_fingerprint is not None else None)
        return CacheSource(KVCache(cfg.data.kv_cache_dir, meta))
    return ActorSource(handles if handles is not None else find_pool(cfg, list(plans)),
                       unplaceable=functools.partial(unplaceable, cfg), lost_wait_s=cfg.ray.lost_teacher_wait_s)


# ---------------------------------------------------------------------------------------- data


def teacher_pool(cfg: JobConfig, action: str, address: Optional[str] = None) -> dict:
    """`kava-ray teachers up | status | down` on a running cluster: start the pool as detached
    actors (they outlive the command), list it, or stop it. Returns {"action", "teachers" (up: names
    with replica counts, status: rows, down: the stopped names), "namespace"}."""
    with job_session(cfg, address, require_cluster=True, client=True):  # the pool (detached) outlives it
        if action == "up":
            check_node_paths(reads(cfg))  # the teachers' model paths, on the nodes that load them
            handles = start_pool(cfg, detached=True)
            out = [n + (f" ({len(h)} replicas)" if len(h) > 1 else "") for n, h in handles.items()]
        elif action == "down":
            out = stop_pool(cfg)
        elif action == "status":
            out = pool_status(cfg)
        else:
            raise KavaError(f"unknown teachers action {action!r} (up, status, down)")
    return {"action": action, "teachers": out, "namespace": cfg.ray.namespace}


def precompute(cfg: JobConfig, out_dir, progress: bool = True, restart_teachers: bool = False,
               address: Optional[str] = None) -> dict:
    """`kava-ray teachers precompute`: the teacher KV of every example of the training, validation
    and test splits to disk, once each (`actors.kv_cache`: any batch size, data seed or number of
    epochs reads it), from the running pool (checked against the config) or one started for it."""
    preflight(cfg, "teachers precompute", out=out_dir, address=address)  # before any teacher starts
    if cfg.data.kv_source != "live":  # precompute always asks live teachers
        cfg = derive(cfg, {"data.kv_source": "live"})
    with job_teachers(cfg, address, restart=restart_teachers) as job:
        tok = student_tokenizer(cfg.student)[0]
        teacher_toks = teacher_tokenizers(job.plans)
        splits = [*load_splits(cfg.data, cfg.train, tok, teacher_toks),
                  load_test_split(cfg.data, cfg.train, tok, teacher_toks)]
        bar = tqdm(total=sum(len(s) for s in splits), desc="precompute", unit="example",
                   disable=None if progress else True)

        def report(stats):
            bar.n = stats["written"] + stats["skipped"]
            bar.refresh()

        args = (cfg, job.handles, job.plans, splits, Path(out_dir).expanduser().absolute())
        kwargs = dict(logits_top_k=teacher_logits_top_k(cfg.loss, job.plans), tokenizers=teacher_toks,
                      vocab_maps=vocab_maps(cfg.loss, cfg.student, job.plans, tok,
                                            teacher_toks), hidden=wants_hidden(cfg.loss))
        try:
            node = writer_node(cfg, job.handles, job.plans)
            if node is None:  # the teachers' KV is on this node: written from here
                return write_cache(*args, progress=report, **kwargs)
            return _write_on(node, cfg, out_dir, args, kwargs, report)
        finally:
            bar.close()


def writer_node(cfg: JobConfig, handles: dict, plans: dict) -> Optional[str]:
    """Where `teachers precompute` writes the cache from: the node of the teacher that ships the
    most KV per token (its first replica), or None when that is this driver's node."""
    heaviest = max(plans, key=lambda n: kv_bytes_per_token(plans[n].geometry, cfg.align.wire_dtype, plans[n].layers))
    node = teacher_weights({heaviest: handles[heaviest]})[heaviest][0].get("node_id")  # (a pool of an older version:
    return None if node in (None, ray.get_runtime_context().get_node_id()) else node  # none; written from here)


def _write_on(node: str, cfg: JobConfig, out_dir, args: tuple, kwargs: dict, report: Callable[[dict], None]) -> dict:
    """`actors.kv_cache.precompute` in a `CacheWriter` actor on `node`; the cache dir must be the
    one the driver sees (shared storage), which a file the driver writes there proves before
    anything is written."""
    writer_demand = placement.Demand("the KV cache writer", {})
    check_node_paths([Read("--out", str(out_dir), "the teachers", writer_demand, writes=True, does="write their KV")],
                     only={node})
    cfg_, handles, plans, splits, out = args
    args = (cfg_, handles, plans, [portable(s) for s in splits], out)  # rows, not the driver's cache-file paths
    writer = CacheWriter.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    try:
        done = writer.run.remote(*args, **kwargs)
        while not ray.wait([done], timeout=1.0)[0]:
            report(ray.get(writer.progress.remote()) or {"written": 0, "skipped": 0})
        stats = ray.get(done)
    except ray.exceptions.RayError as e:  # the writer's KavaError (a cache of another job, a bad batch) or its end
        raise KavaError(f"teachers precompute on node {node[:8]}: {root_cause(e)}") from None
    finally:
        ray.kill(writer)
    report(stats)
    return stats
