"""`kava-ray bench task`: a better student on a task? Arms scored by greedy exact match on held-out prompts.

Records with a verifiable final answer (`bench.task_records`: the synthetic GSM8K by default, or any
prompt/completion JSONL with its checker); a competent teacher (the job's first teacher's model fine-tuned on the
training split until held-out exact match plateaus, kept by content: `bench.task_finetune`) and, for the
multi-teacher arms, two specialists fine-tuned on one half of the records each (the `teacher` column); a student
that can already write the answer format (an SFT warm start of the job's layer-dropped student) and a gate fixed
before the run (its exact match at least `min_start`, and `min_gap` below the teacher's; else one line and stop).

Then every arm from that warm start, the same number of student steps, paired over seeds (a seed draws the record
order and the samples), each at its own learning rate: chosen on seed 0 by validation exact match (then CE) from a
grid that is extended while the best sits on its edge. Scored on the test split: greedy exact match on its first
N prompts, test CE of its records, and the teacher-scored reverse KL and entropy of the student's own samples
(`bench.heal_onpolicy.sample_scores`). The decision rule (`decision_rule`) is stated before anything trains.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

from kava_ray.bench.heal import _safe
from kava_ray.bench.heal_onpolicy import CountingSource, _entropy, sample_scores
from kava_ray.bench.inprocess import run_key, train_in_process
from kava_ray.bench.stats import fmt_interval, mean_sd, paired
from kava_ray.bench.task_finetune import finetune, records_job
from kava_ray.bench.task_records import CHECKERS, exact_match, file_rows, synthetic_rows, write_records
from kava_ray.bench.task_trl import TRL_BETA, TRL_LMBDA, run_trl_gkd
from kava_ray.common.config import derive, load_config
from kava_ray.common.errors import KavaError
from kava_ray.common.files import default_cache_dir, format_table, write_json
from kava_ray.core.metric_names import SAMPLED_TOKENS
from kava_ray.core.models import load_model, load_student, load_tokenizer
from kava_ray.core.plans import in_process_plans
from kava_ray.data.batching import ROUTE
from kava_ray.data.splits import load_splits, load_test_split
from kava_ray.recipes.evaluate import heldout_ce
from kava_ray.runtime.console import status

BASE = "sft"
JSD = {"onpolicy.fraction": 0.5, "loss.logit_divergence": "jsd", "loss.jsd_beta": TRL_BETA}
# each arm: its overrides of the records job (CE weight 1, logit weight 1, no KV), its teachers ("one": the
# generalist; "two": the specialists) and whether its records name their teacher (MOPD's per-record routing)
ARMS: dict[str, dict] = {
    "sft": {"set": {"loss.logit_weight": 0.0}, "teachers": "one"},
    "sft+logits": {"set": {}, "teachers": "one"},
    "seq_kd": {"set": {"onpolicy.fraction": 0.5, "onpolicy.source": "teacher"}, "teachers": "one"},
    "onpolicy-jsd": {"set": JSD, "teachers": "one"},
    "onpolicy-rkl": {"set": {"onpolicy.fraction": 0.5, "loss.logit_divergence": "reverse_kl_sampled"},
                     "teachers": "one"},
    "onpolicy+kv": {"set": {**JSD, "loss.kv_weight": 1.0, "align.projector.kind": "auto"}, "teachers": "one"},
    "mopd": {"set": JSD, "teachers": "two", "routed": True},
    "fused": {"set": JSD, "teachers": "two"},
    "trl-gkd": {"trl": True, "teachers": "one"},
}
# what fits the default run on the 2-core box (README "A task bench"): the six; the others with --arms
DEFAULT_ARMS = ("sft", "sft+logits", "onpolicy-jsd", "onpolicy-rkl", "mopd", "trl-gkd")
QUICK_ARMS = ("sft", "onpolicy-jsd", "mopd", "trl-gkd")
MIN_START, MIN_GAP = 0.05, 0.20  # the gate: the warm start's exact match >= 5 %, >= 20 points below the teacher's
CE_MARGIN = 0.05  # an arm that helps may not lose more than this much test CE (nats) against the base
ENTROPY_FLOOR = 0.5  # ... nor sample at an entropy below this share of the warm start's (else: "collapsed")

# counts: records per split; n_test: the held-out prompts scored (greedy, first N of the test split); keep: the
# student's layers (of the job's student model); ft_*: a teacher fine-tune (at most ft_max steps, evaluated every
# ft_every on the validation prompts, plateau past ft_min steps: the best of the last ft_patience evaluations within
# ft_delta of the best before); lr_grid: multiples of lr tried on seed 0 (grid_extend: at most this many extensions
# past an edge)
DEFAULTS = {"counts": {"train": 512, "validation": 32, "test": 64}, "n_test": 64, "max_length": 256, "max_new": 128,
            "batch_size": 4, "steps": 12, "seeds": 5, "keep": [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29],
            "lr_teacher": 1e-4, "ft_max": 96, "ft_every": 12, "ft_min": 36, "ft_patience": 1, "ft_delta": 0.02,
            "lr_warm": 3e-4, "warm_steps": 24, "lr": 1e-4, "lr_grid": (0.25, 1.0, 4.0), "grid_extend": 2,
            "temperature": 1.0, "quick": False}
QUICK = {"counts": {"train": 24, "validation": 4, "test": 4}, "n_test": 4, "max_length": 384, "max_new": 12,
         "batch_size": 2, "steps": 2, "seeds": 2, "keep": [0, 2], "lr_teacher": 1e-3, "ft_max": 1, "ft_every": 1,
         "ft_min": 0, "ft_patience": 1, "ft_delta": 0.0, "lr_warm": 1e-3, "warm_steps": 1, "lr": 1e-3,
         "lr_grid": (0.5, 2.0), "grid_extend": 0, "temperature": 1.0, "quick": True}


def decision_rule() -> str:
    return (f"an arm helps when its paired exact-match gain over {BASE} has a 95 % interval excluding 0, AND its "
            f"test CE is not worse than {BASE}'s by more than {CE_MARGIN} nats, AND its samples' entropy stays above "
            f"{ENTROPY_FLOOR:g} x the warm start's; an arm below that entropy floor is 'collapsed', never 'helps'")


def decide(em: Optional[dict], ce: Optional[dict], entropy: Optional[float], floor: float) -> dict:
    """An arm's verdict from its paired differences against the base (`stats.paired` of exact match and test CE)
    and its samples' mean entropy: collapsed | helps | hurts | no measurable gain (`decision_rule`)."""
    if entropy is not None and entropy < floor:
        return {"helps": False, "verdict": "collapsed"}
    gain = bool(em and em["excludes_zero"] and em["mean"] > 0)
    ce_ok = bool(ce) and ce["mean"] <= CE_MARGIN
    if gain and ce_ok:
        return {"helps": True, "verdict": "helps"}
    if em and em["excludes_zero"] and em["mean"] < 0:
        return {"helps": False, "verdict": "hurts"}
    return {"helps": False, "verdict": "gains exact match, loses CE" if gain else "no measurable gain"}


