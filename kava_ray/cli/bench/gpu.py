"""`kava-ray bench gpu`: proof on a GPU, Ray-free (toy sizes on a CPU)."""

from __future__ import annotations

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("gpu", help="proof on a GPU, Ray-free: teacher KV on CUDA vs CPU, the step under each "
                                   "precision, memory vs the planner, the 8 GB preset under an 8 GiB cap, "
                                   "tokens/s and MFU, the wire; toy sizes on a CPU")
    p.add_argument("--out", help="also write bench_gpu.json and bench_gpu.md here")
    p.add_argument("--toy", action="store_true", help="toy geometries even on CUDA")
    p.add_argument("--steps", type=int, default=3, help="steps per precision policy and for the 8 GB run")
    p.add_argument("--sections", nargs="+", metavar="NAME",
                   help="run only these sections (correctness precision memory fits_8gb speed wire chunked_loss fsdp)")
    add_json(p)
    p.set_defaults(func=gpu)


def gpu(args) -> int:
    from kava_ray.bench.gpu import format_gpu, run_gpu_bench

    result = run_gpu_bench(out=args.out, toy=args.toy, steps=args.steps, sections=args.sections)
    return show(args, format_gpu(result), result)
