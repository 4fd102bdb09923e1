"""`kava-ray bench tune-share`: a tiny sweep with one shared teacher pool vs teachers per trial."""

from __future__ import annotations

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("tune-share", help="a tiny sweep with one shared teacher pool vs teachers per trial")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    add_json(p)
    p.set_defaults(func=tune_share)


def tune_share(args) -> int:
    from kava_ray.bench.tune_share import format_tune_share, run_tune_share

    out = run_tune_share(trials=args.trials, steps=args.steps)
    return show(args, format_tune_share(out), out)
