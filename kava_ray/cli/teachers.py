"""`kava-ray teachers up|status|down|precompute`: the job's teacher pool, and its KV written to disk."""

from __future__ import annotations

from kava_ray.cli.shared import (
    add_address,
    add_config_args,
    add_json,
    add_restart_teachers,
    add_verbose,
    job_config,
    quiet,
    show,
)
from kava_ray.common.files import format_table

ACTIONS = (("up", "start the pool as detached actors on a running cluster"),
           ("status", "a table of the running teachers"),
           ("down", "stop the pool"),
           ("precompute", "write the dataset's teacher KV to disk (resumes)"))


def register(sub) -> None:
    p_t = sub.add_parser("teachers", help="the teacher pool: up, status, down, precompute")
    t_sub = p_t.add_subparsers(dest="teachers_command", required=True)
    for name, help_ in ACTIONS:
        p = t_sub.add_parser(name, help=help_)
        add_config_args(p)
        add_address(p, cluster_only=name != "precompute")
        p.add_argument("--teacher", action="append", default=[], help="only this teacher (repeatable)")
        add_json(p)
        add_verbose(p)
        if name == "precompute":
            add_restart_teachers(p)
            p.add_argument("--out", required=True, help="cache directory (manifest.json + one safetensors shard per "
                                                        "example: any batch size, data seed or epoch count reads it)")
        p.set_defaults(func=teachers)


def teachers(args) -> int:
    from kava_ray.runtime.job import precompute, teacher_pool

    cfg = select_teachers(job_config(args), args.teacher)
    if args.teachers_command == "precompute":
        with quiet(args, "precompute", cfg.ray.storage_path):
            stats = precompute(cfg, args.out, restart_teachers=args.restart_teachers, address=args.address)
        return show(args, f"KV cache {args.out}: {stats['written']} example(s) written in {stats['forwards']} teacher "
                          f"batch(es), {stats['skipped']} already there, {stats['bytes'] / 2**20:.1f} MiB", stats)
    with quiet(args, f"teachers-{args.teachers_command}", cfg.ray.storage_path):
        out = teacher_pool(cfg, args.teachers_command, args.address)
    return show(args, format_pool(out), out)


def format_pool(out: dict) -> str:
    """`up` and `down`: one line; `status`: a table."""
    if out["action"] == "up":
        return (f"started {len(out['teachers'])} teacher(s) in namespace '{out['namespace']}': "
                f"{', '.join(out['teachers'])}")
    if out["action"] == "down":
        return f"stopped: {', '.join(out['teachers']) if out['teachers'] else 'nothing was running'}"
    return format_status(out["teachers"])


def select_teachers(cfg, names):
    """Restrict cfg to the teachers named with --teacher (unknown names are a one-line error)."""
    if not names:
        return cfg
    from kava_ray.common.config import derive

    return derive(cfg, {"teachers": [cfg.teacher(n) for n in names]})


def format_status(rows: list[dict]) -> str:
    header = ["name", "model", "device", "quant", "geometry", "requests", "forwards", "hits", "fwd ms",
              "KV B/token", "restarts"]
    out = []
    for r in rows:
        if not r["running"]:
            out.append([r["name"], r["model"], "not running"] + [""] * 8)
            continue
        out.append([r["name"], r["model"], r["device"], r["quantization"], r["geometry"], r["requests"],
                    r["forwards"], r["hits"], f"{r['mean_forward_ms']:.1f}", r["kv_bytes_per_token"], r["restarts"]])
    return format_table(header, out)
