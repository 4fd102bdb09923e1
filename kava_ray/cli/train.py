"""`kava-ray train`: distill the teachers into the student (Ray Train); prints the last step's metrics."""

from __future__ import annotations

from kava_ray.cli import shared
from kava_ray.common.files import format_table

METRICS = ("loss", "ce", "kv_loss", "cos", "contrast_gap", "eval/", "teacher_wait_s")  # the prefixes shown


def register(sub) -> None:
    p = sub.add_parser("train", help="distill the teachers into the student (Ray Train)")
    shared.add_config_args(p)
    shared.add_address(p)
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue a run: its directory (latest checkpoint) or one checkpoint dir")
    p.add_argument("--resume-override", action="store_true",
                   help="with --resume: continue with this config's optim.*/train.*/data.*/loss.* values where they "
                        "differ")
    shared.add_name(p, "run")
    shared.add_restart_teachers(p)
    shared.add_output(p, train)


def train(args) -> int:
    from kava_ray.recipes.train import run_training

    cfg = shared.job_config(args)
    out = run_training(cfg, resume=args.resume, name=args.name, address=args.address,
                       resume_override=args.resume_override, restart_teachers=args.restart_teachers,
                       verbose=args.verbose)
    return shared.show(args, format_final(out), out)


def format_final(out: dict) -> str:
    rows = [[k, f"{v:.4f}" if isinstance(v, float) else v] for k, v in sorted(out["metrics"].items())
            if k.startswith(METRICS)]
    return "\n".join([format_table(["metric (last step)", "value"], rows),
                      f"run dir: {out['run_dir']}  ({out['wall_s']:.0f} s)"])