def _params(quick: bool, steps: Optional[int], seeds: Optional[int], arms: Optional[Sequence[str]],
            records: Optional[str], checker: str) -> tuple[dict, list]:
    p = dict(QUICK if quick else DEFAULTS)
    p.update({k: v for k, v in (("steps", steps), ("seeds", seeds)) if v is not None})
    names = list(arms or (QUICK_ARMS if quick else DEFAULT_ARMS))
    bad = [a for a in names if a not in ARMS]
    if bad or BASE not in names or p["steps"] < 1 or p["seeds"] < 2:
        raise KavaError(f"bench task: arms must be among {', '.join(ARMS)} and include {BASE} (got {names}); "
                        f"steps >= 1, seeds >= 2 (paired intervals)")
    if checker not in CHECKERS:
        raise KavaError(f"bench task: --checker {checker!r}: one of {', '.join(CHECKERS)}")
    return p, names


def _rows(records: Optional[str], checker: str, p: dict, names: list, arms_given: bool) -> tuple[dict, list, list]:
    """The records' rows (module docstring), read and checked before anything is written, and the arms they allow
    (the two-teacher arms need a teacher column): (rows, arms, arms dropped)."""
    rows = synthetic_rows(p["counts"]) if records is None else file_rows(records, checker, p["counts"])
    two = [a for a in names if ARMS[a]["teachers"] == "two"]
    if two and not any(ROUTE in r for r in rows["train"]):
        if arms_given:
            raise KavaError(f"bench task: {', '.join(two)} need(s) records with a \"{ROUTE}\" column naming one of two "
                            f"teachers; {records} has none")
        return rows, [a for a in names if a not in two], two
    return rows, names, []


