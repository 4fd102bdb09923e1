"""Where a same-node KV payload's time goes: a teacher's writes into object-store memory its process
has not written before, each 4 KiB page a page fault; once the store hands out memory the process
has written, the payload costs one copy and the call.

    RAY_AUTH_MODE=token python -m kava_ray.bench.object_store [--plasma-directory DIR] [--preallocate]

A fresh local Ray of its own; an actor answers 64 MiB payloads until the store is written once, and
the first ten answers are set against the last ten. The method and options:
docs/internals/runtime.md#bench-object-store.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from typing import Optional

import numpy as np
import ray
import torch

from kava_ray.bench.feed import TransportProbe
from kava_ray.runtime.connect import disconnect, single_machine_mode


def _minor_faults(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])


def run_object_store(plasma_directory: Optional[str] = None, preallocate: bool = False, store_gib: float = 4.0,
                     payloads: Optional[int] = None, mib: int = 64) -> dict:
    """The first and the last ten answers of an actor writing payloads through a fresh object store."""
    if preallocate:
        os.environ["RAY_preallocate_plasma_memory"] = "1"  # read by the raylet ray.init starts
    single_machine_mode()
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, object_store_memory=int(store_gib * 2**30), include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level="WARNING",
             **({"_plasma_directory": plasma_directory} if plasma_directory else {}))
    init_s = time.perf_counter() - t0
    try:
        probe = TransportProbe.remote(mib)
        nbytes = ray.get(probe.nbytes.remote())
        pid = ray.get(probe.__ray_call__.remote(lambda self: os.getpid()))
        n = payloads or int(1.25 * store_gib * 2**30 / nbytes) + 10
        rows = []
        for _ in range(n):
            f0, t = _minor_faults(pid), time.perf_counter()
            p = ray.get(probe.wire.remote())
            with warnings.catch_warnings():  # the arrays are read-only views of the store: nothing writes them
                warnings.simplefilter("ignore", UserWarning)
                kv = [torch.from_numpy(p[k]).view(torch.bfloat16) for k in ("k", "v")]  # what `from_wire` starts from
            rows.append((time.perf_counter() - t, _minor_faults(pid) - f0))
            del p, kv
        src = np.random.default_rng(0).integers(0, 2**16, nbytes // 2, dtype=np.uint16)
        dst = np.empty_like(src)
        for _ in range(5):
            np.copyto(dst, src)
        copies = []
        for _ in range(10):
            t = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - t)
    finally:
        disconnect()

    def part(rs):
        s = statistics.median(r[0] for r in rs)
        return {"s": s, "Bps": nbytes / s, "faults": int(statistics.median(r[1] for r in rs))}

    memcpy = nbytes / statistics.median(copies)
    first, last = part(rows[:10]), part(rows[-10:])
    return {"bytes": nbytes, "payloads": n, "store_bytes": int(store_gib * 2**30), "init_s": init_s,
            "plasma_directory": plasma_directory or "/dev/shm (Ray's default)", "preallocate": preallocate,
            "first": first, "last": last, "memcpy_Bps": memcpy,
            "first_over_memcpy": first["Bps"] / memcpy, "last_over_memcpy": last["Bps"] / memcpy}


def format_object_store(r: dict) -> str:
    head = (f"object store on {r['plasma_directory']}, {r['store_bytes'] / 2**30:g} GiB"
            f"{', preallocated' if r['preallocate'] else ''} (Ray start {r['init_s']:.1f} s): {r['payloads']} payloads "
            f"of {r['bytes'] / 2**20:.0f} MiB, actor -> driver")
    rows = [f"  {name:<12}{1000 * x['s']:6.1f} ms  {x['Bps'] / 1e9:6.2f} GB/s  "
            f"{x['Bps'] / r['memcpy_Bps']:.2f} x memcpy"
            f"  {x['faults']:>6} page faults in the actor" for name, x in (("first ten", r["first"]),
                                                                          ("last ten", r["last"]))]
    return "\n".join([head, *rows, f"  memcpy      {r['memcpy_Bps'] / 1e9:.2f} GB/s"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kava_ray.bench.object_store", description=__doc__.split("\n")[0])
    ap.add_argument("--plasma-directory", default=None, help="a tmpfs for the object store (default: /dev/shm)")
    ap.add_argument("--preallocate", action="store_true", help="RAY_preallocate_plasma_memory=1")
    ap.add_argument("--store-gib", type=float, default=4.0)
    ap.add_argument("--payloads", type=int, default=None,
                    help="at least 20 (default: enough to write the store once, +25 %%)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.payloads is not None and a.payloads < 20:
        ap.error("--payloads: at least 20 (the first ten and the last ten)")
    r = run_object_store(a.plasma_directory, a.preallocate, a.store_gib, a.payloads)
    print(format_object_store(r))
    if a.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
