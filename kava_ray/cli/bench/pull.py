"""`kava-ray bench pull`: does the KV loss pull the student toward its teacher (old vs new projector default)?"""

from __future__ import annotations

from kava_ray.cli.shared import add_bench_job, show


def register(sub) -> None:
    p = sub.add_parser("pull", help="KV-only runs from the same start, old (random linear projector) vs new default "
                                    "(auto: identity): the projector-free KV cosine per layer, and grad/kv_share")
    add_bench_job(p, "<ray.storage_path>/bench-pull")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=5)
    p.set_defaults(func=pull)


def pull(args) -> int:
    from kava_ray.bench.pull import format_pull, run_pull_bench

    out = run_pull_bench(args.config, args.overrides, steps=args.steps, eval_every=args.eval_every, out=args.out)
    return show(args, format_pull(out), out)
