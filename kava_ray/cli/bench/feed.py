"""`kava-ray bench feed`: the KVFeed's teacher/student overlap across regimes, teacher early stop,
KV transport speed."""

from __future__ import annotations

import argparse

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("feed", help="teacher/student overlap of the KVFeed across regimes (T/S, teachers, "
                                    "replicas), teacher early stop, and KV transport speed")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0], metavar="T/S",
                   help="timed-teacher regimes: the slowest teacher's time over the student step's")
    p.add_argument("--teachers", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3],
                   help="teacher counts of the timed regimes")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4], help="replica counts at T/S = 4")
    p.add_argument("--real-layers", type=int, nargs="*", default=[8, 32],
                   help="layer counts of the real tiny teachers (none: skip the real mode)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--transport-mib", type=int, default=64)
    p.add_argument("--cross-node", action=argparse.BooleanOptionalAction, default=True,
                   help="also the teacher on another Ray node (a three-node local cluster, started for it)")
    add_json(p)
    p.set_defaults(func=feed)


def feed(args) -> int:
    from kava_ray.bench.feed import format_feed_bench, run_feed_bench

    result = run_feed_bench(steps=args.steps, batch=args.batch, tokens=args.tokens, ratios=args.ratios,
                            teacher_counts=args.teachers, replicas=args.replicas, real_layers=args.real_layers,
                            transport_mib=args.transport_mib, cross_node=args.cross_node)
    return show(args, format_feed_bench(result), result)
