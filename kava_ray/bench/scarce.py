"""`kava-ray bench scarce`: does distillation beat SFT where the field says it should — labels scarce, prompts many?

Run 1 of issue 63, pre-registered in docs/results.md ("Run 1"). The sort task (the README's
`sort.jsonl`, `task_records.sort_rows`, checker exact): a teacher fine-tuned on every training
record (`task_finetune.finetune`, until its validation exact match plateaus; kept by content), a
student that is a 24-of-30-layer copy of the *base* model (not of the fine-tuned teacher) given a
format warm start of `warm_steps` SFT steps on the `gold` labelled records. The other training
prompts have no label: the teacher's greedy completions of them are computed once (kept by content).
Every arm starts from that warm start, the same number of student steps:

- `sft-gold`: CE on the `gold` labelled records alone (what SFT can do with the labels there are);
- `seqkd`: CE on the teacher's completions of the unlabelled prompts (sequence-level KD, Kim & Rush 2016);
- `seqkd+logits`: the same plus the teacher's top-k forward KL (weight 1, the product's logit KD);
- `seqkd-opd`: a third of the steps `seqkd` (at `seqkd`'s chosen rate), then on-policy distillation: the student's
  own samples of the unlabelled prompts, the sampled reverse KL (λ 1, lag 0, the ratio clipped at 0.2, no CE).

Each arm's learning rate comes from a grid extended past an edge (`stats.bracketed`) on the
selection seed, which is not a test seed; the test seeds run at that rate. Figures on the test
prompts: greedy exact match against the gold completion and against the teacher's own greedy
completion (as curves, every `curve_every` steps), test CE of the gold completions, and the
student's samples' teacher-scored reverse KL and entropy (the guard). Differences are paired over
seeds and prompts (`paired_bootstrap`). The decision (`decide_scarce`) is stated before anything
trains.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from kava_ray.bench.heal import safe_name
from kava_ray.bench.heal_onpolicy import CountingSource, sample_entropy, sample_scores
from kava_ray.bench.inprocess import run_key, train_in_process
from kava_ray.bench.stats import bracketed, guarded_verdict, mean_sd, paired, paired_bootstrap
from kava_ray.bench.task_finetune import ArmContext, bench_run, finetune, records_job, reporter
from kava_ray.bench.task_records import ArmSizes, sort_rows, write_records
from kava_ray.common.config import derive, load_config
from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_write, write_json
from kava_ray.core.models import load_model, load_student, load_tokenizer
from kava_ray.data.splits import load_splits, load_test_split
from kava_ray.recipes.evaluate import answer_accuracy, generate_answers, heldout_ce, score_answers
from kava_ray.testing.inprocess_source import in_process_plans

BASE, CONTROL = "sft-gold", "seqkd"
# each arm: its records ("gold": the labelled few; "teacher": the teacher's completions of the
# unlabelled prompts) and its overrides of the records job (CE 1, top-k forward KL 1, no KV);
# `then`: a second phase from the first's weights for the last two thirds of the steps
LOGITS_OFF = {"loss.logit_weight": 0.0}
OPD = {"onpolicy.fraction": 1.0, "onpolicy.lag": 0, "loss.logit_divergence": "reverse_kl_sampled",
       "loss.rkl_clip": 0.2, "loss.ce_weight": 0.0, "loss.logit_weight": 1.0}
ARMS: dict[str, dict] = {
    "sft-gold": {"data": "gold", "set": LOGITS_OFF},
    "seqkd": {"data": "teacher", "set": LOGITS_OFF},
    "seqkd+logits": {"data": "teacher", "set": {}},
    "seqkd-opd": {"data": "teacher", "set": LOGITS_OFF, "then": OPD},
}
CE_MARGIN, ENTROPY_FLOOR = 0.05, 0.5  # the guards: as `bench task`'s

@dataclass(frozen=True)
class ScarceSizes(ArmSizes):
    """`bench scarce`'s sizes: `ArmSizes`, and gold (the labels SFT may read), selection_seed (the
    seed each arm's rate is chosen on, not a test seed), seeds (the test seeds), curve_every (steps
    between a curve's points), n_boot (bootstrap resamples) and n_entropy (prompts sampled for the
    entropy guard)."""

    gold: int
    selection_seed: int
    seeds: list
    curve_every: int
    n_boot: int
    n_entropy: int


DEFAULTS = ScarceSizes(counts={"train": 880, "validation": 64, "test": 256}, gold=32, steps=30, batch_size=8,
                       max_length=96, max_new=16, keep=[i for i in range(30) if i not in (3, 7, 11, 15, 19, 23)],
                       warm_steps=10, lr_warm=1e-4, lr_teacher=1e-4, ft_max=200, ft_every=25, ft_min=75,
                       ft_patience=2, ft_delta=0.02, lr=1e-4, lr_grid=(0.25, 1.0, 4.0), grid_extend=2,
                       selection_seed=0, seeds=[1, 2, 3, 4], curve_every=10, n_boot=2000, n_entropy=64,
                       eval_batch=256, temperature=1.0, quick=False)
QUICK = ScarceSizes(counts={"train": 40, "validation": 4, "test": 8}, gold=8, steps=3, batch_size=2, max_length=96,
                    max_new=8, keep=[0, 2], warm_steps=1, lr_warm=1e-3, lr_teacher=1e-3, ft_max=1, ft_every=1,
                    ft_min=0, ft_patience=1, ft_delta=0.0, lr=1e-3, lr_grid=(0.5, 2.0), grid_extend=0,
                    selection_seed=0, seeds=[1, 2], curve_every=1, n_boot=200, n_entropy=4, eval_batch=8,
                    temperature=1.0, quick=True)


def decision_rule() -> str:
    return (f"positive control: {CONTROL} beats {BASE} when the paired (seeds x prompts) bootstrap 95 % interval of "
            f"its exact-match gain lies above 0; if it does not, the bench cannot detect a benefit and no other arm's "
            f"'no gain' is reported as a finding. An arm helps (against {BASE}, and against {CONTROL} for the two "
            f"that add to it) when that interval lies above 0, AND its test CE is not worse by more than {CE_MARGIN} "
            f"nats (the paired interval's upper end), AND its samples' entropy stays above {ENTROPY_FLOOR:g} x the "
            f"warm start's (else 'collapsed', never 'helps'); 'hurts' when the interval lies below 0; else 'no "
            f"measurable gain'")


def verdict(runs: dict, arm: str, other: str, floor: float, n_boot: int) -> Optional[dict]:
    """`arm` against `other` over the test seeds: the bootstrap exact-match gain, the paired test-CE
    difference and the guarded verdict (`stats.guarded_verdict`: collapsed | helps | worse test CE |
    hurts | no measurable gain)."""
    if arm not in runs or other not in runs:
        return None
    a, b = runs[arm], runs[other]
    em = paired_bootstrap([r["ok"] for r in a], [r["ok"] for r in b], n_boot)
    ce = paired([r["figures"]["test_ce"] for r in a], [r["figures"]["test_ce"] for r in b])
    ent = mean_sd([r["figures"]["entropy"] for r in a])["mean"]
    return {"em": em, "test_ce": ce, "verdict": guarded_verdict(em, ce, ent, CE_MARGIN, floor)}


def decide_scarce(runs: dict, floor: float, n_boot: int) -> dict:
    """The pre-registered decisions (`decision_rule`): the positive control, each arm against
    sft-gold, and the two arms that add to seqkd against seqkd."""
    control = verdict(runs, CONTROL, BASE, floor, n_boot)
    out = {"control": control, "control_passes": bool(control and control["verdict"] == "helps"),
           "vs_base": {a: verdict(runs, a, BASE, floor, n_boot) for a in runs if a != BASE},
           "vs_seqkd": {a: verdict(runs, a, CONTROL, floor, n_boot) for a in runs if a.startswith("seqkd") and
                        a != CONTROL}}
    return out


def run_scarce_bench(config: str = "demo_cpu", overrides: Optional[list] = None, quick: bool = False,
                     out: Optional[str] = None, cache: Optional[str] = None, arms: Optional[list] = None,
                     progress: bool = True, verbose: bool = True) -> dict:
    """The whole bench (module docstring); returns its JSON-able result (also OUT/bench_scarce.json)."""
    p, names = QUICK if quick else DEFAULTS, _arms_checked(arms)
    base = load_config(config, overrides)
    with bench_run(base, "scarce", out, cache, quick, verbose) as (root, cache_dir):
        t_start = time.time()
        say = reporter("scarce", progress)

        say(f"decision rule, fixed before the run: {decision_rule()}")
        rows = sort_rows(p.counts)
        t_model, s_model = _model_dirs(base, quick, root)
        tok = load_tokenizer(t_model)
        gold, unlabelled = rows["train"][:p.gold], rows["train"][p.gold:]
        held = {"validation": rows["validation"], "test": rows["test"]}
        full = write_records(rows, root / "records" / "all", "exact")
        labelled = write_records({"train": gold, **held}, root / "records" / "gold", "exact")
        val, test = rows["validation"], rows["test"]
        say(f"records: {len(gold)} labelled + {len(unlabelled)} unlabelled training prompts, {len(val)} validation, "
            f"{len(test)} test (the sort task, checker exact)")
        ft = {}

        def tune(name, rec, model, keep, steps, lr, plateau):
            ft[name] = finetune(base, name, rec.plain, f"{rec.fingerprint}/{rec.plain.name}", model, keep, val,
                                "exact", p, steps, lr, cache_dir, root, tok, say, plateau)
            return ft[name]["path"]

        teacher_dir = tune("teacher", full, t_model, None, p.ft_max, p.lr_teacher, True)
        warm = tune("scarce-warm", labelled, s_model, p.keep, p.warm_steps, p.lr_warm, False)
        teacher = load_model(teacher_dir, dtype="float32")
        t_train, t_test, teacher_em = _teacher_written(teacher, tok, unlabelled, test, p, cache_dir, say)
        distilled = write_records({"train": t_train, **held}, root / "records" / "teacher", "exact")
        data = {"gold": labelled, "teacher": distilled}
        job0 = records_job(base, labelled.plain, [("teacher", teacher_dir)], warm, None, p, root)
        test_split, val_split = load_test_split(job0.data, job0.train, tok), load_splits(job0.data, job0.train, tok)[1]

        evaluate = _scorer(teacher, tok, test, t_test, p, test_split)
        start = evaluate(load_student(warm, dtype="float32"))
        say(f"warm start: {100 * start['em']:.1f} % exact match, test CE {start['test_ce']:.4f}, entropy "
            f"{start['entropy']:.3f}")
        ctx = ScarceContext(base=base, p=p, root=root, tok=tok, warm=warm, evaluate=evaluate, val=val,
                            val_split=val_split, say=say, teacher=teacher, teacher_dir=teacher_dir,
                            start_point={"em": start["em"], "teacher_match": start["teacher_match"]}, data=data)
        runs, lrs = {}, {}
        for arm in names:  # seqkd before seqkd-opd, whose first phase is seqkd at seqkd's rate
            lrs[arm] = _select(ctx, arm, lrs)
            runs[arm] = [_run(ctx, arm, s, lrs[arm]["lr"], lrs) for s in p.seeds]
        floor = ENTROPY_FLOOR * start["entropy"]
        decisions = decide_scarce(runs, floor, p.n_boot)
        summary = {a: {k: mean_sd([r["figures"][k] for r in rs]) for k in ("em", "teacher_match", "test_ce", "rkl",
                                                                         "entropy")} for a, rs in runs.items()}
        result = {"config": str(config), "out": str(root), "quick": quick, "params": asdict(p), "arms": names,
                  "decision_rule": decision_rule(), "entropy_floor": floor, "teacher_em": teacher_em,
                  "teacher_train": len(t_train), "finetunes": ft,
                  "start": {k: v for k, v in start.items() if k != "ok"},
                  "lr": lrs, "runs": runs, "summary": summary, "decisions": decisions, "wall_s": time.time() - t_start}
        write_json(root / "bench_scarce.json", result)
        return result


@dataclass
class ScarceContext(ArmContext):
    """`ArmContext` with the teacher (loaded, and its fine-tuned dir), the warm start's exact match
    and agreement with the teacher (an on-policy arm's phase 2 starts there) and the records of each
    arm's data."""

    teacher: Any = None
    teacher_dir: str = ""
    start_point: dict = None
    data: dict = None


def _teacher_written(teacher, tok, unlabelled: list, test: list, p: ArmSizes, cache_dir: Path, say
                     ) -> tuple[list, list, float]:
    """(the teacher's completions of the unlabelled prompts as records, the empty ones left out; its
    completions of the test prompts; its exact match on them)."""
    written = teacher_completions(teacher, tok, [r["question"] for r in unlabelled + test], p, cache_dir, say)
    t_train = [{"question": r["question"], "answer": written[r["question"]]} for r in unlabelled
               if written[r["question"]].strip()]
    t_test = [written[r["question"]] for r in test]
    teacher_em = score_answers(t_test, [r["answer"] for r in test], checker="exact")["accuracy"]
    say(f"teacher: {100 * teacher_em:.1f} % exact match on the {len(test)} test prompts; its completions of "
        f"{len(t_train)} unlabelled prompts ({len(unlabelled) - len(t_train)} empty, left out)")
    return t_train, t_test, teacher_em


def _arms_checked(arms: Optional[list]) -> list[str]:
    """The arms to run: among `ARMS` and with `BASE` and `CONTROL` (default: all of them)."""
    names = list(arms or ARMS)
    bad = [a for a in names if a not in ARMS]
    if bad or BASE not in names or CONTROL not in names:
        raise KavaError(f"bench scarce: arms must be among {', '.join(ARMS)} and include {BASE} and {CONTROL} "
                        f"(got {' '.join(names)})")
    return names


def _model_dirs(base, quick: bool, root: Path) -> tuple[str, str]:
    """(the teacher's base model, the student's): the job's, or in quick mode one tiny random Llama for both."""
    if not quick:
        return base.teachers[0].model, base.student.model
    from kava_ray.testing.tiny import build_tiny_model

    tiny = str(build_tiny_model(root / "tiny_base", family="llama", num_layers=3, hidden_size=64, seed=1))
    return tiny, tiny


def _scorer(teacher, tok, test: list, t_test: list, p: ArmSizes, test_split) -> Callable:
    """A student's test figures: greedy exact match on the test prompts and agreement with the
    teacher's completions (`ok`: per prompt); with `full_eval`, test CE and the teacher-scored
    reverse KL and entropy of its samples."""
    def evaluate(student, full_eval: bool = True) -> dict:
        preds = generate_answers(student, tok, [r["question"] for r in test], max_new_tokens=p.max_new,
                                 batch_size=p.eval_batch)
        ok = score_answers(preds, [r["answer"] for r in test], checker="exact")["ok"]
        agree = score_answers(preds, t_test, checker="exact")["ok"]
        out = {"em": float(np.mean(ok)), "teacher_match": float(np.mean(agree)), "ok": ok}
        if full_eval:
            sc = sample_scores(student, teacher, test_split, tok, p.max_new, p.n_entropy, p.eval_batch)
            out.update({"test_ce": heldout_ce(student, test_split), "rkl": sc["rkl"], "entropy": sample_entropy(sc),
                        "tokens": sc["tokens"]})
        return out

    return evaluate


def teacher_completions(teacher, tok, prompts: list, p: ArmSizes, cache: Path, say) -> dict:
    """{prompt: the teacher's greedy completion}, computed once per teacher and prompt set (kept under `cache`)."""
    key = run_key({"teacher": str(getattr(teacher, "name_or_path", "")), "prompts": prompts, "max_new": p.max_new,
                   "params": sum(float(x.detach().double().sum()) for x in list(teacher.parameters())[:4])})
    path = cache / f"completions-{key}.json"
    if path.is_file():
        say(f"teacher completions: kept from {path}")
        return json.loads(path.read_text())
    t0 = time.time()
    outs = generate_answers(teacher, tok, prompts, max_new_tokens=p.max_new, batch_size=p.eval_batch)
    done = dict(zip(prompts, outs))
    cache.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(done))
    say(f"teacher completions: {len(prompts)} prompts, greedy, {time.time() - t0:.0f} s")
    return done


