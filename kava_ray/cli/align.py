"""`kava-ray align cka`: which teacher layers each student layer should learn from (linear CKA)."""

from __future__ import annotations

from kava_ray.cli.shared import add_address, add_config_args, add_output, job_config, quiet, show


def register(sub) -> None:
    p_align = sub.add_parser("align", help="measure teacher/student layer alignment")
    align_sub = p_align.add_subparsers(dest="align_command", required=True)
    p = align_sub.add_parser("cka", help="linear CKA of every teacher layer vs every student layer on training "
                                        "examples -> one JSON of per-teacher layer maps (align.layer_map=cka) "
                                        "+ heat maps")
    add_config_args(p)
    p.add_argument("--samples", type=int, default=64, help="the first N training examples to measure on")
    p.add_argument("--top-k", type=int, default=1, help="teacher layers per student layer (weights: their CKA)")
    p.add_argument("--features", choices=("k", "v", "kv"), default="kv",
                   help="compare keys, values, or both (the mean of the two CKAs)")
    p.add_argument("--out", default=None, help="the JSON (default: <ray.storage_path>/cka/<config name>.json); "
                                               "a PNG per teacher goes next to it")
    add_address(p)
    add_output(p, cka)


def cka(args) -> int:
    from kava_ray.recipes.cka import format_cka, measure_cka

    cfg = job_config(args)
    with quiet(args, "align-cka", cfg.ray.storage_path):
        out = measure_cka(cfg, samples=args.samples, top_k=args.top_k, features=args.features, out=args.out,
                          address=args.address)
    brief = {k: v for k, v in out.items() if k != "teachers"} | {
        "teachers": {n: {"layer_map": e["layer_map"]} for n, e in out["teachers"].items()}}  # not the CKA matrices
    return show(args, format_cka(out, " ".join([args.config, *args.overrides])), brief)
