"""`kava-ray demo`: the CPU demo (real SmolLM2 teachers, fp32 + NF4, distilled into a 6-layer student)."""

from __future__ import annotations

from kava_ray.cli.shared import add_address, add_output, show


def register(sub) -> None:
    p = sub.add_parser("demo", help="the CPU demo: real SmolLM2 teachers (fp32 + NF4) -> a 6-layer student")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of the demo_cpu preset")
    add_address(p)
    add_output(p, demo)
    p.set_defaults(quiet_start=True)  # the imports' chatter into the run's logs (`common.quiet_start`)


def demo(args) -> int:
    from kava_ray.recipes.demo import format_summary, run_demo

    summary = run_demo(args.overrides, address=args.address, verbose=args.verbose)
    return show(args, format_summary(summary), summary)
