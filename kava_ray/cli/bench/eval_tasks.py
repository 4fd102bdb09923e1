"""`kava-ray bench eval-tasks`: a run with `train.eval_tasks` against the same run without, in one invocation."""

from __future__ import annotations

from kava_ray.cli.shared import add_bench_job, show


def register(sub) -> None:
    p = sub.add_parser("eval-tasks", help="what train.eval_tasks costs: the same run with and without harness tasks")
    p.add_argument("--tasks", type=lambda v: v.split(","), default=None, metavar="NAME[,NAME...]",
                   help="train.eval_tasks of the second run (default kava_gsm8k,kava_pydoc_ppl)")
    p.add_argument("--limit", type=int, default=16, help="train.eval_tasks_limit: documents per task")
    add_bench_job(p, "<ray.storage_path>/bench-eval-tasks")
    p.set_defaults(func=eval_tasks)


def eval_tasks(args) -> int:
    from kava_ray.bench.eval_tasks import DEFAULT_TASKS, format_eval_tasks_bench, run_eval_tasks_bench

    out = run_eval_tasks_bench(args.config, args.overrides, args.tasks or DEFAULT_TASKS, args.limit, args.out)
    return show(args, format_eval_tasks_bench(out), out)
