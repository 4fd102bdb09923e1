"""`kava-ray bench all`: the performance benches at small defaults; rewrites docs/results.md's Performance table."""

from __future__ import annotations

import os
from pathlib import Path

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("all", help="the performance benches (feed, step + memory) and vocab at small defaults, "
                                   "~10 min; rewrites the Performance table of docs/results.md")
    p.add_argument("--results", default="docs/results.md", help="the file whose Performance block is rewritten")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/results.md alone")
    add_json(p)
    p.set_defaults(func=all_benches)


def all_benches(args) -> int:
    import torch

    from kava_ray.bench.all import check_results, format_all, performance_block, run_all, write_results

    results = None if args.no_write else Path(args.results)
    if results is not None:
        check_results(results)
    result = run_all()
    machine = (f"1 {torch.cuda.get_device_name(0)} + {os.cpu_count()} CPU cores" if torch.cuda.is_available()
               else f"a {os.cpu_count()}-core CPU, no GPU")
    text = format_all(result)
    if results is not None:
        write_results(results, performance_block(result, machine))
        text += f"\nwrote the Performance table of {results}"
    return show(args, text, result)
