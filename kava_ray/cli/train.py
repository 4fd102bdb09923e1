"""`kava-ray train`: distill the teachers into the student (Ray Train); prints the last step's metrics."""

from __future__ import annotations

from kava_ray.cli import shared
from kava_ray.common.errors import KavaError
from kava_ray.common.files import format_table

# the prefixes shown: the loss and its terms, the alignment, on-policy's figures, the held-out ones, the waits
METRICS = ("loss", "ce", "kv_loss", "cos", "contrast_gap", "logit_", "top1_agree", "relation_loss", "hidden_loss",
           "onpolicy/", "eval/", "teacher_wait_s", "time/")


def register(sub) -> None:
    p = sub.add_parser("train", help="distill the teachers into the student (Ray Train)")
    shared.add_config_args(p, required=False, help_="a YAML file or a preset name (see `kava-ray config presets`); "
                                                    "with --resume, default: the config the run saved")
    shared.add_address(p)
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue a run: its directory (latest checkpoint) or one checkpoint dir; alone, with the "
                        "config and overrides the run was started with")
    p.add_argument("--resume-override", action="store_true",
                   help="with --resume: continue with this config's optim.*/train.*/data.*/loss.*/onpolicy.* values "
                        "where they differ")
    shared.add_name(p, "run")
    shared.add_restart_teachers(p)
    shared.add_output(p, train)
    p.set_defaults(quiet_start=True)  # the imports' chatter into the run's logs (`common.quiet_start`)


def train(args) -> int:
    from kava_ray.recipes.train import resume_config, run_training

    if args.config is None and args.resume is None:
        raise KavaError("train: --config is required (a YAML file or a preset), or --resume RUN_DIR to continue a "
                        "run with the config it saved")
    cfg = shared.job_config(args) if args.config else resume_config(args.resume, args.overrides)
    out = run_training(cfg, resume=args.resume, name=args.name, address=args.address,
                       resume_override=args.resume_override, restart_teachers=args.restart_teachers,
                       verbose=args.verbose)
    return shared.show(args, format_final(out), out)


def format_final(out: dict) -> str:
    """The last step's metrics; one the last step did not measure (the sampled reverse KL of a step
    that sampled nothing) is its last measured value, with its step."""
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else v  # noqa: E731
    values = {k: fmt(v) for k, v in out["metrics"].items()}
    values.update({k: f"{fmt(v)} (step {s})" for k, (s, v) in out.get("last_measured", {}).items()
                   if k not in values})
    rows = [[k, v] for k, v in sorted(values.items()) if k.startswith(METRICS)]
    return "\n".join([format_table(["metric (last step)", "value"], rows),
                      f"run dir: {out['run_dir']}  ({out['wall_s']:.0f} s)"])
