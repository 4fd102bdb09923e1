"""`kava-ray bench heal`: does it distil? The demo's pruned student healed on the Python docs, a decision rule."""

from __future__ import annotations

from kava_ray.cli.shared import add_bench_job, show


def register(sub) -> None:
    p = sub.add_parser("heal", help="does it distil? the demo's pruned student healed on the Python docs: a "
                                    "positive control (logit KD), KV arms, paired seeds, a decision rule; re-run "
                                    "with the same --out to go on where it stopped")
    add_bench_job(p, "<ray.storage_path>/bench-heal-<time>")
    p.add_argument("--steps", type=int, default=None, help="steps per arm (default 30; --quick 3)")
    p.add_argument("--arms", nargs="+", default=None,
                   help="a subset of ce, ce+logits, ce+kv, ce+kv-0.3, ce+kv-otherbatch, ce+logits+kv, "
                        "ce+logits+kv-otherbatch, ce+logits+relation, ce+logits+hidden, ce+logits-nf4, kv-only "
                        "(default: these), ce+logits+kv-linear, ce+logits+kv-fit, ce+logits+kv-elastic (--width-kv)")
    p.add_argument("--seeds", type=int, default=None, help="test seeds, 1..N (default 5; --quick 2): seed 0 chooses "
                                                           "each arm's rate and is not among them")
    p.add_argument("--quick", action="store_true", help="toy sizes (the test runs this)")
    p.add_argument("--min-gap", type=float, default=1.0, help="the gate: nats the teacher must beat the student by")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="an extra arm on top of ce, e.g. best-kv:loss.kv_weight=0.3,loss.kv_parts=keys (repeatable)")
    p.add_argument("--base", default=None, help="the arm every other is paired against (default ce; ce+logits with "
                                                "--width-kv; or a --recipe name, e.g. ce at a tuned learning rate)")
    p.add_argument("--onpolicy", action="store_true",
                   help="after the warm start, the on-policy arms instead (ce+logits off-policy, onpolicy-jsd, "
                        "onpolicy-rkl, seq_kd) on prompt/completion records of the same text, scored by the teacher's "
                        "reverse KL of the student's own held-out samples")
    p.add_argument("--lr-scale", type=float, default=4.0,
                   help="--onpolicy: every arm's student rate, x the job's optim.lr_student (default 4)")
    p.add_argument("--width-kv", type=int, default=None, metavar="N",
                   help="width-prune the student's attention to N KV groups per layer (Minitron: the most active "
                        "kept), so its KV geometry differs from the teacher's and the KV term needs a projector; "
                        "arms default to ce+logits and ce+logits+kv through a linear, fit and elastic projector")
    p.add_argument("--address", default=None)
    p.set_defaults(func=heal)


def heal(args) -> int:
    from kava_ray.bench.heal import format_heal, parse_recipe, run_heal_bench

    recipes = dict(parse_recipe(r) for r in args.recipe)
    out = run_heal_bench(args.config, args.overrides, steps=args.steps, seeds=args.seeds, arms=args.arms,
                         quick=args.quick, out=args.out, min_gap=args.min_gap, arm_overrides=recipes,
                         address=args.address, base_arm=args.base, onpolicy=args.onpolicy, lr_scale=args.lr_scale,
                         width_kv=args.width_kv)
    if args.onpolicy:
        from kava_ray.bench.heal_onpolicy import format_onpolicy

        return show(args, format_onpolicy(out), out)
    return show(args, format_heal(out), out)
