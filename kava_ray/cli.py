"""The `kava-ray` command. Every KavaError becomes one line on stderr and exit code 2.

Subcommands import their modules lazily so `kava-ray config show` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Optional

from kava_ray.errors import KavaError


def _print_json_last(obj: dict) -> None:
    """`--json`: one JSON object as the last line of stdout, for scripts."""
    print(json.dumps(obj, sort_keys=True, default=float))


# ----------------------------------------------------------------------------- config


def cmd_config_show(args) -> int:
    from kava_ray.config import load_config

    cfg = load_config(args.config, args.overrides)
    print(cfg.to_yaml(), end="")
    return 0


# ----------------------------------------------------------------------------- bench


def cmd_bench_projector_ab(args) -> int:
    from kava_ray.bench_projector import format_projector_ab, run_projector_ab

    result = run_projector_ab(seeds=args.seeds, steps=args.steps, lr=args.lr)
    print(format_projector_ab(result))
    if args.json:
        _print_json_last(result)
    return 0


# ----------------------------------------------------------------------------- parser


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="a YAML file or a preset name (see `kava-ray config presets`)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr_student=3e-5")


def cmd_config_presets(args) -> int:
    from kava_ray.config import preset_names

    print("\n".join(preset_names()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kava-ray", description="Multi-teacher KV-cache distillation on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    p_cfg = sub.add_parser("config", help="inspect job configs")
    cfg_sub = p_cfg.add_subparsers(dest="config_command", required=True)
    p = cfg_sub.add_parser("show", help="print the resolved config as YAML")
    _add_config_args(p)
    p.set_defaults(func=cmd_config_show)
    p = cfg_sub.add_parser("presets", help="list the shipped presets")
    p.set_defaults(func=cmd_config_presets)

    p_bench = sub.add_parser("bench", help="side-by-side measurements on this machine")
    bench_sub = p_bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("projector-ab", help="Linear vs ElasticBottleneck on the predecessor's synthetic A/B")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=cmd_bench_projector_ab)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KavaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
