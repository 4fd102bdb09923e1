"""`kava-ray bench onpolicy`: on-policy distillation's step at lag 0 and lag 1 beside timed teachers."""

from __future__ import annotations

from kava_ray.cli.shared import add_json, show


def register(sub) -> None:
    p = sub.add_parser("onpolicy", help="on-policy step time at lag 0 and lag 1 (one-step-off sampling) beside "
                                        "teachers as busy as the student")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32, help="onpolicy.max_new_tokens")
    p.add_argument("--engine", nargs="+", choices=["hf", "vllm"], default=None,
                   help="compare these onpolicy.engine values (sampled tokens/s, the step at lag 0 and 1) and a "
                        "teacher's scoring (HF forward vs vLLM prompt log-probs) instead of the lag bench")
    add_json(p)
    p.set_defaults(func=onpolicy)


def onpolicy(args) -> int:
    from kava_ray.bench.onpolicy import format_engine_bench, format_onpolicy_bench, run_engine_bench, run_onpolicy_bench

    if args.engine:
        result = run_engine_bench(list(dict.fromkeys(args.engine)), steps=args.steps, batch=args.batch,
                                  new_tokens=args.new_tokens)
        return show(args, format_engine_bench(result), result)
    result = run_onpolicy_bench(steps=args.steps, batch=args.batch, new_tokens=args.new_tokens)
    return show(args, format_onpolicy_bench(result), result)
