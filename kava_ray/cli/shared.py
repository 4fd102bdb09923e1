"""What the `kava-ray` commands share: the common flags, printing a result, the quiet console, exit codes.

Exit codes: 0 ok (also a NothingToDo: its one line on stderr); 2 bad input (every KavaError: one
`error:` line on stderr); 3 `kava-ray plan` says the config does not fit; 130 interrupted (Ctrl-C);
143 terminated (SIGTERM, handled as Ctrl-C).

Each command imports its implementation (and pydantic, torch, Ray) inside its handler, not at the
top of its module: `kava-ray --help` and `kava-ray config show` then load none of what the other
commands need.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

from kava_ray.common.errors import KavaError, NothingToDo
from kava_ray.common.quiet_start import quiet_start
from kava_ray.common.signals import EXIT_TERMINATED, sigterm_as_interrupt, terminated

EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3
EXIT_INTERRUPTED = 130


class CommandParser(argparse.ArgumentParser):
    """A command's parser: its options anywhere among its positionals and KEY=VALUE overrides
    (`train --config job.yaml train.steps=2 --name x onpolicy.fraction=1`), by argparse's intermixed
    parsing. A parser of subcommands (`teachers`, `bench`) parses as usual and hands the rest to its
    subcommand's parser."""

    def add_argument(self, *args, **kwargs):
        if kwargs.get("nargs") == "*" and args and not args[0].startswith("-"):
            kwargs.setdefault("default", [])  # none given is fine: not listed as missing beside a missing positional
        return super().add_argument(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if self._subparsers is not None or getattr(self, "_intermixing", False):
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args calls parse_known_args itself (twice)
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def call(args: argparse.Namespace) -> int:
    """Run the parsed command's handler; a KavaError, Ctrl-C or SIGTERM becomes one `error:` line
    and its exit code (SIGTERM takes Ctrl-C's path: `kava_ray.common.signals`)."""
    sigterm_as_interrupt()
    try:
        # the commands that keep a run's logs: their imports' chatter goes there too (not --verbose)
        with quiet_start(not getattr(args, "quiet_start", False) or getattr(args, "verbose", True)):
            return args.func(args)
    except KavaError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NothingToDo as e:
        print(e, file=sys.stderr)
        return 0
    except KeyboardInterrupt as e:  # a command that saved its state says where (kava_ray.recipes.tune)
        word = "terminated (SIGTERM)" if terminated() else "interrupted"
        print(f"error: {word}{'; ' + str(e) if str(e) else ''}", file=sys.stderr)
        return EXIT_TERMINATED if terminated() else EXIT_INTERRUPTED


def print_json_last(obj: dict) -> None:
    """`--json`: one JSON object as the last line of stdout, for scripts."""
    print(json.dumps(obj, sort_keys=True, default=float))


def show(args, text: str, result: dict) -> int:
    """A command's result: its table, then with `--json` the whole result as the last line; exit 0."""
    print(text)
    if args.json:
        print_json_last(result)
    return 0


def job_config(args):
    """The job config of `--config` and its KEY=VALUE overrides."""
    from kava_ray.common.config import load_config

    return load_config(args.config, args.overrides)


def quiet(args, command: str, storage_path: Optional[str] = None):
    """`--verbose` off: the command's chatter goes to `<ray.storage_path>/logs/<command>-<time>/`
    (kava_ray.runtime.console.quiet); its own output (printed after this block) stays on the
    terminal."""
    from kava_ray.common.config import RayConfig
    from kava_ray.runtime.console import quiet as quiet_console

    storage = storage_path or RayConfig().storage_path
    log_dir = Path(storage).expanduser() / "logs" / f"{command}-{datetime.now():%Y%m%d-%H%M%S}"
    return quiet_console(log_dir, args.verbose)


def quiet_in_run(args, command: str, path: str):
    """`quiet` for a command on a run or checkpoint (`eval`): its logs in
    `RUN_DIR/eval/logs/<command>-<time>/`, beside its results, whatever directory it runs from."""
    from kava_ray.runtime.console import quiet as quiet_console

    p = Path(path).expanduser().resolve()
    run = p.parent if (p / "state.json").is_file() else p
    return quiet_console(run / "eval" / "logs" / f"{command}-{datetime.now():%Y%m%d-%H%M%S}", args.verbose)


# ----------------------------------------------------------------------------- flags


def add_config_args(p: argparse.ArgumentParser, required: bool = True, help_: str = "") -> None:
    p.add_argument("--config", required=required,
                   help=help_ or "a YAML file or a preset name (see `kava-ray config presets`)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr_student=3e-5")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's, the workers' and the libraries' log lines live (default: only status lines "
                        "and the progress bar; the rest goes to the run's logs/ dir)")


def add_output(p: argparse.ArgumentParser, handler) -> None:
    """--json and --verbose (a command that starts Ray), then the command's handler."""
    add_json(p)
    add_verbose(p)
    p.set_defaults(func=handler)


def add_address(p: argparse.ArgumentParser, cluster_only: bool = False) -> None:
    help_ = ("Ray address of a running cluster (auto = a local `ray start --head`)" if cluster_only else
             "Ray address (default: an embedded local Ray of the job's own; auto = a local `ray start --head`)")
    p.add_argument("--address", default=None, help=help_)


def add_restart_teachers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--restart-teachers", action="store_true",
                   help="replace a running teacher pool that was started for another config (model, weights, "
                        "quantization, dtype, key space) instead of refusing it")


def add_name(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--name", default=None, help=f"{what} name: its directory under ray.storage_path "
                                                "(default: the config's name and the time)")


def add_bench_job(p: argparse.ArgumentParser, default_out: str) -> None:
    """A bench that trains real runs: its base job (default the demo's), overrides, output dir, --json."""
    p.add_argument("--config", default="demo_cpu", help="base job config (a YAML path or a preset)")
    p.add_argument("--out", default=None, help=f"output dir (default: {default_out})")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the base config")
    add_json(p)
    add_verbose(p)
