"""`kava-ray bench align`: layer maps, head projection and token alignment modes at equal steps."""

from __future__ import annotations

from kava_ray.cli.shared import add_bench_job, show


def register(sub) -> None:
    p = sub.add_parser("align", help="layer maps (ratio vs CKA), head projection (shared vs per_head) and token "
                                     "alignment modes (teacher of another tokenizer) at equal steps")
    add_bench_job(p, "<ray.storage_path>/bench-align")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--cka-samples", type=int, default=32, help="training examples the CKA map is measured on")
    p.set_defaults(func=align)


def align(args) -> int:
    from kava_ray.bench.align import format_align_bench, run_align_bench

    out = run_align_bench(args.config, args.overrides, steps=args.steps, out=args.out, cka_samples=args.cka_samples)
    return show(args, format_align_bench(out), out)
