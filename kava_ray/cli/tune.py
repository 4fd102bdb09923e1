"""`kava-ray tune`: a Ray Tune search over projector/loss hyper-parameters, the trials sharing one teacher pool."""

from __future__ import annotations

from kava_ray.cli import shared


def register(sub) -> None:
    p = sub.add_parser("tune", help="Ray Tune search over projector/loss hyper-parameters (shared teachers)")
    shared.add_config_args(p)
    p.add_argument("--space", required=True, help="a search-space YAML or a name in tune_spaces/ (e.g. default)")
    p.add_argument("--num-samples", type=int, default=None)
    p.add_argument("--max-concurrent", type=int, default=None)
    shared.add_name(p, "sweep")
    shared.add_restart_teachers(p)
    p.add_argument("--resume", default=None, metavar="SWEEP_DIR",
                   help="continue an interrupted sweep: its directory (or its name); finished trials stay")
    shared.add_address(p)
    shared.add_output(p, tune)
    p.set_defaults(quiet_start=True)  # the imports' chatter into the sweep's logs (`common.quiet_start`)


def tune(args) -> int:
    from kava_ray.recipes.tune import format_results, run_tune

    cfg = shared.job_config(args)
    with shared.quiet(args, "tune", cfg.ray.storage_path):
        out = run_tune(cfg, args.space, num_samples=args.num_samples, max_concurrent=args.max_concurrent,
                       resume=args.resume, name=args.name, address=args.address,
                       restart_teachers=args.restart_teachers)
    return shared.show(args, format_results(out), out)