def _models(base, quick: bool, root: Path) -> tuple[str, str, object]:
    """(teacher model, student model, tokenizer): the job's first teacher's and its student's models, or with
    `quick` two tiny random llamas (kava_ray.testing.tiny) of the shared byte tokenizer."""
    if quick:
        from kava_ray.testing.tiny import build_tiny_model

        t = build_tiny_model(root / "tiny_teacher", family="llama", num_layers=3, hidden_size=64, seed=1)
        s = build_tiny_model(root / "tiny_student", family="llama", num_layers=3, hidden_size=64, seed=2)
        return str(t), str(s), load_tokenizer(str(t))
    return base.teachers[0].model, base.student.model, load_tokenizer(base.teachers[0].model)


def run_task_bench(config: str = "demo_cpu", overrides: Optional[list[str]] = None, records: Optional[str] = None,
                   checker: str = "number", arms: Optional[Sequence[str]] = None, steps: Optional[int] = None,
                   seeds: Optional[int] = None, quick: bool = False, out: Optional[str] = None,
                   cache: Optional[str] = None, min_start: float = MIN_START, min_gap: float = MIN_GAP,
                   progress: bool = True) -> dict:
    """The whole bench (module docstring); returns its JSON-able result (also OUT/bench_task.json)."""
    p, names = _params(quick, steps, seeds, arms, records, checker)
    base = load_config(config, overrides)
    rows, names, dropped = _rows(records, checker, p, names, arms is not None)
    root = Path(out or Path(base.ray.storage_path) / f"bench-task-{datetime.now():%Y%m%d-%H%M%S}")
    root = root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cache).expanduser().resolve() if cache else (root / "cache" if quick else
                                                                  default_cache_dir() / "bench-task")
    t_start = time.time()

    def say(msg: str) -> None:
        if progress:
            status(f"[bench task] {msg}")

    say(f"decision rule, fixed before the run: {decision_rule()}")
    say(f"gate, fixed before the run: the warm start's exact match >= {100 * min_start:g} % and >= "
        f"{100 * min_gap:g} points below the teacher's")
    rec = write_records(rows, root / "records", checker)
    say(f"records: {rec.counts['train']} train, {rec.counts['validation']} validation, {rec.counts['test']} test "
        f"({'synthetic GSM8K' if records is None else records}; checker {checker})"
        + (f"; {', '.join(dropped)} dropped (no \"{ROUTE}\" column to route by)" if dropped else ""))
    t_model, s_model, tok = _models(base, quick, root)
    val, test = rec.rows("validation"), rec.rows("test")[:p["n_test"]]
    ft = {}  # the fine-tunes: the generalist teacher, the specialists, the warm start

    def tune(name, records_dir, rows, model, keep, steps_, lr, plateau):
        ft[name] = finetune(base, name, records_dir, f"{rec.fingerprint}/{records_dir.name}", model, keep, rows,
                            checker, p, steps_, lr, cache_dir, root, tok, say, plateau)
        return ft[name]

    tune("teacher", rec.plain, val, t_model, None, p["ft_max"], p["lr_teacher"], True)
    if any(ARMS[a]["teachers"] == "two" for a in names):
        for spec in rec.specialists:
            tune(spec, rec.halves[spec], rec.rows("validation", rec.halves[spec]), t_model, None, p["ft_max"],
                 p["lr_teacher"], True)
    tune("warm", rec.plain, val, s_model, p["keep"], p["warm_steps"], p["lr_warm"], False)
    teacher = load_model(ft["teacher"]["path"], dtype="float32")
    job0 = records_job(base, rec.plain, [("teacher", ft["teacher"]["path"])], ft["warm"]["path"], None, p, root)
    test_split = load_test_split(job0, tok)
    val_split = load_splits(job0, tok)[1]

    def evaluate(student) -> dict:
        em = exact_match(student, tok, test, checker, p["max_new"])
        sc = sample_scores(student, teacher, test_split, tok, p["max_new"], p["n_test"])
        return {"em": em["em"], "test_ce": heldout_ce(student, test_split), "rkl": sc["rkl"],
                "teacher_nll": sc["teacher_nll"], "entropy": _entropy(sc), "tokens": sc["tokens"],
                "samples": em["samples"]}

    t_em = exact_match(teacher, tok, test, checker, p["max_new"])
    start = evaluate(load_student(ft["warm"]["path"], dtype="float32"))
    gate = {"teacher_em": t_em["em"], "start_em": start["em"], "min_start": min_start, "min_gap": min_gap,
            "n": len(test)}
    gate["passes"] = start["em"] >= min_start and t_em["em"] - start["em"] >= min_gap
    say(f"gate: teacher {100 * t_em['em']:.1f} %, warm start {100 * start['em']:.1f} % exact match on {len(test)} "
        f"test prompts: {'passes' if gate['passes'] else 'FAILS'}")
    write_json(root / "gate.json", {"gate": gate, "finetunes": ft, "start": start})
    if not gate["passes"]:
        raise KavaError(f"bench task: gate fails: the warm start's exact match {100 * start['em']:.1f} % (needs >= "
                        f"{100 * min_start:g} %) against the teacher's {100 * t_em['em']:.1f} % (needs >= "
                        f"{100 * min_gap:g} points above it) on {len(test)} test prompts; nothing run "
                        f"({root / 'gate.json'})")
    models = {"teacher": teacher}
    for spec in rec.specialists if any(ARMS[a]["teachers"] == "two" for a in names) else ():
        models[spec] = load_model(ft[spec]["path"], dtype="float32")
    ctx = {"base": base, "rec": rec, "p": p, "root": root, "tok": tok, "warm": ft["warm"]["path"],
           "models": models, "paths": {n: ft[n]["path"] for n in models}, "evaluate": evaluate, "val": val,
           "val_split": val_split, "say": say,
           "checker": checker, "done": root / "runs_done"}
    runs, lrs = {}, {}
    for arm in names:
        runs[arm], lrs[arm] = _arm(ctx, arm)
    floor = ENTROPY_FLOOR * start["entropy"]
    summary = summarize(runs, floor)
    result = {"config": str(config), "out": str(root), "quick": quick, "params": {k: v for k, v in p.items()},
              "records": records or "synthetic", "checker": checker, "dropped": dropped, "counts": rec.counts,
              "arms": names,
              "base": BASE, "decision_rule": decision_rule(), "entropy_floor": floor, "gate": gate,
              "teacher_model": t_model, "student_model": s_model, "finetunes": ft, "teacher_em": t_em,
              "start": start, "lr": lrs, "runs": runs, "summary": summary, "vs_trl": _vs(runs, "onpolicy-jsd",
                                                                                        "trl-gkd"),
              "mopd": {o: _vs(runs, "mopd", o) for o in ("fused", "onpolicy-jsd")},
              "wall_s": time.time() - t_start}
    write_json(root / "bench_task.json", result)
    return result


