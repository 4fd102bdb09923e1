"""Keep a worker's resident memory at what it holds, not at the history of what it has read.

Random reads of `datasets`' memory-mapped Arrow cache leave ever more of it resident;
`release_mapped_pages` drops this process's mappings of those pages (`madvise(MADV_DONTNEED)`; the
data stays in the page cache), safe for read-only file mappings. Linux only, else a no-op.
Measurement: docs/internals/core.md#mmap-advice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from typing import Iterable

MADV_DONTNEED = 4  # <sys/mman.h> on Linux (every architecture)


def _mappings(paths: set[str]) -> list[tuple[int, int]]:
    """(start, end) of every mapping of one of `paths` in this process (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() in paths:
                lo, hi = parts[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc, looked up once (`find_library` runs `ldconfig -p`, ~2.4 ms; the stream releases every 16 batches)."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def cache_paths(datasets: Iterable) -> set[str]:
    """The Arrow cache files behind `datasets` (`Dataset.cache_files`; none for in-memory datasets)."""
    return {os.path.realpath(c["filename"]) for ds in datasets for c in (getattr(ds, "cache_files", None) or [])}


def release_mapped_pages(paths: set[str]) -> int:
    """MADV_DONTNEED on every mapping of `paths` in this process; returns the bytes of mappings released."""
    if not paths or not sys.platform.startswith("linux"):
        return 0
    try:
        libc = _libc()
        done = 0
        for lo, hi in _mappings(paths):
            if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0:
                done += hi - lo
        return done
    except OSError:
        return 0
