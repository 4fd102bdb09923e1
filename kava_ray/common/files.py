"""Small helpers every layer shares: atomic writes, a cross-process lock, the cache directory, text
tables, one-line errors.

Atomic means a reader (or a crash) never sees a half-written file or directory: everything is
written next to its destination under a temporary name, flushed to disk, then renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from filelock import FileLock


def _fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Union[str, Path]) -> Iterator[Path]:
    """Yield a temporary file path beside `path`; on success it is fsynced and renamed onto `path`.

    For writers that want a path (savefig, csv, safetensors): `with atomic_path(p) as tmp: fig.savefig(tmp)`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: Union[str, Path], data: Union[str, bytes], keep_same: bool = False) -> Path:
    """Write `data` (text or bytes) to `path` atomically. keep_same: leave a file that already holds
    exactly `data` untouched (its mtime is part of a data source's fingerprint, which a teacher
    cache is keyed by)."""
    data = data.encode() if isinstance(data, str) else data
    path = Path(path)
    if keep_same and path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return path
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return path


def _json_default(x: Any) -> Any:
    """What json cannot write itself: numbers (numpy, 0-d tensors) as floats, paths as strings,
    arrays and tensors as lists, anything else as its str()."""
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if getattr(x, "ndim", 0):  # an array or tensor of several values
        return x.tolist()
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def write_json(path: Union[str, Path], obj: Any, indent: Optional[int] = 1) -> Path:
    """Write `obj` as JSON to `path` atomically (`atomic_write`); the one JSON writer of kava-ray.
    Values json cannot write go through one policy: numpy / torch numbers -> float, paths -> str."""
    return atomic_write(path, json.dumps(obj, indent=indent, default=_json_default))


@contextlib.contextmanager
def atomic_dir(path: Union[str, Path]) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; on success it replaces `path` (checkpoints, model dirs).

    An existing `path` is replaced only once the new directory is complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def file_lock(path: Union[str, Path], timeout: float = -1) -> FileLock:
    """An exclusive lock between processes (e.g. Ray actors converting one GGUF file): `with file_lock(p):`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path), timeout=timeout)


def default_cache_dir() -> Path:
    """kava-ray's cache (converted GGUF models, vocabulary maps, tokenized splits): $KAVA_RAY_CACHE
    or ~/.cache/kava-ray."""
    return Path(os.environ.get("KAVA_RAY_CACHE") or Path.home() / ".cache" / "kava-ray")


def name_problem(name: str) -> Optional[str]:
    """Why `name` is not one directory of letters, digits, `-`, `_` and `.` (None when it is): a
    run's or sweep's directory under `ray.storage_path`. `../x` would write outside it, a space or a
    shell character is one more thing to quote in every command that names the run; any Unicode
    letter or digit is fine (`modèle-v1`)."""
    bad = [c for c in name if not (c.isalnum() or c in "-_.")]
    if not name.strip() or name in (".", "..") or bad:
        return (f"{bad[0]!r} is not allowed in it" if bad else "it must name one directory") + \
            " (a run's name is one directory under ray.storage_path: letters, digits, '-', '_', '.')"
    return None


def format_table(header: list, rows: list[list]) -> str:
    """Plain left-aligned columns separated by two spaces, a dashed rule under the header.

    Plain text on purpose: it is what the CLI prints, what `--json` users grep, and what the README pastes.
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def fmt(row):
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def first_sentence(text: str, limit: int = 400) -> str:
    """The first paragraph of a message on one line: a library that wraps its sentences over several
    lines (Ray's connection errors) is not cut mid-sentence; a traceback or a blank line ends it,
    `limit` characters at most."""
    out: list[str] = []
    for line in str(text).strip().splitlines():
        line = line.strip()
        if not line:
            if out:
                break
            continue
        if out and (line.startswith(("Traceback", "File ", "During handling")) or line.endswith(":")
                    and len(out) > 1):
            break
        out.append(line)
    msg = " ".join(out)
    return msg if len(msg) <= limit else msg[: limit - 3].rstrip() + "..."


def first_line(e: BaseException, with_type: bool = False) -> str:
    """The first non-empty line of an exception's message (its type name when it has none).

    with_type: prefix the type, `ValueError: ...`, for errors from libraries whose type says what failed.
    """
    msg = first_sentence(str(e))
    if with_type:
        return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return msg or type(e).__name__


CONTENT_KEY_BYTES = 1 << 20  # read from each end of a file for its content key


def content_key(path: Union[str, Path], h=None):
    """A cheap key of a file's content, not of where or when it was written: its size and the hash
    of its first and last MiB (a weights file's header names every tensor, shape and offset; the
    tail holds the last tensors' data). Updates `h` (a hashlib object) when given, else returns a
    new sha1."""
    h = h if h is not None else hashlib.sha1()
    size = Path(path).stat().st_size
    h.update(f"{size}|".encode())
    with open(path, "rb") as f:
        h.update(f.read(CONTENT_KEY_BYTES))
        if size > CONTENT_KEY_BYTES:
            f.seek(max(CONTENT_KEY_BYTES, size - CONTENT_KEY_BYTES))
            h.update(f.read())
    return h