def _arm(ctx: dict, arm: str) -> tuple[list, dict]:
    """An arm's learning rate (seed 0, by validation exact match then validation CE, over a grid extended past
    an edge at most p["grid_extend"] times) and its runs on every seed at that rate."""
    p = ctx["p"]
    mults = sorted(p["lr_grid"])
    grid: dict = {}
    for _ in range(p["grid_extend"] + 1):
        for m in mults:
            if m not in grid:
                grid[m] = _run(ctx, arm, 0, p["lr"] * m, with_val=True)
        best = max(grid, key=lambda m: (grid[m]["val"]["em"], -grid[m]["val"]["ce"]))
        ms = sorted(grid)
        step = ms[1] / ms[0] if len(ms) > 1 else 4.0
        if best == ms[0] and len(ms) > 1:
            mults = [ms[0] / step]
        elif best == ms[-1] and len(ms) > 1:
            mults = [ms[-1] * step]
        else:
            break
    ms = sorted(grid)
    lr = p["lr"] * best
    info = {"lr": lr, "grid": {f"{p['lr'] * m:.3g}": grid[m]["val"] for m in ms},
            "on_edge": best in (ms[0], ms[-1]) and len(ms) > 1}
    return [grid[best]] + [_run(ctx, arm, s, lr) for s in range(1, p["seeds"])], info


