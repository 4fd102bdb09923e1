"""`kava-ray bench step`: a plain CE step vs CE+KV: time per phase, KV capture cost; measured vs planned memory."""

from __future__ import annotations

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("step", help="plain CE step vs CE+KV (structured, flat, + logits): time per phase, "
                                    "KV capture cost; --memory: measured vs planned memory per recipe")
    p.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each variant keeps its fastest)")
    p.add_argument("--memory", action="store_true", help="also measure each recipe's memory beside kava-ray plan "
                                                         "(a fresh process per recipe)")
    add_json(p)
    p.set_defaults(func=step)


def step(args) -> int:
    from kava_ray.bench.step import format_step_bench, run_step_bench

    result = run_step_bench(steps=args.steps, rounds=args.rounds, memory=args.memory)
    return show(args, format_step_bench(result), result)
