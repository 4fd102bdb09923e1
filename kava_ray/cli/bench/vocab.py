"""`kava-ray bench vocab`: teachers of another tokenizer: the vocabulary map's coverage and the positions paired."""

from __future__ import annotations

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("vocab", help="teachers of another tokenizer, real pairs: the vocabulary map's coverage "
                                     "and the share of student positions paired for logits (and aligned for KV)")
    p.add_argument("--docs", type=int, default=24, help="Python doc topics (natural text)")
    p.add_argument("--problems", type=int, default=64, help="synthetic math word problems")
    p.add_argument("--max-length", type=int, default=512)
    add_json(p)
    p.set_defaults(func=vocab)


def vocab(args) -> int:
    from kava_ray.bench.vocab import format_vocab_bench, run_vocab_bench

    out = run_vocab_bench(docs=args.docs, problems=args.problems, max_length=args.max_length)
    return show(args, format_vocab_bench(out), out)
