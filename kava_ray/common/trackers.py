"""Experiment tracking (`train.loggers`): rank 0 mirrors every metrics.jsonl record to TensorBoard, MLflow, W&B.

`open_trackers(names, run_dir, cfg_dict)` -> `Trackers` (`.log(record)`, `.log_artifact(path)`,
`.close()`); local and offline by default, each package imported only when opened; a tracker that
fails mid-run is switched off with one warning. Per tracker: docs/internals/runtime.md#trackers.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

from kava_ray.common.errors import KavaError
from kava_ray.common.files import write_json

log = logging.getLogger(__name__)

# name in train.loggers -> (module it needs, what to pip install)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow-skinny"),
            "wandb": ("wandb", "wandb")}
STATE = "tracking.json"  # run ids to resume into, in the run dir


def check_loggers(names: Iterable[str]) -> None:
    """ValueError (one line) for a duplicate name or a tracker whose package is not installed."""
    names = list(names)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{dup[0]!r} is listed twice")
    for n in names:
        module, dist = PACKAGES[n]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"{n} is not installed: pip install {dist}  (or pip install 'kava-ray[track]')")


def flatten_params(d: Any, prefix: str = "") -> dict[str, str]:
    """{'optim': {'lr_student': 1e-4}} -> {'optim.lr_student': '0.0001'}; lists of sections are indexed."""
    if isinstance(d, dict):
        items = d.items()
    elif isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        items = enumerate(d)
    else:
        return {prefix[:-1]: str(d)}
    out: dict[str, str] = {}
    for k, v in items:
        out.update(flatten_params(v, f"{prefix}{k}."))
    return out


def mlflow_key(key: str) -> str:
    """`train/cos_raw/qwen` -> `train/cos_raw.qwen`: MLflow's file store keeps a metric as a file at its key's
    path, so `train/cos_raw` and `train/cos_raw/qwen` cannot both exist; only the kind stays a folder."""
    head, _, rest = key.partition("/")
    return f"{head}/{rest.replace('/', '.')}" if rest else head


def mlflow_uri(base: Path) -> str:
    """$MLFLOW_TRACKING_URI, else a file store under `base` (allowed explicitly: MLflow 3 refuses it otherwise)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"file:{Path(base).resolve() / 'mlruns'}"
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


def metric_values(record: dict) -> dict[str, float]:
    """The numbers of one metrics.jsonl record, keyed `<kind>/<key>` (`cos/qwen` -> `train/cos/qwen`) unless
    the key already has that prefix (`eval/ce`)."""
    kind = record.get("kind", "train")
    return {(k if k.startswith(f"{kind}/") else f"{kind}/{k}"): float(v) for k, v in record.items()
            if k not in ("step", "kind") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _TensorBoard:
    def __init__(self, run_dir: Path, params: dict, resume_step: int, state: dict, name: str):
        from torch.utils.tensorboard import SummaryWriter

        d = run_dir / "tensorboard"
        restart = d.is_dir() and any(d.glob("events.out.tfevents.*"))
        # a restart re-logs every step after the resumed one (step 0's evaluation too when that is 0)
        self.writer = SummaryWriter(str(d), purge_step=(resume_step + 1 if resume_step else 0) if restart else None)
        if not restart:
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(params.items())), 0)

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_artifact(self, path: Path, name: str) -> None:
        pass  # TensorBoard has no artifacts

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, run_dir: Path, params: dict, resume_step: int, state: dict, name: str):
        from mlflow.tracking import MlflowClient

        uri = mlflow_uri(run_dir)
        self.client = MlflowClient(tracking_uri=uri)
        old = state.get("mlflow", {})
        self.run_id = old.get("run_id") if old.get("uri") == uri else None
        if self.run_id:
            try:
                if self.client.get_run(self.run_id).info.lifecycle_stage != "active":
                    self.run_id = None
            except Exception:  # gone from the store
                self.run_id = None
        if self.run_id:  # resume: its params are already there (and MLflow refuses to change them)
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or name
            exp = self.client.get_experiment_by_name(exp_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(exp_name)
            self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
            self._params(params)
        state["mlflow"] = {"uri": uri, "run_id": self.run_id}

    def _params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, ts, step) for k, v in values.items()])

    def log_artifact(self, path: Path, name: str) -> None:
        self.client.log_artifacts(self.run_id, str(path), artifact_path=name)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _WandB:
    def __init__(self, run_dir: Path, params: dict, resume_step: int, state: dict, name: str):
        import wandb

        self.wandb = wandb
        run_id = state.get("wandb", {}).get("id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or name, name=run_dir.name, id=run_id,
                              resume="allow", dir=os.environ.get("WANDB_DIR") or str(run_dir),
                              mode=os.environ.get("WANDB_MODE") or "offline", config=params,
                              settings=wandb.Settings(silent=True, console="off"))
        state["wandb"] = {"id": run_id}

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def log_artifact(self, path: Path, name: str) -> None:
        art = self.wandb.Artifact(f"{self.run.id}-{name}", type="model")
        art.add_dir(str(path))
        self.run.log_artifact(art)

    def close(self) -> None:
        self.run.finish()


BACKENDS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}


class Trackers:
    """The open trackers of one run (possibly none: then every call does nothing)."""

    def __init__(self, backends: dict):
        self.backends = backends

    def _each(self, what: str, *args) -> None:
        for name, b in list(self.backends.items()):
            try:
                getattr(b, what)(*args)
            except Exception as e:  # a tracker never stops training: metrics.jsonl has every record
                log.warning("tracker %s failed (%s: %s); it is switched off for this run",
                            name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.backends.pop(name)

    def log(self, record: dict) -> None:
        values = metric_values(record)
        if values:
            self._each("log", values, int(record["step"]))

    def log_artifact(self, path, name: str = "final") -> None:
        self._each("log_artifact", Path(path), name)

    def close(self) -> None:
        self._each("close")
        self.backends = {}


def open_trackers(names: Iterable[str], run_dir, cfg_dict: dict, resume_step: int = 0,
                  name: Optional[str] = None) -> Trackers:
    """Open `names` (train.loggers) for the run in `run_dir`; cfg_dict: the job config (logged as params).

    resume_step: the step a restart in the same run dir continues from (0 for a fresh run).
    """
    names = list(names)
    if not names:
        return Trackers({})
    try:
        check_loggers(names)
    except ValueError as e:
        raise KavaError(f"train.loggers: {e}") from None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    state_path = run_dir / STATE
    try:
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
    except (OSError, json.JSONDecodeError):
        state = {}
    params = flatten_params(cfg_dict)
    name = name or str(cfg_dict.get("name") or "kava")
    opened = Trackers({})
    try:
        for n in names:
            opened.backends[n] = BACKENDS[n](run_dir, params, resume_step, state, name)
    except BaseException:
        opened.close()
        raise
    write_json(state_path, state)
    return opened
