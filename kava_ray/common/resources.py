"""What a job asks Ray for, in one place: a teacher replica, the teacher pool, a train worker, a whole run.

Pure arithmetic on the config (no Ray): the embedded Ray's size (`kava_ray.runtime.job`), the pool's
resource check (`actors.pool`), Ray Train's `resources_per_worker` (`kava_ray.recipes.train`) and
Tune's concurrency (`kava_ray.recipes.tune`) all read these, so they cannot disagree. A run = its
workers + Ray Train's controller (1 CPU).
"""

from __future__ import annotations

from typing import Optional

from kava_ray.common.config import JobConfig, TeacherConfig
from kava_ray.common.placement import Demand

CONTROLLER_CPUS = 1.0  # Ray Train V2's controller actor, per run (or Tune trial)
TRIAL_CPUS = 0.01  # a Tune trial's function, which only drives its run: anywhere there is a CPU


def replica(t: TeacherConfig) -> dict[str, float]:
    """One actor of teacher `t`: its CPUs and GPUs."""
    return {"CPU": t.num_cpus, "GPU": t.num_gpus}


def pool(cfg: JobConfig) -> dict[str, float]:
    """Every replica of every teacher."""
    return {"CPU": sum(t.num_cpus * t.replicas for t in cfg.teachers),
            "GPU": sum(t.num_gpus * t.replicas for t in cfg.teachers)}


def worker(cfg: JobConfig, use_gpu: bool) -> dict[str, float]:
    """One Ray Train worker (`ScalingConfig.resources_per_worker`)."""
    return {"CPU": cfg.ray.cpus_per_worker, **({"GPU": cfg.ray.gpus_per_worker} if use_gpu else {})}


def run(cfg: JobConfig, use_gpu: bool) -> dict[str, float]:
    """One training run (or Tune trial): its workers and Train's controller."""
    w = worker(cfg, use_gpu)
    return {"CPU": cfg.ray.num_workers * w["CPU"] + CONTROLLER_CPUS, "GPU": cfg.ray.num_workers * w.get("GPU", 0.0)}


def embedded_cpus(cfg: JobConfig, concurrent_runs: int = 1) -> int:
    """Logical CPUs an embedded Ray declares: the teachers (when they run live), `concurrent_runs`
    runs and one spare. Ray only counts logical CPUs, so this may exceed the machine's cores."""
    teachers = pool(cfg)["CPU"] if cfg.data.kv_source == "live" else 0
    return int(teachers + concurrent_runs * run(cfg, use_gpu=False)["CPU"] + 1 + 0.999)


def demands(cfg: JobConfig, workers: Optional[dict] = None) -> list[Demand]:
    """Each teacher's replicas, and the Ray Train workers of `workers` resources, as
    `kava_ray.common.placement` places them: one node each, among those its label selector
    admits."""
    out = [Demand(f"teacher '{t.name}'", replica(t), t.replicas, t.label_selector,
                  f"teachers[{t.name}].label_selector") for t in cfg.teachers]
    if workers is not None:
        out.append(Demand("a Ray Train worker", workers, cfg.ray.num_workers, cfg.ray.worker_label_selector,
                          "ray.worker_label_selector"))
    return out
