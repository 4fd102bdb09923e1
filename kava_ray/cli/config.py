"""`kava-ray config show|presets`: the resolved job config as YAML; the shipped presets."""

from __future__ import annotations

from kava_ray.cli.shared import add_config_args, job_config


def register(sub) -> None:
    p_cfg = sub.add_parser("config", help="inspect job configs")
    cfg_sub = p_cfg.add_subparsers(dest="config_command", required=True)
    p = cfg_sub.add_parser("show", help="print the resolved config as YAML")
    add_config_args(p)
    p.set_defaults(func=show_config)
    p = cfg_sub.add_parser("presets", help="list the shipped presets")
    p.set_defaults(func=list_presets)


def show_config(args) -> int:
    print(job_config(args).to_yaml(), end="")
    return 0


def list_presets(args) -> int:
    from kava_ray.common.config import preset_names

    print("\n".join(preset_names()))
    return 0
