"""`kava-ray generate`: sample from a run's distilled student (`kava_ray.recipes.generate`)."""

from __future__ import annotations

import contextlib

from kava_ray.cli.shared import add_json, add_verbose, show


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample from a run's student (its final/, a checkpoint or a model dir)")
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("--prompt", required=True, help="the text to continue (in the chat template when it has one)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", dest="chat", action="store_false", default=None,
                   help="the prompt as it is, without the tokenizer's chat template")
    add_json(p)
    add_verbose(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """The completion on stdout, nothing else on the terminal: the libraries' chatter while they
    load (torchao's kernels, torch's deprecations, the weights' progress bar) is silenced unless
    --verbose."""
    from kava_ray.runtime.console import silenced

    with contextlib.nullcontext() if args.verbose else silenced():
        from kava_ray.recipes.generate import generate

        out = generate(args.path, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                       args.chat)
    return show(args, out["completion"], out)
