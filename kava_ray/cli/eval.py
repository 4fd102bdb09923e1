"""`kava-ray eval`: held-out CE, KV cos, contrast gap and GSM8K accuracy of a run or checkpoint."""

from __future__ import annotations

from kava_ray.cli.shared import add_address, add_output, add_restart_teachers, quiet, show
from kava_ray.common.files import format_table


def register(sub) -> None:
    p = sub.add_parser("eval", help="held-out CE, KV cos, contrast gap and GSM8K accuracy of a checkpoint")
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("--limit", type=int, default=16, help="GSM8K questions to generate answers for")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_address(p)
    add_restart_teachers(p)
    add_output(p, evaluate)


def evaluate(args) -> int:
    from kava_ray.recipes.evaluate import evaluate_checkpoint

    with quiet(args, "eval"):
        out = evaluate_checkpoint(args.path, limit=args.limit, max_new_tokens=args.max_new_tokens,
                                  address=args.address, restart_teachers=args.restart_teachers)
    rows = [[k, f"{v:.4f}" if isinstance(v, float) else v] for k, v in out.items() if k != "gsm8k_samples"]
    return show(args, format_table(["metric", "value"], rows), out)