def _run(ctx: dict, arm: str, seed: int, lr: float, with_val: bool = False) -> dict:
    """One run of `arm` from the warm start (kept under OUT/runs_done and read back by a re-run)."""
    p, a, rec = ctx["p"], ARMS[arm], ctx["rec"]
    two = a["teachers"] == "two"
    teachers = list(rec.specialists) if two else ["teacher"]
    key = run_key({"arm": arm, "seed": seed, "lr": lr, "val": with_val, "warm": ctx["warm"], "p": {
        k: v for k, v in p.items() if k not in ("ft_max", "ft_every", "seeds")}, "records": rec.fingerprint})
    path = ctx["done"] / _safe(arm) / f"seed{seed}-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    models = {n: ctx["models"][n] for n in teachers}
    samples = p["steps"] * p["batch_size"]
    t0 = time.time()
    if a.get("trl"):
        r = run_trl_gkd(load_student(ctx["warm"], dtype="float32"), models["teacher"], ctx["tok"],
                        rec.rows("train"), seed, p["steps"], p["batch_size"], lr, p)
        student, train_s, step_s = r["student"], r["train_s"], r["step_s"]
        work = {"teacher_rows_per_sample": r["teacher_rows_per_sample"], "generated_per_sample":
                r["generated_per_sample"], "loss": r["loss"]}
    else:
        records_dir = rec.routed if a.get("routed") else rec.plain
        cfg = records_job(ctx["base"], records_dir, [(n, ctx["paths"][n]) for n in teachers], ctx["warm"], None, p,
                          ctx["root"])
        cfg = derive(cfg, {**a["set"], "train.seed": seed, "train.data_seed": seed, "train.steps": p["steps"],
                           "optim.lr_student": lr})
        source = CountingSource(models)
        t1 = time.time()
        run = train_in_process(cfg, in_process_plans(cfg, models), source, p["steps"])
        student, train_s, step_s = run["recipe"].distiller.student, time.time() - t1, run["wall_step_s"]
        work = {"teacher_rows_per_sample": source.rows / samples,
                "teacher_written_per_sample": source.written / samples,
                "generated_per_sample": (run["sums"].get(SAMPLED_TOKENS, 0.0)) / samples}
    out = {"seed": seed, "lr": lr, "figures": ctx["evaluate"](student), "s_per_step": step_s,
           "train_s": train_s, "wall_s": None, **work}
    if with_val:
        out["val"] = {"em": exact_match(student, ctx["tok"], ctx["val"], ctx["checker"], p["max_new"])["em"],
                      "ce": heldout_ce(student, ctx["val_split"])}
    out["wall_s"] = time.time() - t0
    write_json(path, out)
    f = out["figures"]
    ctx["say"](f"{arm} seed {seed} lr {lr:.2g}: exact match {100 * f['em']:.1f} %, test CE {f['test_ce']:.4f}, "
               f"reverse KL {f['rkl']:.3f}, entropy {f['entropy']:.3f}, {out['s_per_step']:.1f} s/step "
               f"({out['wall_s']:.0f} s)")
    return out


