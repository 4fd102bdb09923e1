"""A quiet console: `kava-ray train` prints status lines, the progress bar and its table; the chatter of Ray,
its workers and the libraries goes to RUN_DIR/logs/ (kava_ray.runtime.console); `--verbose` shows it live.

The console of a whole `kava-ray train` (a subprocess with its own embedded Ray) is checked on the run
tests/test_service_ray.py makes anyway (`test_train_without_address_runs_its_own_ray_...`); these are the
pieces, in process."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

CHATTER = ("Loading weights", "WARNING", "Warning", "Failed to load", "Traceback", "Deprecat", "_pytree",
           "PreemptionWatcher", "Started a local Ray", "Requesting resources")


def test_quiet_sends_fd_level_output_to_the_log_and_status_to_the_terminal(tmp_path, capfd):
    from kava_ray.runtime.console import quiet, ray_started, status, with_logs

    with quiet(tmp_path / "logs", verbose=False, ray_logs=False):
        os.write(2, b"C-level chatter\n")
        os.write(1, b"a library's print\n")
        print("python stderr chatter", file=sys.stderr)
        status("training: 2 steps")
        early = with_logs("refused: boom")  # before Ray: a refusal removes the logs dir, so the line names none
        ray_started()  # (what `connect` says once Ray is up)
        line = with_logs("training failed: boom")
    out = capfd.readouterr()
    assert out.err == "training: 2 steps\n" and out.out == ""
    assert early == "refused: boom"
    assert line == f"training failed: boom (logs: {tmp_path / 'logs'})"
    log = (tmp_path / "logs" / "driver.log").read_text()
    for text in ("C-level chatter", "a library's print", "python stderr chatter"):
        assert text in log
    assert with_logs("x") == "x"  # outside quiet: unchanged


def test_a_quiet_start_moves_import_chatter_into_the_runs_log(tmp_path, capfd):
    """What a command's imports write before its run's logs exist (`common.quiet_start`, around every command
    without --verbose) goes into that run's driver.log, not the terminal; status lines still reach the terminal; a
    command that fails unexpectedly shows what was caught (it may explain the failure); a refusal does not."""
    from kava_ray.common.errors import KavaError
    from kava_ray.common.quiet_start import quiet_start
    from kava_ray.runtime.console import quiet, status

    with quiet_start():
        os.write(2, b"Failed to load _C_mxfp8.so\n")  # (torchao's, at import: below Python's streams)
        print("Loading weights: 100%|##########| 30/30", file=sys.stderr)
        status("data: 64 training rows")
        with quiet(tmp_path / "logs", verbose=False, ray_logs=False):
            os.write(2, b"in the run\n")
            status("training: 2 steps")
    assert capfd.readouterr().err == "data: 64 training rows\ntraining: 2 steps\n"
    log = (tmp_path / "logs" / "driver.log").read_text()
    assert log.index("Failed to load _C_mxfp8.so") < log.index("Loading weights") < log.index("in the run")
    with pytest.raises(KavaError), quiet_start():
        os.write(2, b"chatter before a refusal\n")
        raise KavaError("bad input")
    assert capfd.readouterr().err == ""  # the refusal's one line is the CLI's to print
    with pytest.raises(RuntimeError), quiet_start():
        os.write(2, b"why it crashed\n")
        raise RuntimeError("boom")
    assert capfd.readouterr().err == "why it crashed\n"
    with quiet_start(verbose=True):
        os.write(2, b"live\n")
    assert capfd.readouterr().err == "live\n"


def test_verbose_leaves_the_console_alone(tmp_path, capfd):
    import kava_ray.runtime.console
    from kava_ray.runtime.console import quiet, status

    with quiet(tmp_path / "logs", verbose=True, ray_logs=False):
        # --verbose: workers' lines stream to the console, as before
        assert kava_ray.runtime.console.LOG_TO_DRIVER is True
        os.write(2, b"C-level chatter\n")
        status("connecting: embedded Ray")
    with quiet(tmp_path / "quiet-logs", verbose=False, ray_logs=False):
        # quiet: they stay in Ray's logs (copied to RUN_DIR/logs)
        assert kava_ray.runtime.console.LOG_TO_DRIVER is False
    err = capfd.readouterr().err
    assert "C-level chatter" in err and "connecting: embedded Ray" in err
    assert not (tmp_path / "logs" / "driver.log").exists()


def test_a_failed_run_is_one_line_with_the_logs_dir(tmp_path):
    from ray.train import TrainingFailedError

    from kava_ray.common.errors import KavaError
    from kava_ray.recipes.train import fit
    from kava_ray.runtime.console import quiet, ray_started

    class Failing:
        run_config = SimpleNamespace(name="run")

        def fit(self):
            raise TrainingFailedError("Traceback (most recent call last):\n  ...\n"
                                                "kava_ray.common.errors.KavaError: teacher 'qwen' returned NaN keys")

    with quiet(tmp_path / "logs", verbose=False, ray_logs=False), pytest.raises(KavaError) as e:
        ray_started()  # (a run fails in Ray Train once `connect` has started Ray)
        fit(Failing())
    assert str(e.value) == f"training failed: teacher 'qwen' returned NaN keys (logs: {tmp_path / 'logs'})"
