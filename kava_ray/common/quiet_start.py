"""A quiet start: what libraries write to stderr while a command imports them, before its run's logs exist.

torchao's "Failed to load ..." lines, torch's `_pytree` deprecations, bitsandbytes' kernels notice
and Hugging Face's progress bars come at import and load time, before a command knows its run dir.
`quiet_start` (the CLI wraps every command in it, unless `--verbose`) sends fd 2 and `sys.stderr` to
a temp file; the first `runtime.console.quiet` of the command moves what was caught into its
`driver.log` (`take`), and status lines reach the terminal through `console()`. A command that ends
without a run dir drops the chatter, except when it fails unexpectedly: then everything caught is
shown, so nothing that explains a crash is hidden.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional, TextIO

from kava_ray.common.errors import KavaError, NothingToDo

_early: dict = {"path": None, "console": None, "fd_console": None}


def console() -> Optional[TextIO]:
    """The terminal's stderr while `quiet_start` holds fd 2 (the `sys.stderr` it found, or a dup of
    fd 2 where that was fd 2 itself), else None."""
    return _early["console"]


def fd_console() -> Optional[TextIO]:
    """The terminal's fd 2 as it was before `quiet_start` (a dup), while it holds fd 2, else None:
    what a nested redirect of fds 1 and 2 (`runtime.console.quiet`) keeps as its console."""
    return _early["fd_console"]


def terminal_stream() -> tuple[TextIO, bool]:
    """(a stream to the terminal's stderr that outlives a redirect of fd 2, whether the caller must
    close it): a dup of fd 2 where `sys.stderr` is fd 2; else `sys.stderr` itself (a test's
    capture)."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        if sys.stderr.fileno() == 2:
            return os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace"), True
    return sys.stderr, False


def take(dest: Path) -> None:
    """Append what was caught so far to `dest` (a run's driver.log) and start the catch afresh."""
    path = _early["path"]
    if path is None:
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        if os.path.getsize(path):
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as src, open(dest, "ab") as out:
                shutil.copyfileobj(src, out)
            os.truncate(path, 0)


@contextlib.contextmanager
def quiet_start(verbose: bool = False) -> Iterator[None]:
    """Catch stderr for the block (see the module doc); `verbose` (or already inside one): leave it live."""
    if verbose or _early["path"] is not None:
        yield
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    fd, path = tempfile.mkstemp(prefix="kava-start-", suffix=".log")
    term, owned = terminal_stream()
    saved, prev = os.dup(2), sys.stderr
    fd_term = term if owned else os.fdopen(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="replace")
    buf = os.fdopen(fd, "a", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(fd, 2)
    sys.stderr = buf
    _early.update(path=path, console=term, fd_console=fd_term)
    try:
        yield
    except BaseException as e:
        if not isinstance(e, (KavaError, NothingToDo, KeyboardInterrupt, SystemExit)):
            _show(path, term)  # an unexpected failure: what the libraries said may explain it
        raise
    finally:
        with contextlib.suppress(Exception):
            buf.flush()
        sys.stderr = prev
        os.dup2(saved, 2)
        os.close(saved)
        _early.update(path=None, console=None, fd_console=None)
        buf.close()
        fd_term.close()  # (term itself when owned)
        with contextlib.suppress(OSError):
            os.unlink(path)


def _show(path: str, term: TextIO) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        text = Path(path).read_text(errors="replace")
        if text:
            term.write(text)
            term.flush()
