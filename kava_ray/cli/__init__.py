"""The `kava-ray` command: parse, call one orchestration function, print.

One module per command, each registering its subparser and holding its handler; `shared` holds the
common flags, the result printer and the exit codes (0 ok, 2 bad input, 3 does not fit, 130
interrupted).
"""

from __future__ import annotations

import argparse
from typing import Optional

from kava_ray.cli import align, bench, config, data, demo, generate, plan, report, teachers, train, tune
from kava_ray.cli import eval as eval_
from kava_ray.cli.shared import CommandParser, call

# the order of --help
COMMANDS = (config, data, teachers, align, train, tune, plan, demo, eval_, generate, report, bench)
__all__ = ["COMMANDS", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kava-ray", description="Multi-teacher KV-cache distillation on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    return call(build_parser().parse_args(argv))

