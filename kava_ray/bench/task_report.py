"""`bench task`'s decision rule, its summary over seeds and its table (`bench.task` runs the arms).

The rule is fixed before the run: an arm helps when its paired exact-match gain over the base
(`sft`) has a 95 % interval excluding 0, its test CE is at most `CE_MARGIN` nats worse, and its
samples' entropy stays above `ENTROPY_FLOOR` x the warm start's; an arm below that floor is
"collapsed", never "helps".
"""

from __future__ import annotations

from typing import Optional, Sequence

from kava_ray.bench.stats import fmt_interval, guarded_verdict, mean_sd, paired, paired_bootstrap
from kava_ray.bench.task_trl import TRL_BETA, TRL_LMBDA
from kava_ray.common.files import format_table

BASE = "sft"
QUICK_NOTE = "skipped (--quick: tiny random models, a check of the harness, not a result)"
CE_MARGIN = 0.05  # an arm that helps may not lose more than this much test CE (nats) against the base
ENTROPY_FLOOR = 0.5  # ... nor sample at an entropy below this share of the warm start's (else: "collapsed")
SAME_EM, SAME_CE = 0.05, 0.03  # two arms doing the same work match within these (exact match share, nats)


def decision_rule() -> str:
    return (f"an arm helps when its paired exact-match gain over {BASE} has a 95 % interval excluding 0, AND its "
            f"test CE is not worse than {BASE}'s by more than {CE_MARGIN} nats (the paired interval's upper end), "
            f"AND its samples' entropy stays above "
            f"{ENTROPY_FLOOR:g} x the warm start's; an arm below that entropy floor is 'collapsed', never 'helps'")


def decide(em: Optional[dict], ce: Optional[dict], entropy: Optional[float], floor: float) -> dict:
    """An arm's verdict from its paired differences against the base (`stats.paired` of exact match
    and test CE) and its samples' mean entropy (`decision_rule`): `stats.guarded_verdict`, the rule
    `bench heal --onpolicy` keeps too (collapsed | helps | worse test CE | hurts | no measurable
    gain)."""
    verdict = guarded_verdict(em, ce, entropy, CE_MARGIN, floor)
    return {"helps": verdict == "helps", "verdict": verdict}


def summarize(runs: dict, floor: float, quick: bool = False, own_samples: Sequence[str] = ()) -> dict:
    """Per arm: mean ± sd of each figure over seeds, its work (teacher forwards, teacher-written
    completions and student-sampled tokens per training sample, s/step: the median step with its
    sampling and teachers, wall); per non-base arm: paired differences against the base and the
    decision (`decide`). An arm of `own_samples` that sampled no token trained on nothing of its
    own: its verdict says so; `quick`: every verdict says the run checks the harness."""
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
        if arm in own_samples and s["generated_per_sample"]["mean"] == 0:
            s["decision"] = {"helps": False, "verdict": "sampled nothing (its on-policy steps had no tokens)"}
        if quick:
            s["decision"] = {"helps": False, "verdict": "— (--quick)"}
        out[arm] = s
    return out


def pair(runs: dict, arm: str, other: str, quick: bool = False) -> Optional[dict]:
    """`arm` against `other`, paired over seeds: the exact-match difference (arm - other) over seeds
    (t) and over seeds x prompts (`em_sp`: the paired bootstrap, when every run kept its per-prompt
    scores), the test-CE difference, the ratio of their mean s/step (arm / other) and `parity`
    (`same_work`; "— (--quick)" on the quick run's tiny random models, which answer nothing: no
    verdict from a harness check); None unless both ran."""
    if arm not in runs or other not in runs:
        return None
    a, b = runs[arm], runs[other]
    oks = [r["figures"].get("ok") for r in a + b]
    em_sp = paired_bootstrap([r["figures"]["ok"] for r in a], [r["figures"]["ok"] for r in b]) \
        if all(oks) and len(a) == len(b) and len(a) > 1 else None
    out = {"em": paired([r["figures"]["em"] for r in a], [r["figures"]["em"] for r in b]), "em_sp": em_sp,
           "test_ce": paired([r["figures"]["test_ce"] for r in a], [r["figures"]["test_ce"] for r in b]),
           "step_ratio": mean_sd([r["s_per_step"] for r in a])["mean"] / mean_sd([r["s_per_step"] for r in b])["mean"]}
    out["parity"] = "— (--quick)" if quick else same_work(em_sp, out["test_ce"])
    return out


