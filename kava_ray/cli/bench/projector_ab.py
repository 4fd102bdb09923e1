"""`kava-ray bench projector-ab`: Linear vs ElasticBottleneck projector on the predecessor's synthetic A/B."""

from __future__ import annotations

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("projector-ab", help="Linear vs ElasticBottleneck on the predecessor's synthetic A/B")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    add_json(p)
    p.set_defaults(func=projector_ab)


def projector_ab(args) -> int:
    from kava_ray.bench.projector import format_projector_ab, run_projector_ab

    result = run_projector_ab(seeds=args.seeds, steps=args.steps, lr=args.lr)
    return show(args, format_projector_ab(result), result)
