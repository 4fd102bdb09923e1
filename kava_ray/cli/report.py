"""`kava-ray report`: plots and a Markdown summary of a run dir's metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("report", help="plots + Markdown summary of a run dir's metrics.jsonl")
    p.add_argument("run_dir")
    add_json(p)
    p.set_defaults(func=report)


def report(args) -> int:
    from kava_ray.recipes.report import summarize_run, write_report

    out = write_report(args.run_dir)
    return show(args, f"{summarize_run(args.run_dir)}\nreport: {Path(args.run_dir) / 'report'}", out)
