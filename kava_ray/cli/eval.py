"""`kava-ray eval`: held-out CE, KV cos, contrast gap and GSM8K accuracy of a run or checkpoint, beside the
teachers' own test CE."""

from __future__ import annotations

from kava_ray.cli.shared import add_address, add_output, add_restart_teachers, quiet, show
from kava_ray.common.files import format_table

TEACHER_CE = "test/teacher_ce/"


def register(sub) -> None:
    p = sub.add_parser("eval", help="held-out CE, KV cos, contrast gap and GSM8K accuracy of a checkpoint")
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="what to evaluate on, over the checkpoint's job: data.* (e.g. data.source=other.jsonl "
                        "data.test_split=test), train.batch_size, train.max_length, loss.vocab_chunk, ray.*")
    p.add_argument("--limit", type=int, default=16, help="GSM8K questions to generate answers for")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_address(p)
    add_restart_teachers(p)
    add_output(p, evaluate)


def evaluate(args) -> int:
    from kava_ray.recipes.evaluate import evaluate_checkpoint

    with quiet(args, "eval"):
        out = evaluate_checkpoint(args.path, limit=args.limit, max_new_tokens=args.max_new_tokens,
                                  address=args.address, restart_teachers=args.restart_teachers,
                                  overrides=args.overrides)
    return show(args, format_eval(out), out)


def format_eval(out: dict) -> str:
    """Each figure once (`metric | value`), then the test CE of the student and of each teacher."""
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    rows = [[k, fmt(v)] for k, v in out.items() if k != "gsm8k_samples" and not k.startswith(TEACHER_CE)]
    text = format_table(["metric", "value"], rows)
    teachers = {k[len(TEACHER_CE):]: v for k, v in out.items() if k.startswith(TEACHER_CE)}
    if teachers and "test/ce" in out:
        ce = [["student", fmt(out["test/ce"])]] + [[f"teacher {t}", fmt(v)] for t, v in teachers.items()]
        text += "\n\n" + format_table(["test CE (same tokens)", "nats/token"], ce)
    return text