def summarize(runs: dict, floor: float) -> dict:
    """Per arm: mean ± sd of each figure over seeds, its work (teacher forwards, teacher-written completions and
    student-sampled tokens per training sample, s/step: the median step with its sampling and teachers, wall);
    per non-base arm: paired differences against the base and the decision (`decide`)."""
    out = {}
    keys = ("em", "test_ce", "rkl", "entropy")
    base = [r["figures"] for r in runs.get(BASE, [])]
    for arm, rs in runs.items():
        figs = [r["figures"] for r in rs]
        s = {"mean": {k: mean_sd([f[k] for f in figs]) for k in keys},
             "s_per_step": mean_sd([r["s_per_step"] for r in rs]), "wall_s": sum(r["wall_s"] for r in rs),
             "teacher_rows_per_sample": mean_sd([r["teacher_rows_per_sample"] for r in rs]),
             "generated_per_sample": mean_sd([r["generated_per_sample"] for r in rs]),
             "teacher_written_per_sample": mean_sd([r.get("teacher_written_per_sample", 0.0) for r in rs])}
        if arm != BASE and base:
            s["vs_base"] = {k: paired([f[k] for f in figs], [f[k] for f in base]) for k in keys}
            s["decision"] = decide(s["vs_base"]["em"], s["vs_base"]["test_ce"], s["mean"]["entropy"]["mean"], floor)
        elif arm == BASE:
            s["decision"] = {"helps": False, "verdict": "collapsed" if s["mean"]["entropy"]["mean"] < floor
                             else "(base)"}
        out[arm] = s
    return out


def _vs(runs: dict, arm: str, other: str) -> Optional[dict]:
    """`arm` against `other`, paired over seeds: the exact-match difference (arm - other) and the ratio of their
    mean s/step (arm / other); None unless both ran."""
    if arm not in runs or other not in runs:
        return None
    a, b = runs[arm], runs[other]
    return {"em": paired([r["figures"]["em"] for r in a], [r["figures"]["em"] for r in b]),
            "test_ce": paired([r["figures"]["test_ce"] for r in a], [r["figures"]["test_ce"] for r in b]),
            "step_ratio": mean_sd([r["s_per_step"] for r in a])["mean"] / mean_sd([r["s_per_step"] for r in b])["mean"]}


def _pct(ms: Optional[dict]) -> str:
    return "—" if ms is None else f"{100 * ms['mean']:.1f} ± {100 * ms['sd']:.1f}"


def _curve(c: list) -> str:
    return " ".join(f"{s}:{100 * e['em']:.0f}%" for s, e in c)


