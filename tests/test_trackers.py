"""Experiment tracking (train.loggers): TensorBoard / MLflow / W&B read back, restarts, missing packages,
Tune's callbacks, and a real Ray Train run whose trackers hold exactly its metrics.jsonl."""

import json
import sys
from pathlib import Path

import pytest

from jobs import job_dict
from kava_ray.common.config import validate_config
from kava_ray.common.errors import KavaError
from kava_ray.common.trackers import STATE, metric_values, mlflow_key, open_trackers

CFG = {"name": "tiny", "optim": {"lr_student": 1e-3}, "teachers": [{"name": "qwen", "layers": [0, 1]}]}
RECORDS = [{"step": 0, "kind": "eval", "eval/ce": 2.5},
           {"step": 1, "kind": "train", "loss": 1.5, "cos_sim": 0.1, "cos_sim/qwen": 0.3, "phase": "aligning"},
           {"step": 2, "kind": "train", "loss": 1.25, "cos_sim": 0.2, "cos_sim/qwen": 0.4, "phase": "aligning"},
           {"step": 2, "kind": "eval", "eval/ce": 2.0},
           {"step": 2, "kind": "test", "test/ce": 2.125}]


@pytest.fixture(autouse=True)
def local_trackers(monkeypatch):
    """The defaults under test: no tracking server, W&B offline because unset."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for reading back here (open_trackers sets it itself)


def tb_scalars(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{run_dir / 'mlruns'}")
    run_id = json.loads((run_dir / STATE).read_text())["mlflow"]["run_id"]
    return client, client.get_run(run_id)


def history(client, run, key) -> list:
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


def test_record_keys():
    assert metric_values(RECORDS[1]) == {"train/loss": 1.5, "train/cos_sim": 0.1, "train/cos_sim/qwen": 0.3}  # no str
    assert metric_values(RECORDS[3]) == {"eval/ce": 2.0}  # already prefixed
    assert metric_values({"step": 1, "kind": "train", "cos/qwen": 0.5}) == {"train/cos/qwen": 0.5}
    assert mlflow_key("train/cos_raw/qwen") == "train/cos_raw.qwen" and mlflow_key("eval/ce") == "eval/ce"


def test_tensorboard_and_mlflow_hold_the_records(tmp_path):
    final = tmp_path / "final" / "student"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    t = open_trackers(["tensorboard", "mlflow"], tmp_path, CFG)
    for r in RECORDS:
        t.log(r)
    t.log_artifact(tmp_path / "final")
    t.close()

    tb = tb_scalars(tmp_path)
    assert tb["train/loss"] == [(1, 1.5), (2, 1.25)]
    assert tb["eval/ce"] == [(0, 2.5), (2, 2.0)] and tb["test/ce"] == [(2, 2.125)]
    client, run = mlflow_run(tmp_path)
    assert history(client, run, "train/loss") == [(1, 1.5), (2, 1.25)]
    assert history(client, run, "eval/ce") == [(0, 2.5), (2, 2.0)]
    assert history(client, run, "train/cos_sim") == [(1, 0.1), (2, 0.2)]
    assert history(client, run, "train/cos_sim.qwen") == [(1, 0.3), (2, 0.4)]
    assert [s for s, _ in tb["train/cos_sim/qwen"]] == [1, 2]
    assert [v for _, v in tb["train/cos_sim/qwen"]] == pytest.approx([0.3, 0.4])  # float32
    assert run.data.params["optim.lr_student"] == "0.001" and run.data.params["teachers.0.layers"] == "[0, 1]"
    assert run.data.params["name"] == "tiny" and run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run.info.run_id, "final/student")] == ["final/student/config.json"]


def test_a_restart_resumes_the_same_runs(tmp_path):
    """Restarted from step 1 (the same run dir): TensorBoard shows the re-run steps once, with their new values;
    MLflow continues the same run."""
    t = open_trackers(["tensorboard", "mlflow"], tmp_path, CFG)
    for r in RECORDS[:3]:
        t.log(r)
    t.close()
    first = json.loads((tmp_path / STATE).read_text())["mlflow"]["run_id"]
    t = open_trackers(["tensorboard", "mlflow"], tmp_path, CFG, resume_step=1)
    t.log({"step": 2, "kind": "train", "loss": 1.0})
    t.log({"step": 3, "kind": "train", "loss": 0.5})
    t.close()
    assert tb_scalars(tmp_path)["train/loss"] == [(1, 1.5), (2, 1.0), (3, 0.5)]
    client, run = mlflow_run(tmp_path)
    assert run.info.run_id == first
    assert history(client, run, "train/loss")[-2:] == [(2, 1.0), (3, 0.5)]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_wandb_offline_writes_its_run_dir(tmp_path):
    pytest.importorskip("wandb")
    final = tmp_path / "final"
    final.mkdir()
    (final / "weights.bin").write_bytes(b"x")
    t = open_trackers(["wandb"], tmp_path, CFG)
    for r in RECORDS:
        t.log(r)
    t.log_artifact(final)
    t.close()
    run_id = json.loads((tmp_path / STATE).read_text())["wandb"]["id"]
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert runs and (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0


def _job(**train) -> dict:
    d = job_dict("q", "l", "s", "/tmp/kava-unused")
    d["train"].update(train)
    return d


def test_loggers_validated_in_one_line(monkeypatch):
    assert validate_config(_job()).train.loggers == []
    assert validate_config(_job(loggers=["mlflow", "tensorboard"])).train.loggers == ["mlflow", "tensorboard"]
    with pytest.raises(KavaError, match=r"config key 'train.loggers': 'mlflow' is listed twice"):
        validate_config(_job(loggers=["mlflow", "mlflow"]))
    with pytest.raises(KavaError, match=r"config key 'train.loggers.0': Input should be 'tensorboard'"):
        validate_config(_job(loggers=["comet"]))


@pytest.mark.parametrize("name,pip", [("mlflow", "mlflow-skinny"), ("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_missing_package_is_one_line_at_config_time(monkeypatch, name, pip):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` fails, find_spec says missing
    with pytest.raises(KavaError) as e:
        validate_config(_job(loggers=[name]))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"config key 'train.loggers': {name} is not installed: pip install {pip}")
    with pytest.raises(KavaError, match=f"train.loggers: {name} is not installed"):
        open_trackers([name], "/tmp/kava-unused-run", CFG)


def test_tune_gets_the_trackers_callbacks(tmp_path, monkeypatch):
    from ray.air.integrations.mlflow import MLflowLoggerCallback
    from ray.tune.logger import TBXLoggerCallback

    from kava_ray.recipes.tune import tracker_callbacks

    cfg = validate_config(_job(loggers=["tensorboard", "mlflow"]))
    cbs = tracker_callbacks(cfg, tmp_path / "sweep")
    assert [type(c) for c in cbs] == [TBXLoggerCallback, MLflowLoggerCallback]
    assert cbs[1].tracking_uri == f"file:{tmp_path / 'sweep' / 'mlruns'}" and cbs[1].experiment_name == "sweep"
    assert tracker_callbacks(validate_config(_job()), tmp_path) == []
    # setup() exports its URI (mlflow.set_tracking_uri): undone after
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset")
    cbs[1].setup()  # what Tune calls first: the sweep's experiment in the file store
    from mlflow.tracking import MlflowClient

    assert MlflowClient(tracking_uri=cbs[1].tracking_uri).get_experiment_by_name("sweep") is not None


# A real run's trackers (TensorBoard + MLflow hold exactly metrics.jsonl) are checked on test_train's 2-worker run:
# tests/test_train.py::test_the_run_is_tracked_exactly (one Ray Train run fewer).


def test_write_json_is_atomic_and_writes_numbers_paths_and_arrays(tmp_path):
    import json

    import numpy as np
    import torch

    from kava_ray.common.files import write_json

    path = write_json(tmp_path / "out" / "x.json", {"f": np.float32(0.5), "t": torch.tensor(2.0), "p": tmp_path,
                                                   "a": np.arange(3), "i": 7})
    assert json.loads(path.read_text()) == {"f": 0.5, "t": 2.0, "p": str(tmp_path), "a": [0, 1, 2], "i": 7}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary file left beside it
