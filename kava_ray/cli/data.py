"""`kava-ray data pydoc`: write the offline Python-docs corpus and measure it."""

from __future__ import annotations

from kava_ray.cli.shared import add_json, add_verbose, quiet, show


def register(sub) -> None:
    p_data = sub.add_parser("data", help="datasets: the offline Python-docs corpus")
    data_sub = p_data.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser("pydoc", help="write CPython's reference docs as train/validation/test JSONL (split by "
                                         "topic) and print their tokens and the teacher's and student's test CE")
    p.add_argument("--out", required=True, help="the corpus directory (train.jsonl, validation.jsonl, test.jsonl)")
    p.add_argument("--config", default="demo_cpu", help="the job whose tokenizer, teacher and student measure it")
    p.add_argument("--block", type=int, default=128, help="packed block length (train.max_length)")
    p.add_argument("--no-models", action="store_true", help="only write and count (no teacher / student CE)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of the job config")
    add_verbose(p)
    add_json(p)
    p.set_defaults(func=pydoc)


def pydoc(args) -> int:
    from kava_ray.recipes.datacmd import format_pydoc, pydoc_corpus

    with quiet(args, "data-pydoc"):
        out = pydoc_corpus(args.out, config=args.config, block=args.block, overrides=args.overrides,
                           models=not args.no_models)
    return show(args, format_pydoc(out), out)
