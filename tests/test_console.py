"""A quiet console: `kava-ray train` prints status lines, the progress bar and its table; the chatter of Ray,
its workers and the libraries goes to RUN_DIR/logs/ (kava_ray.console); `--verbose` shows it live."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import write_job

KAVA_RAY = str(Path(sys.executable).with_name("kava-ray"))
CHATTER = ("Loading weights", "WARNING", "Warning", "Failed to load", "Traceback", "Deprecat", "_pytree",
           "PreemptionWatcher", "Started a local Ray", "Requesting resources")


def _train(tmp_path, qwen, llama, student, *extra, teachers=None) -> tuple[subprocess.CompletedProcess, float]:
    sections = {"train": {"steps": 2, "eval_steps": 2, "save_steps": 2}, "data": {"num_train": 16}}
    if teachers is not None:
        sections["teachers"] = teachers
    job = write_job(tmp_path, qwen, llama, student, **sections)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.run([KAVA_RAY, "train", "--config", str(job), "--name", "quiet", *extra],
                          capture_output=True, text=True, env=env, timeout=300)
    return proc, time.time() - t0


@pytest.mark.ray
def test_train_console_is_short_and_the_chatter_is_in_the_run_logs(tmp_path, tiny_qwen2_dir, tiny_llama_dir,
                                                                   tiny_student_dir):
    proc, wall = _train(tmp_path, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console
    run_dir = tmp_path / "runs" / "quiet"
    err = proc.stderr.splitlines()
    # status lines, in order, and nothing else on stderr (no tty: no progress bar)
    assert [line.split(":")[0] for line in err] == ["data", "connecting", "teachers", "training", "test", "logs"], err
    assert err[0].startswith("data: ") and " training, " in err[0] and "(synthetic)" in err[0]
    assert "embedded Ray (" in err[1] and "127.0.0.1" in err[1]
    assert err[2].startswith("teachers: 2 ready (qwen, llama) in ")
    assert err[3] == f"training: 2 steps, 1 worker -> {run_dir}"
    assert err[4].startswith("test: CE ") and "centred cos" in err[4]
    assert err[5] == f"logs: {run_dir / 'logs'}"
    assert proc.stdout.splitlines()[-1].startswith(f"run dir: {run_dir}")  # the command's own output: the table
    for word in CHATTER:
        assert word not in console, (word, console)
    assert len(console.splitlines()) < 40, console

    logs = run_dir / "logs"
    assert (logs / "driver.log").is_file()
    text = {p.relative_to(logs).as_posix(): p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file()}
    assert any("Loading weights" in t for t in text.values()), sorted(text)  # the teachers' / worker's bars
    assert any(name.startswith("ray/TeacherActor-") for name in text), sorted(text)
    assert any(name.startswith("ray/train/") for name in text), sorted(text)  # Ray Train's own logs
    print(f"quiet train: {wall:.0f} s, {len(console.splitlines())} console lines, logs: {sorted(text)}")


def test_quiet_sends_fd_level_output_to_the_log_and_status_to_the_terminal(tmp_path, capfd):
    from kava_ray.console import quiet, status, with_logs

    with quiet(tmp_path / "logs", verbose=False, ray_logs=False):
        os.write(2, b"C-level chatter\n")
        os.write(1, b"a library's print\n")
        print("python stderr chatter", file=sys.stderr)
        status("training: 2 steps")
        line = with_logs("training failed: boom")
    out = capfd.readouterr()
    assert out.err == "training: 2 steps\n" and out.out == ""
    assert line == f"training failed: boom (logs: {tmp_path / 'logs'})"
    log = (tmp_path / "logs" / "driver.log").read_text()
    for text in ("C-level chatter", "a library's print", "python stderr chatter"):
        assert text in log
    assert with_logs("x") == "x"  # outside quiet: unchanged


def test_verbose_leaves_the_console_alone(tmp_path, capfd):
    import kava_ray.connect
    from kava_ray.console import quiet, status

    with quiet(tmp_path / "logs", verbose=True, ray_logs=False):
        assert kava_ray.connect.LOG_TO_DRIVER is True  # --verbose: workers' lines stream to the console, as before
        os.write(2, b"C-level chatter\n")
        status("connecting: embedded Ray")
    with quiet(tmp_path / "quiet-logs", verbose=False, ray_logs=False):
        assert kava_ray.connect.LOG_TO_DRIVER is False  # quiet: they stay in Ray's logs (copied to RUN_DIR/logs)
    err = capfd.readouterr().err
    assert "C-level chatter" in err and "connecting: embedded Ray" in err
    assert not (tmp_path / "logs" / "driver.log").exists()


def test_a_failed_run_is_one_line_with_the_logs_dir(tmp_path):
    from ray.train import TrainingFailedError

    from kava_ray.console import quiet
    from kava_ray.errors import KavaError
    from kava_ray.train import fit

    class Failing:
        def fit(self):
            raise TrainingFailedError("Traceback (most recent call last):\n  ...\n"
                                                "kava_ray.errors.KavaError: teacher 'qwen' returned NaN keys")

    with quiet(tmp_path / "logs", verbose=False, ray_logs=False), pytest.raises(KavaError) as e:
        fit(Failing())
    assert str(e.value) == f"training failed: teacher 'qwen' returned NaN keys (logs: {tmp_path / 'logs'})"
