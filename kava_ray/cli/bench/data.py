"""`kava-ray bench data`: the data path's memory, time to the first batch and tokens/s on corpora of growing size."""

from __future__ import annotations

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("data", help="driver and worker peak RSS, time to the first batch and stream tokens/s "
                                    "for generated text corpora of growing size (packed, datasets/Arrow)")
    p.add_argument("--sizes", type=float, nargs="+", default=[10, 100, 1000], help="corpus sizes in MB")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=200, help="batches the worker takes to time the stream")
    p.add_argument("--out", default=None, help="where corpora and caches go (default: a temp dir)")
    add_json(p)
    p.set_defaults(func=data)


def data(args) -> int:
    from kava_ray.bench.data import format_data_bench, run_data_bench

    out = run_data_bench(sizes_mb=args.sizes, max_length=args.max_length, batch_size=args.batch_size,
                         batches=args.batches, out=args.out)
    return show(args, format_data_bench(out), out)
