"""Ray Tune over tiny models: an interrupted ASHA sweep resumes, ASHA stops the bad trial, best.yaml trains; a bad
space is refused before anything starts."""

import csv
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from jobs import run_recipe, write_job
from kava_ray.common.config import load_config


@pytest.fixture(scope="module")
def tune_job(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir):
    """The job, with `ray.storage_path: runs` relative: to the CWD of the command (the tests chdir to `root`)."""
    root = tmp_path_factory.mktemp("tune")
    job = write_job(root, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                    train={"steps": 8, "eval_steps": 2, "save_steps": 8, "batch_size": 4, "max_length": 160},
                    data={"num_train": 48, "num_test": 8, "num_val": 8}, ray={"storage_path": "runs"})
    return root, job


def trial_statuses(exp: Path) -> dict:
    """{trial_id: status} through Tune's public ExperimentAnalysis ({} before Tune saved any state)."""
    from ray.tune import ExperimentAnalysis

    try:
        return {t.trial_id: t.status for t in ExperimentAnalysis(str(exp)).trials}
    except Exception:  # noqa: BLE001 - no state yet, or the state file is being rewritten
        return {}


def write_space(root: Path, name: str, space: dict) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(space))
    return path


def test_interrupted_asha_sweep_resumes_stops_the_bad_trial_and_its_best_config_trains(tiny_pool, tune_job, capsys,
                                                                                        monkeypatch):
    """One sweep, three trials, one at a time: the first finishes, Ctrl+C stops the sweep (a SIGINT to this
    process, inside Tune's fit): `kava-ray tune` says how to continue in one line, exit 130; `--resume` runs the
    other two without running the first again; ASHA stops the bad learning rate at its first rung (the resumed
    run's scheduler starts empty, so the good trial before it fills the rung); best.yaml is a job that trains. The
    job's relative `ray.storage_path` is the command's CWD's: every trial writes there, nothing lands where Tune
    runs its trials (Ray's session dir)."""
    import ray

    from kava_ray.cli import main
    from kava_ray.core.models import load_model
    from kava_ray.recipes.tune import run_tune
    from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans

    root, job = tune_job
    monkeypatch.chdir(root)  # `ray.storage_path: runs` -> root/runs
    space = write_space(root, "asha", {
        "metric": "eval/cos_sim", "mode": "max", "num_samples": 1,  # a grid runs each point num_samples times
        "scheduler": {"kind": "asha", "grace_period": 1, "reduction_factor": 2},  # at the 1st evaluation past 0
        "params": {"optim.lr_projector": {"grid": [1.0e-2, 5.0e-3, 1.0e-8]}}})
    exp = root / "runs" / "asha"
    done = []

    def ctrl_c():  # Ctrl+C once the first trial has finished: Tune saves the experiment state and stops
        deadline = time.time() + 600  # generous: a loaded CI box; ~25 s alone
        while time.time() < deadline and not done:
            if list(exp.glob("trial_*/run/final/state.json")):  # a trial's last write; then ask Tune (its state)
                done.extend(t for t, status in trial_statuses(exp).items() if status == "TERMINATED")
            time.sleep(0.2)
        if done:
            os.kill(os.getpid(), signal.SIGINT)  # to the main thread, inside Tune's fit (its SIGINT handler)

    said = []  # the sweep's status lines (the console writes them to the terminal, past capsys)
    monkeypatch.setattr("kava_ray.recipes.tune.status", lambda line, *a, **k: said.append(line.split(";")[0]))
    thread = threading.Thread(target=ctrl_c, daemon=True)
    thread.start()
    code = main(["tune", "--config", str(job), "--space", str(space), "--name", "asha", "--max-concurrent", "1"])
    thread.join()
    assert len(done) == 1, "the first trial did not finish in time"
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and err[-1] == f"error: interrupted; the sweep's state is saved in {exp}: --resume {exp} " \
                                      f"continues it", err[-5:]
    # a status line when the first trial ended, counting the sweep's three trials (Tune lists them as it creates them)
    assert said[0] == f"tune: 3 trials, up to 1 at a time -> {exp}", said  # before the first result
    assert "tune: 1/3 trials done (0 stopped early, 0 failed), 0 running" in said, said
    statuses = trial_statuses(exp)
    assert list(statuses.values()).count("TERMINATED") == 1 and len(statuses) >= 2, statuses  # the next one stopped
    first_trial = exp / f"trial_{done[0]}"
    files = [first_trial / "run" / "metrics.jsonl", first_trial / "result.json"]  # ours, and Tune's results log
    before = [f.read_text() for f in files]

    said.clear()
    out = run_tune(load_config(job), str(space), resume=str(exp))
    rows = out["rows"]
    # the resumed sweep's lines: its own header, and the first trial (finished before the interrupt, 8 steps) is
    # done, not "stopped early" (the status callback's state is saved with the sweep's and restored)
    assert said[0] == f"tune: continuing the sweep in {exp}" and said[-1] == \
        "tune: 3/3 trials done (1 stopped early, 0 failed), 0 running", said
    assert len(rows) == 3 and not any(r["error"] for r in rows), rows
    # the finished trial was not run again: neither its metrics nor Tune's result log grew
    assert [f.read_text() for f in files] == before
    assert json.loads((first_trial / "run" / "final" / "state.json").read_text())["step"] == 8
    by_lr = {r["optim.lr_projector"]: r for r in rows}
    # stopped at a rung, and not before its first evaluation after training began (step 2, eval_steps 2): never on
    # the step-0 evaluation, where every trial scores the same
    assert by_lr[1e-8]["stopped_early"] and 2 <= by_lr[1e-8]["steps"] < 8, rows
    bad_trial = exp / by_lr[1e-8]["trial"]
    reports = [json.loads(line) for line in (bad_trial / "result.json").read_text().splitlines()]
    assert reports[-1]["evals"] >= 1 and all(r["evals"] == (r["step"] >= 2) + (r["step"] >= 4) + (r["step"] >= 6)
                                             for r in reports), reports
    assert by_lr[1e-2]["steps"] == by_lr[5e-3]["steps"] == 8 and not by_lr[5e-3]["stopped_early"], rows
    assert out["best"]["optim.lr_projector"] in (1e-2, 5e-3)
    with open(exp / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 3
    assert (exp / "trials.png").read_bytes()[:4] == b"\x89PNG"
    for row in rows:  # every trial's run under the sweep; the finished ones' students too
        assert (exp / row["trial"] / "run" / "metrics.jsonl").is_file(), row
        assert row["stopped_early"] or (exp / row["trial"] / "run" / "final" / "student" / "config.json").is_file()
    session = Path(ray._private.worker._global_node.get_session_dir_path())  # the trials' working dirs are in it
    stray = [p for p in session.rglob("*") if p.name in ("metrics.jsonl", "best.yaml")]
    assert not stray, stray
    # the resumed run's two trials shared the teachers' batches: each computed once (counted from the sweep's
    # start: the session's pool served other runs before)
    for name, st in out["teacher_stats"].items():
        assert st["hits"] > 0 and st["forwards"] < st["requests"], (name, st)

    # best.yaml is a complete job: it loads as one and trains (2 steps of the worker's recipe, in process)
    best = load_config(out["best_config"], ["train.steps=2"])
    assert best.optim.lr_projector == out["best"]["optim.lr_projector"]
    models = {t.name: load_model(t.model, dtype=t.dtype, quantization=t.quantization) for t in best.teachers}
    curve, _, _ = run_recipe(best, in_process_plans(best, models), InProcessSource(models), 2)
    assert sorted(curve) == [1, 2] and all(math.isfinite(v["loss"]) for v in curve.values())


def test_bad_space_fails_before_any_trial(tune_job, capsys, monkeypatch):
    """Each mistake: one `error:` line, exit 2, and neither Ray nor a trial started."""
    import ray

    from kava_ray.cli import main

    root, job = tune_job
    monkeypatch.chdir(root)
    was_up = ray.is_initialized()
    for space, expect in (({"params": {"optim.lr_studnet": {"choice": [1e-4]}}}, "optim.lr_studnet"),
                          ({"params": {"loss.beta": {"normal": [0, 1]}}}, "unknown distribution 'normal'"),
                          ({"params": {"optim.lr_student": {"uniform": [1e-4, 1e-5]}}}, "empty range")):
        path = write_space(root, "bad", space)
        assert main(["tune", "--config", str(job), "--space", str(path)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], lines
    assert ray.is_initialized() == was_up  # the space was rejected before connecting to Ray
    assert not (root / "runs").exists() or not list((root / "runs").glob("*tune*"))  # nothing started