def format_task(r: dict) -> str:
    p, g, st = r["params"], r["gate"], r["start"]
    ft = r["finetunes"]
    spec_lines = [f"specialist {n} (its half of the records): {ft[n]['steps']} steps, validation exact match "
                  f"curve {_curve(ft[n]['curve'])}" for n in ft if n not in ("teacher", "warm")]
    rows = [[f"teacher ({r['teacher_model']}, fine-tuned)", f"{100 * r['teacher_em']['em']:.1f}", "—", "—", "—",
             "—", "—", "—", "—"],
            ["warm start (every arm begins here)", f"{100 * st['em']:.1f}", f"{st['test_ce']:.4f}", f"{st['rkl']:.3f}",
             f"{st['entropy']:.3f}", "—", "—", "—", "—"]]
    for arm, s in r["summary"].items():
        m = s["mean"]
        rows.append([arm, _pct(m["em"]), *(f"{m[k]['mean']:.4f} ± {m[k]['sd']:.4f}" for k in ("test_ce",)),
                     *(f"{m[k]['mean']:.3f}" for k in ("rkl", "entropy")),
                     f"{s['teacher_rows_per_sample']['mean']:.2f} + {s['teacher_written_per_sample']['mean']:.2f}",
                     f"{s['generated_per_sample']['mean']:.1f}",
                     f"{s['s_per_step']['mean']:.2f}", f"{s['wall_s'] / 60:.1f}"])
    d_rows = [[arm, fmt_interval(s["vs_base"]["em"], 1, 100.0), fmt_interval(s["vs_base"]["test_ce"], 4),
               fmt_interval(s["vs_base"]["rkl"], 3), fmt_interval(s["vs_base"]["entropy"], 3),
               s["decision"]["verdict"]] for arm, s in r["summary"].items() if "vs_base" in s]
    lr_rows = [[arm, f"{v['lr']:.3g}", " ".join(f"{x}:{100 * c['em']:.0f}%/{c['ce']:.3f}" for x, c in v["grid"].items())
                + (" (best on an edge after the extensions)" if v["on_edge"] else "")] for arm, v in r["lr"].items()]
    vs, mo = r.get("vs_trl"), r.get("mopd") or {}
    extra = []
    if vs:
        extra.append(f"kava-ray onpolicy-jsd against TRL trl-gkd (GKDTrainer, λ {TRL_LMBDA}, β {TRL_BETA}): exact "
                     f"match {fmt_interval(vs['em'], 1, 100.0)} points, test CE {fmt_interval(vs['test_ce'], 4)}, "
                     f"s/step ratio {vs['step_ratio']:.2f} (onpolicy-jsd / trl-gkd, this run)")
    for other, v in mo.items():
        if v:
            extra.append(f"mopd - {other}: exact match {fmt_interval(v['em'], 1, 100.0)} points, test CE "
                         f"{fmt_interval(v['test_ce'], 4)}")
    return "\n".join([
        f"task bench ({r['config']}): {r['records']} records ({r['counts']['train']} train; checker {r['checker']}); "
        f"greedy exact match on the first {g['n']} test prompts (at most {p['max_new']} new tokens); {p['steps']} "
        f"student steps x batch {p['batch_size']} per arm, seeds {list(range(p['seeds']))}",
        f"teacher: {r['teacher_model']} fine-tuned {ft['teacher']['steps']} steps at lr {p['lr_teacher']:g}, "
        f"validation exact match curve {_curve(ft['teacher']['curve'])}"
        + (" (plateaued)" if ft["teacher"].get("plateaued") else " (stopped at its step limit)"),
        *spec_lines,
        f"warm start: {r['student_model']} layers {p['keep']}, {ft['warm']['steps']} SFT steps at lr "
        f"{p['lr_warm']:g}",
        f"gate (fixed before the run): warm start {100 * g['start_em']:.1f} % >= {100 * g['min_start']:g} % and "
        f"teacher {100 * g['teacher_em']:.1f} % >= {100 * g['min_gap']:g} points above it: "
        + ("passes" if g["passes"] else "FAILS"),
        "learning rate per arm (seed 0, by validation exact match, then validation CE; grid lr:EM/CE):",
        format_table(["arm", "lr", "grid"], lr_rows),
        "",
        format_table(["arm", "exact match %", "test CE", "reverse KL of own samples", "samples' entropy",
                      "teacher fwd + writes / sample", "student-sampled tokens / sample", "s/step", "wall min"], rows),
        "",
        f"paired differences against {BASE} (arm - {BASE}, mean [95 % t-interval], * = excludes 0):",
        format_table(["arm", "Δ exact match (points)", "Δ test CE", "Δ reverse KL", "Δ entropy", "decision"], d_rows),
        f"decision rule (fixed before the run): {r['decision_rule']} (floor here {r['entropy_floor']:.3f} nats/token)",
        *extra,
        f"wall {r['wall_s'] / 60:.1f} min; out {r['out']}"])
