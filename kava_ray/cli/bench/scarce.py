"""`kava-ray bench scarce`: does distillation beat SFT where labels are scarce? (Run 1, docs/results.md)"""

from __future__ import annotations

from kava_ray.cli.shared import add_bench_job, show


def register(sub) -> None:
    p = sub.add_parser("scarce", help="does distillation beat SFT where labels are scarce? the sort task with 32 "
                                      "labelled records and many unlabelled prompts: SFT on the labels against "
                                      "sequence-level KD, +logits and + on-policy, each from one warm start at its "
                                      "own rate (a selection seed apart), paired over seeds and prompts, a "
                                      "positive control; re-run with the same --out to go on where it stopped")
    add_bench_job(p, "<ray.storage_path>/bench-scarce-<time>")
    p.add_argument("--arms", nargs="+", default=None, help="a subset of sft-gold, seqkd, seqkd+logits, seqkd-opd "
                                                           "(default: all four; sft-gold and seqkd always)")
    p.add_argument("--cache", default=None, help="where the fine-tuned teacher, warm start and teacher completions "
                                                 "are kept (default: <kava-ray cache>/bench-task)")
    p.add_argument("--quick", action="store_true", help="tiny random models, a few steps (the test runs this)")
    p.set_defaults(func=scarce, quiet_start=True)


def scarce(args) -> int:
    from kava_ray.bench.scarce import format_scarce, run_scarce_bench

    out = run_scarce_bench(args.config, args.overrides, quick=args.quick, out=args.out, cache=args.cache,
                           arms=args.arms, verbose=args.verbose)
    return show(args, format_scarce(out), out)
