"""A quiet console: status lines and one progress bar on the terminal, every other line in the run's logs.

`status(line)` is kava-ray's one writer of status lines. `with quiet(run_dir / "logs", verbose):`
sends the driver's fds 1 and 2 to `logs/driver.log` and copies Ray's worker logs into `logs/ray/` on
the way out; `verbose` leaves everything live. How the redirect works:
docs/internals/runtime.md#console.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

import ray

from kava_ray.common.errors import KavaError
from kava_ray.common.quiet_start import console as early_console
from kava_ray.common.quiet_start import fd_console as early_fd_console
from kava_ray.common.quiet_start import take as take_early
from kava_ray.runtime.ray_private import session_logs_dir

_state: dict = {"console": None, "log_dir": None, "ray_started": False, "made": []}
# ray.init(log_to_driver=...) in `connect`: `quiet` turns it off (workers' lines stay in Ray's logs)
LOG_TO_DRIVER = True


def ray_started() -> None:
    """`connect` says Ray is up: a later refusal keeps the logs (its line points at them)."""
    _state["ray_started"] = True


def console() -> TextIO:
    """The terminal's stderr: the saved one while `quiet` (or the CLI's `quiet_start`) redirects,
    else `sys.stderr`."""
    return _state["console"] or early_console() or sys.stderr


def log_dir() -> Optional[Path]:
    """The logs dir of the active `quiet` (also set when verbose), else None."""
    return _state["log_dir"]


def status(line: str) -> None:
    """One short line for the user, on the terminal (stderr), whatever is redirected."""
    out = console()
    print(line, file=out, flush=True)


def with_logs(message: str) -> str:
    """An error line with the logs dir appended: `... (logs: RUN_DIR/logs)`; unchanged outside
    `quiet`, and where the refusal will remove that dir (`_kept_on_refusal`): a line never names a
    directory that is gone."""
    d = log_dir()
    return f"{message} (logs: {d})" if d is not None and _kept_on_refusal() else message


def _kept_on_refusal() -> bool:
    """Whether the active `quiet`'s logs stay when a KavaError ends it: once Ray has started (its
    logs are what the line points at), or when the dir was there before (a resumed run's)."""
    return _state["ray_started"] or not _state["made"]


@contextlib.contextmanager
def quiet(log_dir: Path, verbose: bool = False, ray_logs: bool = True, made_above: Optional[Path] = None):
    """Send the driver's and Ray workers' chatter to `log_dir` (see the module doc); `verbose`:
    leave it live. made_above: a parent of `log_dir` this command made just before (a run dir with
    its lock): a refusal removes it as it removes what this call makes."""
    global LOG_TO_DRIVER
    if _state["log_dir"] is not None:  # nested: the outer one owns the console
        yield
        return
    log_dir = Path(log_dir)
    made = [p for p in (log_dir, *log_dir.parents) if not p.exists()]  # what this call creates (removed on refusal)
    if made_above is not None and Path(made_above) not in made:
        made.append(Path(made_above))
    log_dir.mkdir(parents=True, exist_ok=True)
    take_early(log_dir / "driver.log")  # what the command's imports wrote before this (`common.quiet_start`)
    t0 = time.time()
    _state["ray_started"] = False
    _state["made"] = made
    _state["log_dir"] = log_dir
    _state["ray_logs"] = (log_dir / "ray", t0) if ray_logs else None
    prev_log_to_driver, LOG_TO_DRIVER = LOG_TO_DRIVER, bool(verbose)
    try:
        if verbose:
            yield
        else:
            with _redirect(log_dir / "driver.log"):
                yield
    except KavaError:
        # refused before Ray started (preflight, the data): the command's one line says it all and
        # nothing it created stays (with Ray up, the logs are what `(logs: DIR)` points at)
        if not _kept_on_refusal():
            shutil.rmtree(made[-1], ignore_errors=True)
            _state["ray_logs"] = None
        raise
    finally:
        LOG_TO_DRIVER = prev_log_to_driver
        pending = _state["ray_logs"]  # None once collect_before_shutdown has copied them
        if pending:
            try:
                collect_ray_logs(*pending)
            except Exception as e:  # never hide the run's own outcome behind a log copy
                print(f"could not copy Ray's logs: {e}", file=sys.stderr)
        _state["log_dir"] = _state["ray_logs"] = None
        _state["made"] = []


def silenced():
    """fds 1 and 2 (and Python's streams) to /dev/null for the block: library chatter a command
    meets before its `quiet` starts (the preflight's planner; torch and torchao write past Python's
    streams)."""
    return _redirect(Path(os.devnull))


@contextlib.contextmanager
def _redirect(path: Path):
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            s.flush()
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    term = os.fdopen(os.dup(saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
    prev_streams, prev_console = (sys.stdout, sys.stderr), _state["console"]  # (nested: inside a `quiet`)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    _state["console"] = prev_console or early_fd_console() or term
    try:
        yield
    finally:
        for s in (log, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                s.flush()
        sys.stdout, sys.stderr = prev_streams
        for fd, dup in saved.items():
            os.dup2(dup, fd)
            os.close(dup)
        _state["console"] = prev_console
        term.close()
        log.close()


def _actor_name(path: Path) -> str:
    """`TeacherActor` from a worker log's `:actor_name:` header line, else `task`."""
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        for _ in range(3):
            line = f.readline()
            if line.startswith(":actor_name:"):
                return line.split(":", 2)[2].strip() or "task"
    return "task"


def _has_content(path: Path) -> bool:
    """More than Ray's `:job_id:` / `:actor_name:` header lines."""
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return any(line.strip() and not line.startswith(":") for line in f)
    return False


def collect_before_shutdown() -> None:
    """Copy Ray's logs into the active quiet console's run logs now: a command that started its own
    Ray shuts it down before the console's exit (`job.job_teachers`), and the copy needs a running
    Ray to find them."""
    pending = _state.get("ray_logs")
    if pending:
        _state["ray_logs"] = None  # copied once: the console's exit has nothing left to do
        with contextlib.suppress(Exception):  # never hide the run's own outcome behind a log copy
            collect_ray_logs(*pending)


def collect_ray_logs(dest: Path, since: float = 0.0) -> list[Path]:
    """Copy this driver's job's worker/actor logs (non-empty, written since `since`) and Ray Train's
    logs from the local Ray session dir into `dest` as `<ActorClass>-<pid>.out|err`; returns the
    copies. Nothing when Ray is not initialised (or the session dir is not on this machine: a remote
    cluster's nodes keep theirs)."""
    if not ray.is_initialized():
        return []
    try:
        logs = session_logs_dir()
        job = ray.get_runtime_context().get_job_id()
    except Exception:
        return []
    if logs is None or not logs.is_dir():
        return []
    copied = []
    for src in sorted(logs.glob(f"worker-*-{job}-*.*")):
        if src.suffix not in (".out", ".err") or src.stat().st_mtime < since or not _has_content(src):
            continue
        pid = src.stem.rsplit("-", 1)[-1]
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / f"{_actor_name(src)}-{pid}{src.suffix}"
        shutil.copyfile(src, target)
        copied.append(target)
    for src in sorted((logs / "train").glob("*.log")) if (logs / "train").is_dir() else []:
        if src.stat().st_mtime >= since:
            (dest / "train").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / "train" / src.name)
            copied.append(dest / "train" / src.name)
    return copied
