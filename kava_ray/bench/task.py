"""`kava-ray bench task`: a better student on a task? Arms scored by greedy exact match on held-out prompts.

Records with a verifiable final answer (`bench.task_records`: the built-in `arith` task by default,
the synthetic GSM8K with `--task gsm8k`, or any prompt/completion JSONL with its checker); a
competent teacher (the job's first teacher's model fine-tuned on the training split until held-out
exact match plateaus, kept by content: `bench.task_finetune`) and, for the multi-teacher arms, two
specialists fine-tuned on one half of the records each (the `teacher` column); a student that can
already write the answer format (an SFT warm start of the job's layer-dropped student; of the
fine-tuned teacher's layers where the job's student is its teacher's model, as the demo's) and a
gate fixed before the run (its exact match at least `min_start`, and `min_gap` below the teacher's;
else one line and stop).

Then every arm from that warm start, the same number of student steps, paired over seeds (a seed
draws the record order and the samples), each at its own learning rate: chosen on seed 0 by
validation exact match (then CE) from a grid that is extended while the best sits on its edge; the
test seeds are 1..--seeds (seed 0, which chose the rates, is not among them). Scored on the test
split: greedy exact match on its first N prompts, test CE of its records, and the teacher-scored
reverse KL and entropy of the student's own samples (`bench.heal_onpolicy.sample_scores`). The
decision rule (`bench.task_report.decision_rule`) is stated before anything trains; the summary and
the table are `bench.task_report`'s.
"""

from __future__ import annotations

import difflib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from kava_ray.bench.heal import safe_name
from kava_ray.bench.heal_onpolicy import CountingSource, sample_entropy, sample_scores
from kava_ray.bench.inprocess import run_key, train_in_process
from kava_ray.bench.stats import bracketed
from kava_ray.bench.task_finetune import ArmContext, bench_run, finetune, records_job, reporter
from kava_ray.bench.task_records import TASKS, ArmSizes, TaskRecords, file_rows, score, write_records
from kava_ray.bench.task_report import BASE, ENTROPY_FLOOR, QUICK_NOTE, decision_rule, pair, summarize
from kava_ray.bench.task_trl import TRL_BETA, TRL_LMBDA, kava_batches, run_trl_gkd
from kava_ray.common.config import derive, load_config
from kava_ray.common.errors import KavaError
from kava_ray.common.files import write_json
from kava_ray.core.metric_names import SAMPLED_TOKENS
from kava_ray.core.models import load_model, load_student, load_tokenizer
from kava_ray.data.answers import CHECKERS
from kava_ray.data.batching import ROUTE
from kava_ray.data.splits import load_splits, load_test_split
from kava_ray.data.tokenize import encode_prompt
from kava_ray.recipes.evaluate import heldout_ce
from kava_ray.testing.inprocess_source import in_process_plans

JSD = {"onpolicy.fraction": TRL_LMBDA, "loss.logit_divergence": "jsd", "loss.jsd_beta": TRL_BETA}
# GKD's objective and nothing else, as TRL's GKDTrainer computes it: no CE on the data batches,
# sampled with the current weights (lag 0), the JSD over the whole vocabulary (top-k = the teacher's
# vocabulary, set per run) in float32 (bf16 log-probs move it by ~0.2 %), transformers' warm-up (lr
# 0 at step 0)
GKD = {**JSD, "loss.ce_weight": 0.0, "onpolicy.lag": 0, "optim.warmup_from_zero": True, "loss.logit_top_k": "vocab",
       "align.wire_dtype": "fp32"}
