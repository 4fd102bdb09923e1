"""`kava-ray bench recipes`: ce vs ce+kv vs ce+logits vs ce+kv+logits at equal compute over one teacher cache."""

from __future__ import annotations

from kava_ray.cli.shared import add_bench_job, show


def register(sub) -> None:
    p = sub.add_parser("recipes", help="ce vs ce+kv vs ce+logits vs ce+kv+logits at equal compute, "
                                       "over one precomputed teacher cache")
    add_bench_job(p, "<ray.storage_path>/bench-recipes-<time>")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--limit", type=int, default=64, help="test problems for greedy exact match (0 = skip)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="generation budget (SmolLM2 needs ~70 tokens to "
                                                                   "reach '#### <answer>' on the synthetic problems)")
    p.add_argument("--num-test", type=int, default=128, help="test examples every student is scored on")
    p.add_argument("--recipes", nargs="+", default=None, metavar="RECIPE",
                   help="run only these arms (default: ce ce+logits ce+kv ce+kv+logits); the teacher row always")
    p.add_argument("--address", default=None)
    p.set_defaults(func=recipes)


def recipes(args) -> int:
    from kava_ray.bench.recipes import format_recipes, run_recipes_bench

    out = run_recipes_bench(args.config, args.overrides, steps=args.steps, seeds=args.seeds, out=args.out,
                            limit=args.limit, max_new_tokens=args.max_new_tokens, num_test=args.num_test,
                            recipes=args.recipes, address=args.address)
    return show(args, format_recipes(out), out)
