"""One writer per run dir: an exclusive `fcntl.flock` on `RUN_DIR/.kava-lock`, whose text names the holder.

`train`, `--resume` and `tune` take it before Ray starts and hold it to the end; a second writer
gets one line naming the holder (command, pid, host, since when). The kernel drops a flock when its
process dies, however it dies, so a lock file left by a killed writer is free: the next writer takes
it over and says whose it was. `eval` reads `holder(RUN_DIR)` to know a run is live. A lock on a
network filesystem without flock support is refused by the OS, never silently shared.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from kava_ray.common.errors import KavaError

LOCK = ".kava-lock"


def _describe(info: dict) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(info.get("since", 0)))
    return f"`{info.get('command', '?')}` (pid {info.get('pid', '?')} on {info.get('host', '?')}, since {since})"


def _read(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(path.read_text())
        if isinstance(info, dict):
            return info
    return {}


def holder(run_dir) -> Optional[dict]:
    """{command, pid, host, since} of the process that holds `run_dir`'s lock now, else None (no
    lock file, or its writer is gone)."""
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(path) or {"command": "?"}
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def describe_holder(info: dict) -> str:
    """`train` (pid 123 on host, since 12:00:00): the one-line name of a lock's holder."""
    return _describe(info)


@contextlib.contextmanager
def run_lock(run_dir, command: str, say: Optional[Callable[[str], None]] = None) -> Iterator[bool]:
    """Hold `run_dir`'s lock for the block, which gets whether this call made the dir (then it is
    removed again on the way out if an error leaves nothing else in it: a refusal before the run
    wrote anything); a live holder is one KavaError line; a stale lock file (its writer died) is
    taken over with a line through `say`."""
    run_dir = Path(run_dir)
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    fd = _acquire(path, run_dir)
    try:
        stale = _read(path)
        if stale:
            (say or _stderr)(f"{run_dir.name}: taking over the lock of {_describe(stale)}, which is no longer running")
        info = {"command": command, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        ok = False
        try:
            yield made
            ok = True
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # an empty lock file: released cleanly (a stale one still names its writer)
            if made and not ok and run_dir.is_dir() and not [p for p in run_dir.iterdir() if p.name != LOCK]:
                shutil.rmtree(run_dir, ignore_errors=True)  # a refusal leaves nothing where nothing was
    finally:
        os.close(fd)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _acquire(path: Path, run_dir: Path) -> int:
    """An fd holding the exclusive flock of `path`; one KavaError line naming the holder if another has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        info = _read(path)
        raise KavaError(f"{run_dir} is in use by {_describe(info) if info else 'another process'}: one writer per "
                        f"run dir (wait for it to end, or stop it)") from None
    except OSError as e:
        os.close(fd)
        raise KavaError(f"{run_dir}: cannot lock {LOCK} ({e.strerror}); a filesystem without flock cannot "
                        f"hold a run") from None
    return fd