# each arm: its overrides of the records job (CE weight 1, logit weight 1, no KV), its teachers
# ("one": the generalist; "two": the specialists) and whether its records name their teacher (MOPD's
# per-record routing)
ARMS: dict[str, dict] = {
    "sft": {"set": {"loss.logit_weight": 0.0}, "teachers": "one"},
    "sft+logits": {"set": {}, "teachers": "one"},
    "seq_kd": {"set": {"onpolicy.fraction": 0.5, "onpolicy.source": "teacher"}, "teachers": "one"},
    "onpolicy-gkd": {"set": GKD, "teachers": "one"},
    "onpolicy-jsd+ce": {"set": JSD, "teachers": "one"},
    "onpolicy-rkl": {"set": {"onpolicy.fraction": 0.5, "loss.logit_divergence": "reverse_kl_sampled"},
                     "teachers": "one"},
    "onpolicy+kv": {"set": {**JSD, "loss.kv_weight": 1.0, "align.projector.kind": "auto"}, "teachers": "one"},
    "mopd": {"set": JSD, "teachers": "two", "routed": True},
    "fused": {"set": JSD, "teachers": "two"},
    "trl-gkd": {"trl": True, "teachers": "one"},
}
# what fits the default run on the 2-core box (README "A task bench"): the six; the others with --arms
DEFAULT_ARMS = ("sft", "sft+logits", "onpolicy-gkd", "onpolicy-jsd+ce", "onpolicy-rkl", "mopd", "trl-gkd")
QUICK_ARMS = ("sft", "onpolicy-gkd", "mopd", "trl-gkd")
# --quick's tiny random models answer nothing (exact match 0 for teacher and student): it shows the harness runs
# end to end, and its gate and decisions are stated as that, not as results
QUICK_GATE = QUICK_NOTE


def samples_own(arm: str) -> bool:
    """Whether `arm` trains on the student's own samples (the figure "student-sampled tokens / sample" is its)."""
    a = ARMS[arm]
    return bool(a.get("trl")) or (a["set"].get("onpolicy.fraction", 0) > 0
                                  and a["set"].get("onpolicy.source", "student") == "student")
MIN_START, MIN_GAP = 0.05, 0.20  # the gate: the warm start's exact match >= 5 %, >= 20 points below the teacher's

@dataclass(frozen=True)
class TaskSizes(ArmSizes):
    """`bench task`'s sizes: `ArmSizes`, and n_test (the held-out prompts scored: the first N of the
    test split), seeds (the test seeds 1..N), spec_max (a specialist's fine-tune, half the skills:
    at most this many steps) and warm_reach (the warm start trains until its validation exact match
    is at least this)."""

    n_test: int
    seeds: int
    spec_max: int
    warm_reach: float


DEFAULTS = TaskSizes(counts={"train": 2048, "validation": 64, "test": 128}, n_test=128, max_length=96, max_new=40,
                     batch_size=8, steps=12, seeds=5, keep=[i for i in range(30) if i not in (3, 7, 11, 15, 19, 23)],
                     lr_teacher=1e-4, ft_max=200, spec_max=100, ft_every=25, ft_min=75, ft_patience=2, ft_delta=0.02,
                     lr_warm=1e-4, warm_steps=300, warm_reach=0.1, lr=1e-4, lr_grid=(0.25, 1.0, 4.0), grid_extend=2,
                     temperature=1.0, eval_batch=64, quick=False)
QUICK = TaskSizes(counts={"train": 24, "validation": 4, "test": 4}, n_test=4, max_length=384, max_new=12,
                  batch_size=2, steps=2, seeds=2, keep=[0, 2], lr_teacher=1e-3, ft_max=1, spec_max=1, ft_every=1,
                  ft_min=0, ft_patience=1, ft_delta=0.0, lr_warm=1e-3, warm_steps=1, warm_reach=1.0, lr=1e-3,
                  lr_grid=(0.5, 2.0), grid_extend=0, temperature=1.0, eval_batch=4, quick=True)