def _job(ctx: ScarceContext, arm: str, seed: int, lr: float, student: str, steps: int, sets: dict):
    p = ctx.p
    cfg = records_job(ctx.base, ctx.data[ARMS[arm]["data"]].plain, [("teacher", ctx.teacher_dir)], student,
                      None, p, ctx.root)
    return derive(cfg, {**sets, "train.seed": seed, "train.data_seed": seed, "train.steps": steps,
                        "optim.lr_student": lr})


def _select(ctx: ScarceContext, arm: str, lrs: dict) -> dict:
    """The arm's rate on the selection seed, by validation exact match then validation CE, over a
    grid extended past an edge."""
    p = ctx.p
    best, grid, on_edge = bracketed(lambda m: _run(ctx, arm, p.selection_seed, p.lr * m, lrs, select=True),
                                    p.lr_grid, lambda r: (r["val"]["em"], -r["val"]["ce"]), p.grid_extend)
    return {"lr": p.lr * best, "grid": {f"{p.lr * m:.3g}": grid[m]["val"] for m in sorted(grid)},
            "on_edge": on_edge}


def _run(ctx: ScarceContext, arm: str, seed: int, lr: float, lrs: dict, select: bool = False) -> dict:
    """One run of `arm` from the warm start (kept under OUT/runs_done, read back by a re-run): with
    `select`, its validation figures only; else its test figures and curves."""
    p, a = ctx.p, ARMS[arm]
    first = lrs[CONTROL]["lr"] if "then" in a else None
    key = run_key({"arm": arm, "seed": seed, "lr": lr, "first": first, "select": select, "warm": ctx.warm,
                   "p": {k: v for k, v in asdict(p).items() if k not in ("seeds", "n_boot")}})
    path = ctx.done / safe_name(arm) / f"seed{seed}-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    t0 = time.time()
    steps, every = p.steps, (None if select else p.curve_every)

    def at(n_steps: int, final: bool):
        return None if select else _phase_curve(ctx, every, n_steps, final)

    def points(run, offset: int = 0) -> list:
        return [(offset + s, e) for s, e in run["curve"] if e is not None]

    if "then" in a:  # seqkd for a third of the steps at seqkd's rate, then the second phase at this arm's
        n1 = steps // 3
        run1 = _train(ctx, _job(ctx, arm, seed, first, ctx.warm, n1, a["set"]), n1, every, at(n1, False))
        mid = ctx.root / "tmp" / f"{safe_name(arm)}-{seed}-{key}"
        run1["recipe"].distiller.student.save_pretrained(mid)
        ctx.tok.save_pretrained(mid)
        cfg2 = _job(ctx, arm, seed, lr, str(mid), steps - n1, {**a["set"], **a["then"]})
        run = _train(ctx, cfg2, steps - n1, every, at(steps - n1, True))
        curve = points(run1) + points(run, n1)
    else:
        run = _train(ctx, _job(ctx, arm, seed, lr, ctx.warm, steps, a["set"]), steps, every, at(steps, True))
        curve = points(run)
    step_s = run["wall_step_s"]
    student = run["recipe"].distiller.student
    if select:
        em = answer_accuracy(student, ctx.tok, [r["question"] for r in ctx.val], [r["answer"] for r in ctx.val],
                             "exact", max_new_tokens=p.max_new, batch_size=p.eval_batch)["accuracy"]
        out = {"val": {"em": em,
                       "ce": heldout_ce(student, ctx.val_split)}}
    else:
        e = ctx.evaluate(student)
        point = {"em": e["em"], "teacher_match": e["teacher_match"]}
        out = {"figures": {k: v for k, v in e.items() if k != "ok"}, "ok": e["ok"],
               "curve": [(0, ctx.start_point)] + curve + [(steps, point)]}
    out.update({"seed": seed, "lr": lr, "s_per_step": step_s, "wall_s": time.time() - t0})
    write_json(path, out)
    f = out.get("figures") or out["val"]
    ctx.say(f"{arm} seed {seed} lr {lr:.2g}{' (selection)' if select else ''}: exact match {100 * f['em']:.1f} %"
            + (f", teacher match {100 * f['teacher_match']:.1f} %, test CE {f['test_ce']:.4f}, entropy "
               f"{f['entropy']:.3f}" if not select else f", validation CE {f['ce']:.4f}")
            + f" ({out['wall_s']:.0f} s)")
    return out


