"""`kava-ray config show|presets`: the resolved job config as YAML; the shipped presets."""

from __future__ import annotations

from kava_ray.cli.shared import add_config_args, job_config


def register(sub) -> None:
    p_cfg = sub.add_parser("config", help="inspect job configs")
    cfg_sub = p_cfg.add_subparsers(dest="config_command", required=True)
    p = cfg_sub.add_parser("show", help="print the resolved config as YAML")
    add_config_args(p)
    p.set_defaults(func=show_config)
    p = cfg_sub.add_parser("presets", help="list the shipped presets and their files")
    p.set_defaults(func=list_presets)


def show_config(args) -> int:
    print(job_config(args).to_yaml(), end="")
    return 0


def list_presets(args) -> int:
    """Each preset's name and file: copy one to start a job of your own (`--config my_job.yaml`)."""
    from importlib import resources

    from kava_ray.common.config import PRESET_PACKAGE, preset_names

    names = preset_names()
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {resources.files(PRESET_PACKAGE).joinpath(f'{name}.yaml')}")
    return 0