def same_work(em: Optional[dict], ce: Optional[dict]) -> str:
    """The verdict on two arms meant to do the same work (kava-ray's GKD against TRL's), fixed
    before the run: "same" when the exact-match interval (seeds x prompts) lies inside +-SAME_EM and
    the test-CE interval inside +-SAME_CE nats; else "differs" when either interval excludes 0; else
    "undecided at this size"."""
    if not em or not ce or ce["lo"] is None:
        return "undecided at this size"
    if -SAME_EM <= em["lo"] and em["hi"] <= SAME_EM and -SAME_CE <= ce["lo"] and ce["hi"] <= SAME_CE:
        return "same"
    return "differs" if em["excludes_zero"] or ce["excludes_zero"] else "undecided at this size"


def _pct(ms: Optional[dict]) -> str:
    return "—" if ms is None else f"{100 * ms['mean']:.1f} ± {100 * ms['sd']:.1f}"


def _curve(c: list) -> str:
    return " ".join(f"{s}:{100 * e['em']:.0f}%" for s, e in c)


def _pair_lines(r: dict) -> list[str]:
    """The pairs beyond the base: kava-ray's onpolicy-gkd against TRL's trl-gkd, and mopd against the others."""
    vs, mo = r.get("vs_trl"), r.get("mopd") or {}
    extra = []
    if vs:
        extra.append(f"kava-ray onpolicy-gkd against TRL trl-gkd (GKDTrainer, λ {TRL_LMBDA}, β {TRL_BETA}): exact "
                     f"match {fmt_interval(vs['em'], 1, 100.0)} points over seeds, "
                     f"{fmt_interval(vs.get('em_sp'), 1, 100.0)} over seeds x prompts, test CE "
                     f"{fmt_interval(vs['test_ce'], 4)}, s/step ratio {vs['step_ratio']:.2f} (onpolicy-gkd / "
                     f"trl-gkd, this run): {vs.get('parity', '—')} (same: both intervals inside +-{100 * SAME_EM:.0f} "
                     f"points and +-{SAME_CE} nats)")
    for other, v in mo.items():
        if v:
            extra.append(f"mopd - {other}: exact match {fmt_interval(v['em'], 1, 100.0)} points, test CE "
                         f"{fmt_interval(v['test_ce'], 4)}")
    return extra


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
    extra = _pair_lines(r)
    return "\n".join([
        f"task bench ({r['config']}): {r['records']} records ({r['counts']['train']} train; checker {r['checker']}); "
        f"greedy exact match on the first {g['n']} test prompts (at most {p['max_new']} new tokens); {p['steps']} "
        f"student steps x batch {p['batch_size']} per arm, test seeds {list(range(1, p['seeds'] + 1))} "
        f"(seed 0 chose each rate)",
        f"teacher: {r['teacher_model']} fine-tuned {ft['teacher']['steps']} steps at lr {p['lr_teacher']:g}, "
        f"validation exact match curve {_curve(ft['teacher']['curve'])}"
        + (" (plateaued)" if ft["teacher"].get("plateaued") else " (stopped at its step limit)"),
        *spec_lines,
        f"warm start: {ft['warm'].get('from', r['student_model'])} layers {p['keep']}, {ft['warm']['steps']} SFT "
        f"steps at lr {p['lr_warm']:g} (until validation exact match >= {100 * p.get('warm_reach', 0):g} %), curve "
        f"{_curve(ft['warm']['curve'])}",
        f"gate (fixed before the run): warm start {100 * g['start_em']:.1f} % >= {100 * g['min_start']:g} % and "
        f"teacher {100 * g['teacher_em']:.1f} % >= {100 * g['min_gap']:g} points above it: "
        + (QUICK_NOTE if g.get("skipped") else "passes" if g["passes"] else "FAILS"),
        "learning rate per arm (seed 0, by validation exact match, then validation CE; grid lr:EM/CE):",
        format_table(["arm", "lr", "grid"], lr_rows),
        "",
        format_table(["arm", "exact match %", "test CE", "reverse KL of own samples", "samples' entropy",
                      "teacher fwd + writes / sample", "student-sampled tokens / sample", "s/step", "wall min"], rows),
        "",
        f"paired differences against {BASE} (arm - {BASE}, mean [95 % t-interval], * = excludes 0):",
        format_table(["arm", "Δ exact match (points)", "Δ test CE", "Δ reverse KL", "Δ entropy", "decision"],
                     d_rows),
        f"decision rule (fixed before the run): {r['decision_rule']} (floor here {r['entropy_floor']:.3f} nats/token)",
        *extra,
        f"wall {r['wall_s'] / 60:.1f} min; out {r['out']}"])