def _phase_curve(ctx: ScarceContext, every: int, n_steps: int, final: bool) -> Callable:
    """A phase's curve points (`train_in_process`'s evaluate): exact match against the gold and the
    teacher's completions, every `every` steps; not at the phase's step 0 (the warm start's, or the
    first phase's end) nor at the run's last step (the run's full evaluation scores it)."""
    calls, last = [], 1 + n_steps // every + (1 if n_steps % every else 0)

    def ev(recipe):
        calls.append(1)
        if len(calls) == 1 or (final and len(calls) == last):
            return None
        e = ctx.evaluate(recipe.distiller.student, full_eval=False)
        return {"em": e["em"], "teacher_match": e["teacher_match"]}

    return ev


def _train(ctx: ScarceContext, cfg, steps: int, every: Optional[int], evaluate) -> dict:
    """`train_in_process` of job `cfg` against the in-process teacher."""
    models = {"teacher": ctx.teacher}
    return train_in_process(cfg, in_process_plans(cfg, models), CountingSource(models), steps, every, evaluate)


def format_scarce(r: dict) -> str:
    """The bench's table: per arm, exact match (gold and teacher), test CE, entropy; the decisions."""
    from kava_ray.bench.stats import fmt_interval
    from kava_ray.common.files import format_table

    def pct(ms):
        return "—" if ms is None else f"{100 * ms['mean']:.1f} ± {100 * ms['sd']:.1f}"

    rows = [["teacher (fine-tuned on every label)", f"{100 * r['teacher_em']:.1f}", "100", "—", "—"],
            ["warm start", f"{100 * r['start']['em']:.1f}", f"{100 * r['start']['teacher_match']:.1f}",
             f"{r['start']['test_ce']:.4f}", f"{r['start']['entropy']:.3f}"]]
    for arm, s in r["summary"].items():
        rows.append([f"{arm} (lr {r['lr'][arm]['lr']:.3g})", pct(s["em"]), pct(s["teacher_match"]),
                     f"{s['test_ce']['mean']:.4f}", f"{s['entropy']['mean']:.3f}"])
    d = r["decisions"]
    lines = [format_table(["arm", "exact match %", "teacher match %", "test CE", "entropy"], rows), ""]
    c = d["control"]
    lines.append(f"positive control ({CONTROL} - {BASE}): exact match {fmt_interval(c['em'], 1, 100.0)} points: "
                 + ("passes" if d["control_passes"] else "FAILS: the bench cannot show a benefit here"))
    for title, group in ((f"against {BASE}", d["vs_base"]), (f"against {CONTROL}", d["vs_seqkd"])):
        for arm, v in group.items():
            if v:
                lines.append(f"{arm} {title}: exact match {fmt_interval(v['em'], 1, 100.0)} points, test CE "
                             f"{fmt_interval(v['test_ce'], 4)}: {v['verdict']}")
    n = len(r["params"]["seeds"])
    lines.append(f"{n} test seeds x {r['params']['counts']['test']} test prompts (the selection seed "
                 f"{r['params']['selection_seed']} chose each rate and is not among them); wall "
                 f"{r['wall_s'] / 60:.1f} min")
    return "\n".join(lines)