def _params(quick: bool, steps: Optional[int], seeds: Optional[int], arms: Optional[Sequence[str]],
            records: Optional[str], checker: str) -> tuple[TaskSizes, list]:
    """The run's parameters and arms; each flag checked on its own, one line naming it, before anything is read."""
    if steps is not None and steps < 1:
        raise KavaError(f"bench task: --steps {steps}: give at least 1 student step per arm")
    if seeds is not None and seeds < 2:
        raise KavaError(f"bench task: --seeds {seeds}: give at least 2 (the intervals are paired over seeds)")
    for a in arms or ():
        if a not in ARMS:
            near = difflib.get_close_matches(a, ARMS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise KavaError(f"bench task: --arms {a!r} is not an arm{hint}; the arms: {', '.join(ARMS)}")
    if arms is not None and BASE not in arms:
        raise KavaError(f"bench task: --arms must include {BASE!r} (every arm is compared with it)")
    if checker not in CHECKERS:
        raise KavaError(f"bench task: --checker {checker!r}: one of {', '.join(CHECKERS)}")
    given = {k: v for k, v in (("steps", steps), ("seeds", seeds)) if v is not None}
    p = replace(QUICK if quick else DEFAULTS, **given)
    return p, list(arms or (QUICK_ARMS if quick else DEFAULT_ARMS))


def check_gate(min_start: float, min_gap: float, n_test: int) -> None:
    """The gate's figures are fractions (the CLI's flags are percent: `--min-start 5`), and a gate the test
    prompts could never pass -- a warm start of k / n_test correct with k / n >= min_start and 1 - k / n >= min_gap
    -- is refused here, before anything trains."""
    for flag, v in (("--min-start", min_start), ("--min-gap", min_gap)):
        if not 0.0 <= v <= 1.0:
            raise KavaError(f"bench task: {flag} {100 * v:g}: a percentage from 0 to 100")
    if math.ceil(min_start * n_test - 1e-9) / n_test > 1.0 - min_gap + 1e-9:
        raise KavaError(f"bench task: no result on {n_test} test prompts can pass the gate (a warm start >= "
                        f"{100 * min_start:g} % and >= {100 * min_gap:g} points below the teacher's): lower "
                        f"--min-start or --min-gap")


def _rows(records: Optional[str], task: str, checker: str, p: ArmSizes, names: list,
          arms_given: bool) -> tuple[dict, list, list]:
    """The records' rows (the built-in `task`'s, or the file's), read and checked before anything is
    written, and the arms they allow (the two-teacher arms need a teacher column): (rows, arms, arms
    dropped)."""
    rows = TASKS[task](p.counts) if records is None else file_rows(records, checker, p.counts)
    two = [a for a in names if ARMS[a]["teachers"] == "two"]
    if two and not any(ROUTE in r for r in rows["train"]):
        if arms_given:
            raise KavaError(f"bench task: {', '.join(two)} need(s) records with a \"{ROUTE}\" column naming one of two "
                            f"teachers; {records} has none")
        return rows, [a for a in names if a not in two], two
    return rows, names, []


def _models(base, quick: bool, root: Path) -> tuple[str, str, object]:
    """(teacher model, student model, tokenizer): the job's first teacher's and its student's
    models, or with `quick` one tiny random llama (kava_ray.testing.tiny, the shared byte tokenizer)
    as both, as the demo's job has one model for both (so the student starts from the fine-tuned
    teacher's layers)."""
    if quick:
        from kava_ray.testing.tiny import build_tiny_model

        t = build_tiny_model(root / "tiny_teacher", family="llama", num_layers=3, hidden_size=64, seed=1)
        return str(t), str(t), load_tokenizer(str(t))
    return base.teachers[0].model, base.student.model, load_tokenizer(base.teachers[0].model)


def _fit_sizes(p: TaskSizes, rows: dict, tok) -> TaskSizes:
    """max_length / max_new at least the longest record (prompt as rendered, completion, eos) and
    its longest completion in tokens (+4), so a longer task (`--task gsm8k`, a file) keeps its final
    answer: the defaults are arith's (where they change nothing)."""
    n = [(len(encode_prompt(tok, r["question"])), len(tok(r["answer"])["input_ids"]) + 1)
         for split in rows.values() for r in split]
    return replace(p, max_length=max(p.max_length, max(a + b for a, b in n)),
                   max_new=max(p.max_new, max(b for _, b in n) + 4))


@dataclass
class TaskContext(ArmContext):
    """`ArmContext` with the records, the teachers (loaded, and their fine-tuned dirs) and the checker."""

    rec: TaskRecords = None
    models: dict = None
    paths: dict = None
    checker: str = "number"


def run_task_bench(config: str = "demo_cpu", overrides: Optional[list[str]] = None, records: Optional[str] = None,
                   task: Optional[str] = None, checker: str = "number", arms: Optional[Sequence[str]] = None,
                   steps: Optional[int] = None, seeds: Optional[int] = None, quick: bool = False,
                   out: Optional[str] = None,
                   cache: Optional[str] = None, min_start: float = MIN_START, min_gap: float = MIN_GAP,
                   progress: bool = True, verbose: bool = True) -> dict:
    """The whole bench (module docstring); returns its JSON-able result (also OUT/bench_task.json).
    Stages: the records, the fine-tunes, the gate, the arms, the summary."""
    p, names = _params(quick, steps, seeds, arms, records, checker)
    check_gate(min_start, min_gap, p.n_test)
    task = _task_name(task, records)
    base = load_config(config, overrides)
    rows, names, dropped = _rows(records, task, checker, p, names, arms is not None)
    with bench_run(base, "task", out, cache, quick, verbose) as (root, cache_dir):
        t_start, say = time.time(), reporter("task", progress)
        say(f"decision rule, fixed before the run: {decision_rule()}")
        say(f"gate, fixed before the run: the warm start's exact match >= {100 * min_start:g} % and >= "
            f"{100 * min_gap:g} points below the teacher's")
        rec = write_records(rows, root / "records", checker)
        say(f"records: {rec.counts['train']} train, {rec.counts['validation']} validation, {rec.counts['test']} test "
            f"({f'the built-in {task!r} task' if records is None else records}; checker {checker})"
            + (f"; {', '.join(dropped)} dropped (no \"{ROUTE}\" column to route by)" if dropped else ""))
        t_model, s_model, tok = _models(base, quick, root)
        if not quick:  # (the quick mode's tiny random models answer nothing: its sizes stay small)
            p = _fit_sizes(p, rows, tok)
        val, test = rec.rows("validation"), rec.rows("test")[:p.n_test]
        two = any(ARMS[a]["teachers"] == "two" for a in names)  # the specialists are needed
        ft = _finetunes(base, rec, p, tok, (t_model, s_model), val, checker, two, (cache_dir, root), say)
        teacher = load_model(ft["teacher"]["path"], dtype="float32")
        job0 = records_job(base, rec.plain, [("teacher", ft["teacher"]["path"])], ft["warm"]["path"], None, p, root)
        evaluate = _scorer(teacher, tok, test, checker, p, load_test_split(job0.data, job0.train, tok))
        t_em, start, gate = _gate(teacher, ft, evaluate, (tok, test, checker, p), (min_start, min_gap), quick,
                                  root, say)
        models = {"teacher": teacher}
        for spec in rec.specialists if two else ():
            models[spec] = load_model(ft[spec]["path"], dtype="float32")
        ctx = TaskContext(base=base, p=p, root=root, tok=tok, warm=ft["warm"]["path"], evaluate=evaluate, val=val,
                          val_split=load_splits(job0.data, job0.train, tok)[1], say=say, rec=rec, models=models,
                          paths={n: ft[n]["path"] for n in models}, checker=checker)
        runs, lrs = {}, {}
        for arm in names:
            runs[arm], lrs[arm] = _arm(ctx, arm)
        floor = ENTROPY_FLOOR * start["entropy"]
        summary = summarize(runs, floor, quick=quick, own_samples=[a for a in names if samples_own(a)])
        result = {"config": str(config), "out": str(root), "quick": quick, "params": asdict(p),
                  "records": records or task, "checker": checker, "dropped": dropped, "counts": rec.counts,
                  "arms": names, "base": BASE, "decision_rule": decision_rule(), "entropy_floor": floor,
                  "gate": gate, "teacher_model": t_model, "student_model": s_model, "finetunes": ft,
                  "teacher_em": t_em, "start": start, "lr": lrs, "runs": runs, "summary": summary,
                  "vs_trl": pair(runs, "onpolicy-gkd", "trl-gkd", quick),
                  "mopd": {o: pair(runs, "mopd", o, quick) for o in ("fused", "onpolicy-jsd+ce")},
                  "wall_s": time.time() - t_start}
        write_json(root / "bench_task.json", result)
        return result


def _task_name(task: Optional[str], records: Optional[str]) -> str:
    """The built-in task to run (default `arith`), refused beside a records file of the user's own."""
    if task is not None and records is not None:
        raise KavaError("bench task: --task names a built-in task and --records a file of your own: give one")
    task = task or "arith"
    if task not in TASKS:
        raise KavaError(f"bench task: --task {task!r}: one of {', '.join(TASKS)} (or --records FILE.jsonl)")
    return task


def _finetunes(base, rec: TaskRecords, p: ArmSizes, tok, model_dirs: tuple, val: list, checker: str, two: bool,
               dirs: tuple, say) -> dict:
    """{name: its fine-tune (`task_finetune.finetune`)}: the generalist teacher, the specialists
    (`two`) and the student's warm start. The warm start is the student model's layers `keep`; where
    the job's student is its teacher's model (the demo), the fine-tuned teacher's layers (prune,
    then heal: Minitron's order), so the student starts in the regime on-policy distillation needs
    (it writes the answer format)."""
    (t_model, s_model), (cache_dir, root), ft = model_dirs, dirs, {}

    def tune(name, records_dir, rows, model, keep, steps_, lr, plateau, reach=None):
        ft[name] = finetune(base, name, records_dir, f"{rec.fingerprint}/{records_dir.name}", model, keep, rows,
                            checker, p, steps_, lr, cache_dir, root, tok, say, plateau, reach)

    tune("teacher", rec.plain, val, t_model, None, p.ft_max, p.lr_teacher, True)
    for spec in rec.specialists if two else ():
        tune(spec, rec.halves[spec], rec.rows("validation", rec.halves[spec]), t_model, None, p.spec_max,
             p.lr_teacher, True)
    pruned = ft["teacher"]["path"] if str(s_model) == str(t_model) else s_model
    tune("warm", rec.plain, val, pruned, p.keep, p.warm_steps, p.lr_warm, False, p.warm_reach)
    ft["warm"]["from"] = str(pruned)
    return ft


def _scorer(teacher, tok, test: list, checker: str, p: ArmSizes, test_split) -> Callable:
    """A student's test figures: greedy exact match on the test prompts, test CE of their records,
    and the teacher-scored reverse KL and entropy of its own samples."""
    def evaluate(student) -> dict:
        em = score(student, tok, test, checker, p)
        sc = sample_scores(student, teacher, test_split, tok, p.max_new, p.n_test, p.eval_batch)
        return {"em": em["em"], "test_ce": heldout_ce(student, test_split), "rkl": sc["rkl"],
                "teacher_nll": sc["teacher_nll"], "entropy": sample_entropy(sc), "tokens": sc["tokens"],
                "samples": em["samples"], "ok": em["ok"]}

    return evaluate


def _gate(teacher, ft: dict, evaluate, scoring: tuple, bounds: tuple, quick: bool, root: Path, say
          ) -> tuple[dict, dict, dict]:
    """(the teacher's exact match, the warm start's figures, the gate): stated, written to
    OUT/gate.json, and a failing gate one line before any arm runs (quick mode: stated and
    skipped)."""
    (tok, test, checker, p), (min_start, min_gap) = scoring, bounds
    t_em = score(teacher, tok, test, checker, p)
    start = evaluate(load_student(ft["warm"]["path"], dtype="float32"))
    gate = {"teacher_em": t_em["em"], "start_em": start["em"], "min_start": min_start, "min_gap": min_gap,
            "n": len(test), "skipped": quick}
    gate["passes"] = start["em"] >= min_start and t_em["em"] - start["em"] >= min_gap
    say(f"gate: teacher {100 * t_em['em']:.1f} %, warm start {100 * start['em']:.1f} % exact match on {len(test)} "
        f"test prompts: " + (QUICK_GATE if quick else "passes" if gate["passes"] else "FAILS"))
    write_json(root / "gate.json", {"gate": gate, "finetunes": ft, "start": start})
    if not gate["passes"] and not quick:
        raise KavaError(f"bench task: gate fails: the warm start's exact match {100 * start['em']:.1f} % (needs >= "
                        f"{100 * min_start:g} %) against the teacher's {100 * t_em['em']:.1f} % (needs >= "
                        f"{100 * min_gap:g} points above it) on {len(test)} test prompts; nothing run "
                        f"({root / 'gate.json'})")
    return t_em, start, gate


def _arm(ctx: TaskContext, arm: str) -> tuple[list, dict]:
    """An arm's learning rate (the selection seed 0, by validation exact match then validation CE,
    over a grid extended past an edge at most p.grid_extend times) and its runs on the test seeds
    1..p.seeds at that rate (seed 0 is not among them: its validation-chosen rate would flatter its
    test figures)."""
    p = ctx.p
    best, grid, on_edge = bracketed(lambda m: _run(ctx, arm, 0, p.lr * m, with_val=True), p.lr_grid,
                                    lambda r: (r["val"]["em"], -r["val"]["ce"]), p.grid_extend)
    lr = p.lr * best
    info = {"lr": lr, "grid": {f"{p.lr * m:.3g}": grid[m]["val"] for m in sorted(grid)}, "on_edge": on_edge}
    return [_run(ctx, arm, s, lr) for s in range(1, p.seeds + 1)], info


def _run(ctx: TaskContext, arm: str, seed: int, lr: float, with_val: bool = False) -> dict:
    """One run of `arm` from the warm start (kept under OUT/runs_done and read back by a re-run)."""
    p, a, rec = ctx.p, ARMS[arm], ctx.rec
    two = a["teachers"] == "two"
    teachers = list(rec.specialists) if two else ["teacher"]
    key = run_key({"arm": arm, "seed": seed, "lr": lr, "val": with_val, "warm": ctx.warm, "p": {
        k: v for k, v in asdict(p).items() if k not in ("ft_max", "ft_every", "seeds")}, "records": rec.fingerprint})
    path = ctx.done / safe_name(arm) / f"seed{seed}-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    models = {n: ctx.models[n] for n in teachers}
    samples = p.steps * p.batch_size
    t0 = time.time()
    # the arm's job (the TRL arm's too: its batches are this job's, in this job's order)
    records_dir = rec.routed if a.get("routed") else rec.plain
    cfg = records_job(ctx.base, records_dir, [(n, ctx.paths[n]) for n in teachers], ctx.warm, None, p,
                      ctx.root)
    vocab = int(models["teacher" if "teacher" in models else teachers[0]].config.vocab_size)
    sets = {k: (vocab if v == "vocab" else v) for k, v in a.get("set", {}).items()}  # GKD's whole vocabulary
    cfg = derive(cfg, {**sets, "train.seed": seed, "train.data_seed": seed, "train.steps": p.steps,
                       "optim.lr_student": lr})
    if a.get("trl"):
        r = run_trl_gkd(load_student(ctx.warm, dtype="float32"), models["teacher"], ctx.tok,
                        kava_batches(cfg, ctx.tok, p.steps), seed, lr, p)
        student, train_s, step_s = r["student"], r["train_s"], r["step_s"]
        work = {"teacher_rows_per_sample": r["teacher_rows_per_sample"], "generated_per_sample":
                r["generated_per_sample"], "loss": r["loss"]}
    else:
        source = CountingSource(models)
        t1 = time.time()
        run = train_in_process(cfg, in_process_plans(cfg, models), source, p.steps)
        student, train_s, step_s = run["recipe"].distiller.student, time.time() - t1, run["wall_step_s"]
        work = {"teacher_rows_per_sample": source.rows / samples,
                "teacher_written_per_sample": source.written / samples,
                "generated_per_sample": (run["sums"].get(SAMPLED_TOKENS, 0.0)) / samples}
    out = {"seed": seed, "lr": lr, "figures": ctx.evaluate(student), "s_per_step": step_s,
           "train_s": train_s, "wall_s": None, **work}
    if with_val:
        out["val"] = {"em": score(student, ctx.tok, ctx.val, ctx.checker, p)["em"],
                      "ce": heldout_ce(student, ctx.val_split)}
    out["wall_s"] = time.time() - t0
    write_json(path, out)
    f = out["figures"]
    ctx.say(f"{arm} seed {seed} lr {lr:.2g}: exact match {100 * f['em']:.1f} %, test CE {f['test_ce']:.4f}, "
            f"reverse KL {f['rkl']:.3f}, entropy {f['entropy']:.3f}, {out['s_per_step']:.1f} s/step "
            f"({out['wall_s']:.0f} s)")
    return out
