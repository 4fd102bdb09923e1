"""`kava-ray bench <name>`: side-by-side measurements on this machine; one module per bench, as in kava_ray.bench."""

from __future__ import annotations

from kava_ray.cli.bench import (
    align,
    data,
    eval_tasks,
    feed,
    gpu,
    heal,
    onpolicy,
    projector_ab,
    pull,
    recipes,
    scarce,
    step,
    task,
    tune_share,
    vocab,
)
from kava_ray.cli.bench import all as all_benches

BENCHES = (projector_ab, feed, step, gpu, tune_share, heal, pull, data, recipes, all_benches, align, vocab,
           onpolicy, task, scarce, eval_tasks)  # help order


def register(sub) -> None:
    p_bench = sub.add_parser("bench", help="side-by-side measurements on this machine")
    bench_sub = p_bench.add_subparsers(dest="bench_command", required=True)
    for bench in BENCHES:
        bench.register(bench_sub)
