"""What a node sees at a local path, and the zero-CPU Ray task that looks there
(`node_paths.check_node_paths` runs one on each other node before a job starts).

A module of its own that imports only the standard library, Ray and `common.files`: a task's worker
imports the module of the function it runs, and `node_paths` (the job's reads, the pool, the
preflight) brings torch and transformers with it, ~3 CPU-seconds of a fresh worker on every node for
a few stats and reads (measured: docs/internals/runtime.md#node-paths).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import ray

from kava_ray.common.files import content_key

# what stands for a directory: the file its reader opens first
DIR_KEY_FILES = ("config.json", "manifest.json")


def look(path: str) -> Optional[str]:
    """What a node sees at `path`: None when nothing is there, else a key of its content (a file's
    `content_key`; a directory's `config.json` / `manifest.json`, or 'dir')."""
    p = Path(path)
    try:
        if p.is_dir():
            for name in DIR_KEY_FILES:
                if (p / name).is_file():
                    return f"{name}:{content_key(p / name).hexdigest()}"
            return "dir"
        if p.is_file():
            return content_key(p).hexdigest()
    except OSError as e:  # there, but this process may not read it
        return f"unreadable ({e.strerror or type(e).__name__})"
    return None


@ray.remote(num_cpus=0, max_retries=0)
def look_all(paths: list[str]) -> dict:
    """{path: look(path)} on the node the task runs on."""
    return {p: look(p) for p in paths}
