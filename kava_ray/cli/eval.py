"""`kava-ray eval`: held-out CE, KV cos, contrast gap and GSM8K accuracy of a run or checkpoint,
beside the teachers' own test CE."""

from __future__ import annotations

from kava_ray.cli.shared import add_address, add_output, add_restart_teachers, quiet_in_run, show
from kava_ray.common.errors import KavaError
from kava_ray.common.files import format_table

TEACHER_CE = "test/teacher_ce/"
GSM8K_LIMIT, MAX_NEW_TOKENS = 16, 128  # without --tasks: GSM8K questions answered, and their new tokens


def register(sub) -> None:
    p = sub.add_parser("eval", help="held-out CE, KV cos, contrast gap and GSM8K accuracy of a checkpoint; "
                                    "lm-evaluation-harness tasks beside its teachers (--tasks)")
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="what to evaluate on, over the checkpoint's job: data.* (e.g. data.source=other.jsonl "
                        "data.test_split=test), train.batch_size, train.max_length, loss.vocab_chunk, ray.*")
    p.add_argument("--tasks", type=lambda v: [t for t in v.split(",")], metavar="NAME[,NAME...]",
                   help="lm-evaluation-harness tasks on the student and each teacher instead: kava_gsm8k, "
                        "kava_pydoc_ppl (shipped, offline), file:PATH (a prompt/completion JSONL, exact match) or any "
                        "lm-eval task name; results in RUN_DIR/eval/")
    p.add_argument("--no-teachers", dest="teachers", action="store_false",
                   help="--tasks on the student alone (default: each teacher too, for the student's share)")
    p.add_argument("--baseline", metavar="init|CHECKPOINT",
                   help="--tasks on a baseline student too, for the gap recovered: init (the student before "
                        "training) or a run / checkpoint dir (e.g. one of the run's checkpoint_...)")
    p.add_argument("--limit", type=int, default=None,
                   help="the first N documents of each task (--tasks; default all); GSM8K questions to generate "
                        f"answers for (default {GSM8K_LIMIT})")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    add_address(p)
    add_restart_teachers(p)
    add_output(p, evaluate)
    p.set_defaults(quiet_start=True)  # the imports' chatter into the eval's logs (`common.quiet_start`)


def evaluate(args) -> int:
    if args.tasks is not None:
        return evaluate_tasks(args)
    if args.baseline is not None or not args.teachers:
        raise KavaError("--baseline and --no-teachers are for --tasks")
    from kava_ray.recipes.evaluate import evaluate_checkpoint

    with quiet_in_run(args, "eval", args.path):
        out = evaluate_checkpoint(args.path, limit=GSM8K_LIMIT if args.limit is None else args.limit,
                                  max_new_tokens=args.max_new_tokens,
                                  address=args.address, restart_teachers=args.restart_teachers,
                                  overrides=args.overrides)
    return show(args, format_eval(out), out)


def evaluate_tasks(args) -> int:
    from kava_ray.recipes.eval_tasks import evaluate_tasks as run
    from kava_ray.recipes.eval_tasks import format_tasks

    held_out = [f for f, on in (("--restart-teachers", args.restart_teachers),
                                ("--max-new-tokens", args.max_new_tokens != MAX_NEW_TOKENS)) if on]
    if held_out:  # (the tasks load every model themselves: no teacher pool)
        raise KavaError(f"{held_out[0]} is for the held-out evaluation, not --tasks (which loads the student and "
                        f"each teacher itself: here one at a time, or with --address side by side on the cluster)")
    if args.limit is not None and args.limit < 1:
        raise KavaError(f"--limit {args.limit}: give at least 1 document per task")
    with quiet_in_run(args, "eval", args.path):
        out = run(args.path, args.tasks, limit=args.limit, teachers=args.teachers, baseline=args.baseline,
                  overrides=args.overrides, address=args.address)
    return show(args, format_tasks(out), out)


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
