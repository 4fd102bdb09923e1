"""`kava-ray bench task`: a better student on a task? Arms scored by greedy exact match, TRL's GKD beside them."""

from __future__ import annotations

from kava_ray.cli.shared import add_bench_job, show


def register(sub) -> None:
    p = sub.add_parser("task", help="a better student on a task? a fine-tuned teacher (and two specialists), an "
                                    "SFT-warm-started student behind a gate, off- and on-policy arms and TRL's "
                                    "GKDTrainer, paired seeds, greedy exact match on held-out prompts, a decision "
                                    "rule with guards; re-run with the same --out to go on where it stopped")
    add_bench_job(p, "<ray.storage_path>/bench-task-<time>")
    p.add_argument("--records", default=None, metavar="FILE.jsonl",
                   help="prompt/completion JSONL (an optional \"teacher\" column with two values routes the "
                        "specialists' arms); default: the built-in --task")
    p.add_argument("--task", default=None, help="a built-in task when no --records: arith (two-step arithmetic "
                                                  "worked in one line; the default) or gsm8k (the synthetic GSM8K "
                                                  "word problems, about 4x longer)")
    p.add_argument("--checker", default="number", help="number (the final number after ####) or exact (the whole "
                                                       "completion)")
    p.add_argument("--arms", nargs="+", default=None,
                   help="a subset of sft, sft+logits, seq_kd, onpolicy-gkd, onpolicy-jsd+ce, onpolicy-rkl, "
                        "onpolicy+kv, mopd, fused, trl-gkd (default: sft sft+logits onpolicy-gkd onpolicy-jsd+ce "
                        "onpolicy-rkl mopd trl-gkd)")
    p.add_argument("--steps", type=int, default=None, help="student steps per arm (default 12; --quick 2)")
    p.add_argument("--seeds", type=int, default=None, help="paired seeds (default 5; --quick 2)")
    p.add_argument("--cache", default=None, help="where the fine-tuned teachers and warm start are kept (default: "
                                                 "<kava-ray cache>/bench-task)")
    p.add_argument("--min-start", type=float, default=None, metavar="PERCENT",
                   help="the gate: the warm start's least exact match, in percent (default 5)")
    p.add_argument("--min-gap", type=float, default=None, metavar="POINTS",
                   help="the gate: how many points below the teacher's exact match the warm start must be "
                        "(default 20)")
    p.add_argument("--quick", action="store_true", help="tiny random models, a few steps, 2 seeds: checks the harness "
                                                        "end to end (no figure is a result; the gate is skipped)")
    p.set_defaults(func=task, quiet_start=True)


def task(args) -> int:
    from kava_ray.bench.task import MIN_GAP, MIN_START, run_task_bench
    from kava_ray.bench.task_report import format_task

    out = run_task_bench(args.config, args.overrides, records=args.records, task=args.task, checker=args.checker,
                         arms=args.arms,
                         steps=args.steps, seeds=args.seeds, quick=args.quick, out=args.out, cache=args.cache,
                         verbose=args.verbose,
                         min_start=MIN_START if args.min_start is None else args.min_start / 100,
                         min_gap=MIN_GAP if args.min_gap is None else args.min_gap / 100)
    return show(args, format_task(out), out)
