"""`kava-ray bench heal`: does it distil? A pruned student healed on natural text, with a positive control,
paired seeds and a decision rule fixed before the run.

The teacher's outputs cached once, a gate (the teacher must beat the pruned student), a shared CE warm start,
then every arm (`ARMS`) per seed, scored on the test split with paired intervals against the base arm.
The method step by step: docs/internals/runtime.md#bench-heal.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional, Sequence

from kava_ray.bench.inprocess import train_in_process
from kava_ray.bench.recipes import Scorer, plot_curves
from kava_ray.bench.stats import fmt_interval, mean_sd, paired
from kava_ray.common.config import JobConfig, derive, load_config, parse_override
from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_write, format_table, write_json
from kava_ray.core.models import load_model, load_student, load_tokenizer
from kava_ray.core.plans import load_splits, load_test_split
from kava_ray.data.corpus import write_pydoc_corpus
from kava_ray.recipes.evaluate import heldout_ce
from kava_ray.runtime.console import status
from kava_ray.runtime.job import job_session, precompute
from kava_ray.runtime.preflight import check_model_files

# arm: (loss.ce_weight, loss.kv_weight, loss.logit_weight)
ARMS: dict[str, tuple[float, float, float]] = {
    "ce": (1.0, 0.0, 0.0), "ce+logits": (1.0, 0.0, 1.0), "ce+kv": (1.0, 1.0, 0.0), "ce+kv+logits": (1.0, 1.0, 1.0),
    "logits": (0.0, 0.0, 1.0)}
BASE, CONTROL = "ce", "ce+logits"
MIN_NATS, MIN_GR = 0.05, 0.05  # an arm helps: its CE interval excludes 0 and it gains >= 0.05 nats or 5 GR points


def decision_rule(base: str = BASE) -> str:
    return (f"an arm helps when its paired test-CE difference against {base} has a 95 % interval that excludes 0 "
            f"and its mean gain is at least {MIN_NATS} nats or {100 * MIN_GR:.0f} points of gap recovered (GR)")


TOP_K = 64
DEFAULTS = {"steps": 40, "seeds": 3, "warm_steps": 10, "eval_every": 10, "block": 128, "batch_size": 8,
            "eval_blocks": 24, "topics": None}
# --quick (the test): a few topics per split (train, validation, test), so the teacher runs over hundreds of
# blocks, not the whole corpus
QUICK = {"steps": 3, "seeds": 2, "warm_steps": 2, "eval_every": 3, "block": 32, "batch_size": 4, "eval_blocks": 4,
         "topics": (4, 1, 4)}


def heal_job(base: JobConfig, corpus: Path, root: Path, block: int, batch_size: int,
             topics: Optional[tuple] = None) -> JobConfig:
    """The bench's job: the base job's first teacher and its student, the corpus packed into `block`-token rows,
    top-k logits cached, a constant learning rate after a short warm-up. topics: (train, validation, test)
    records kept per split (None: all)."""
    n_train, n_val, n_test = topics or (None, None, None)
    return derive(base, {
        "teachers": base.teachers[:1], "fusion.weights": None,
        "data.source": f"{corpus}/{{split}}.jsonl", "data.format": "text", "data.val_split": "validation",
        "data.num_train": n_train, "data.num_val": n_val, "data.num_test": n_test, "data.packing": True,
        "data.kv_cache_dir": str(root / "kv_cache"), "train.max_length": block, "train.batch_size": batch_size,
        "loss.logit_top_k": TOP_K, "loss.logit_tail": "bucket", "optim.schedule": "constant",
        "optim.warmup_steps": 2, "ray.storage_path": str(root / "runs")})


def arm_config(job: JobConfig, arm: str, seed: int, student: str, steps: int) -> JobConfig:
    ce_w, kv_w, logit_w = ARMS[arm]
    return derive(job, {"loss.ce_weight": ce_w, "loss.kv_weight": kv_w, "loss.logit_weight": logit_w,
                        "train.seed": seed, "train.data_seed": seed, "train.steps": steps,
                        "student.model": student, "student.keep_layers": None, "data.kv_source": "cache"})


def gap_recovered(ce_start: float, ce: float, ce_teacher: float) -> float:
    return (ce_start - ce) / (ce_start - ce_teacher)


def run_heal_bench(config: str = "demo_cpu", overrides: Optional[list[str]] = None, steps: Optional[int] = None,
                   seeds: Optional[int] = None, arms: Optional[Sequence[str]] = None, quick: bool = False,
                   out: Optional[str] = None, min_gap: float = 1.0, arm_overrides: Optional[dict] = None,
                   address: Optional[str] = None, progress: bool = True, base_arm: str = BASE) -> dict:
    """The whole bench (see the module docstring); returns its JSON-able result. base_arm: the arm every other
    is paired against (`ce`, or a recipe such as `ce` at a tuned learning rate)."""
    p, names = _bench_params(quick, steps, seeds, arms, arm_overrides, base_arm)
    base = _base_job(config, overrides, arm_overrides)
    root = Path(out or Path(base.ray.storage_path) / f"bench-heal-{datetime.now():%Y%m%d-%H%M%S}").expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    say = _reporter(progress)
    rule = decision_rule(base_arm)
    say(f"decision rule, fixed before the run: {rule}")
    corpus = Path(write_pydoc_corpus(root / "corpus")["train"]["path"]).parent
    job = heal_job(base, corpus, root, p["block"], p["batch_size"], p["topics"])
    tok = load_tokenizer(job.student.model)
    gate = _gate(job, tok, min_gap, say)  # 1. before anything starts
    cache = _cache_teacher(job, root, address, progress, say)  # 2. the teacher's outputs, every block once
    scorer = Scorer(derive(job, {"data.kv_source": "cache"}), 0, 0)
    warm_dir = root / "warm_start"  # 3. the shared warm start, and the job a Tune sweep continues from
    ce_start = _warm_start(scorer, tok, warm_dir, p["warm_steps"], say)
    _write_tune_job(job, warm_dir, p["steps"], root / "heal_job.yaml")
    runs = _run_arms(job, names, p, arm_overrides, scorer, tok, warm_dir, (ce_start, gate["teacher_ce"]), say)  # 4.
    summary = summarize(runs, base_arm)  # 5. figures, paired differences, decisions
    passes = _control_passes(summary, base_arm)
    plots = _plot(runs, summary, root, gate["teacher_ce"], base_arm)
    result = {"config": str(config), "out": str(root), "quick": quick, **p, "arms": names, "base": base_arm,
              "decision_rule": rule, "gate": gate, "ce_start": ce_start, "teacher": job.teachers[0].name,
              "teacher_ce": gate["teacher_ce"], "test_tokens": int(scorer.test.lengths.sum()),
              "train_blocks": len(scorer.train_split), **cache, "control_passes": passes, "summary": summary,
              "runs": runs, "plots": plots, "arm_overrides": arm_overrides or {}, "job": str(root / "heal_job.yaml"),
              "wall_s": time.time() - t_start}
    write_json(root / "bench_heal.json", result)
    return result


def _bench_params(quick: bool, steps: Optional[int], seeds: Optional[int], arms: Optional[Sequence[str]],
                  arm_overrides: Optional[dict], base_arm: str) -> tuple[dict, list[str]]:
    """The run's sizes (QUICK or DEFAULTS, then `steps` and `seeds`) and its arms (`arms`, then the recipes),
    checked before anything loads."""
    p = dict(QUICK if quick else DEFAULTS)
    p.update({k: v for k, v in (("steps", steps), ("seeds", seeds)) if v is not None})
    names = list(arms or ARMS)
    names += [a for a in (arm_overrides or {}) if a not in names]
    unknown = [a for a in names if a not in ARMS and a not in (arm_overrides or {})]
    if unknown or base_arm not in names or p["seeds"] < 1 or p["steps"] < 1:
        raise KavaError(f"bench heal: arms must be among {', '.join(ARMS)} or --recipe names and include the base "
                        f"{base_arm} (got {names}); seeds and steps >= 1")
    return p, names


def _base_job(config: str, overrides: Optional[list[str]], arm_overrides: Optional[dict]) -> JobConfig:
    """The base job, checked before any output or model: every recipe applies to it, its model files exist and
    its student is pruned (`student.keep_layers`)."""
    base = load_config(config, overrides)
    for name, recipe in (arm_overrides or {}).items():  # a typo in a recipe: one line now, not after the cache
        try:
            derive(base, recipe)
        except KavaError as e:
            raise KavaError(f"bench heal: --recipe {name}: {e}") from None
    check_model_files(base)
    if not base.student.keep_layers:
        raise KavaError(f"bench heal needs a pruned student: {config} has no student.keep_layers")
    return base


def _reporter(progress: bool) -> Callable[[str], None]:
    """`say`: one progress line on the console (`[bench heal] ...`), or nothing without `progress`."""
    def say(msg):
        if progress:
            status(f"[bench heal] {msg}")
    return say


def _gate(job: JobConfig, tok, min_gap: float, say) -> dict:
    """The gate, before any teacher cache or training: the teacher must beat the pruned student on the test split
    by `min_gap` nats, or there is nothing to distil (a one-line error)."""
    teacher = job.teachers[0]
    test = load_test_split(job, tok)
    t_model = load_model(teacher.model, dtype=teacher.dtype, quantization=teacher.quantization)
    ce_teacher = heldout_ce(t_model, test)
    del t_model
    pruned = load_student(job.student.model, dtype="float32", keep=job.student.keep_layers)
    ce_pruned = heldout_ce(pruned, test)
    gate = {"teacher_ce": ce_teacher, "student_ce": ce_pruned, "gap": ce_pruned - ce_teacher, "min_gap": min_gap}
    say(f"gate: teacher {ce_teacher:.3f} nats, pruned student {ce_pruned:.3f} nats on the test split "
        f"({int(test.lengths.sum())} tokens)")
    if gate["gap"] < min_gap:
        raise KavaError(f"bench heal: the teacher ({ce_teacher:.2f} nats) is not {min_gap:g} nat(s) better than the "
                        f"student ({ce_pruned:.2f} nats) on the test split: nothing to distil")
    return gate


def _cache_teacher(job: JobConfig, root: Path, address: Optional[str], progress: bool, say) -> dict:
    """The teacher's outputs for every block, computed once (a Ray job) into root/kv_cache and read by every arm
    and seed; returns the result's figures of the cache."""
    pre = derive(job, {"data.kv_source": "live", "loss.logit_weight": 1.0})
    t0 = time.time()
    with job_session(pre, address):
        stats = precompute(pre, root / "kv_cache", progress=progress)
    precompute_s = time.time() - t0
    say(f"teacher cache: {stats['written']} blocks in {stats['forwards']} teacher batches ({precompute_s:.0f} s)")
    return {"teacher_forwards": stats["forwards"], "cached_blocks": stats["written"] + stats["skipped"],
            "teacher_forwards_per_sample": stats["written"] / max(stats["total"], 1), "precompute_s": precompute_s}


def _warm_start(scorer: Scorer, tok, warm_dir: Path, warm_steps: int, say) -> float:
    """The shared warm start: `warm_steps` CE steps (seed 0) on the cache, saved to warm_dir where every arm
    begins; returns its test CE, the point the gap recovered is measured from."""
    warm_cfg = derive(scorer.cfg, {"loss.ce_weight": 1.0, "loss.kv_weight": 0.0, "loss.logit_weight": 0.0,
                                   "train.steps": warm_steps, "train.seed": 0, "train.data_seed": 0})
    warm = train_in_process(warm_cfg, scorer.plans, scorer.source, warm_steps)
    warm["recipe"].distiller.student.save_pretrained(warm_dir)
    tok.save_pretrained(warm_dir)
    ce_start = heldout_ce(warm["recipe"].distiller.student, scorer.test)
    say(f"warm start: {warm_steps} CE steps -> {ce_start:.3f} nats ({warm_dir})")
    return ce_start


def _write_tune_job(job: JobConfig, warm_dir: Path, steps: int, path: Path) -> None:
    """The job a Tune sweep (or a user) continues from: the ce+kv arm of seed 0 from the warm start, evaluated
    at the end only."""
    tune_job = derive(arm_config(job, "ce+kv", 0, str(warm_dir), steps),
                      {"train.eval_steps": steps, "train.save_steps": steps})
    atomic_write(path, tune_job.to_yaml().encode())


def _run_arms(job: JobConfig, names: list[str], p: dict, arm_overrides: Optional[dict], scorer: Scorer, tok,
              warm_dir: Path, ends: tuple[float, float], say) -> dict:
    """Every arm for every seed (a seed's arms back to back: paired), each from the warm start with its held-out
    CE curve, scored on the test split; ends: (warm start CE, teacher CE), the span of the gap recovered."""
    val_head = load_splits_head(scorer.cfg, tok, p["eval_blocks"])
    runs: dict = {a: [] for a in names}
    for seed in range(p["seeds"]):
        for arm in names:
            cfg = arm_config(job, arm if arm in ARMS else BASE, seed, str(warm_dir), p["steps"])
            if arm_overrides and arm in arm_overrides:
                cfg = derive(cfg, arm_overrides[arm])
            t1 = time.time()
            run = _train_arm(cfg, scorer, val_head, p["steps"], p["eval_every"])
            score = scorer.model(run["recipe"].distiller.student, tok)
            fig = _figures(score, *ends, job.teachers[0].name)
            runs[arm].append({"seed": seed, "figures": fig, "curve": run["curve"], "step_s": run["step_s"],
                              "wall_s": time.time() - t1, "score": score})
            say(f"{arm} seed {seed}: test CE {fig['test_ce']:.4f}, GR {100 * fig['gr']:.1f} % "
                f"({time.time() - t1:.0f} s)")
    return runs


def _train_arm(cfg: JobConfig, scorer: Scorer, val_head, steps: int, eval_every: int) -> dict:
    """One arm's training in process on the cache, its curve the held-out CE on `val_head` every `eval_every`
    steps (`train_in_process`'s result)."""
    def evaluate(recipe):
        return heldout_ce(recipe.distiller.student, val_head)

    return train_in_process(cfg, scorer.plans, scorer.source, steps, eval_every, evaluate)


def _figures(score: dict, ce_start: float, ce_teacher: float, teacher: str) -> dict:
    """A run's score -> its figures: test CE, gap recovered from the warm start, and KL, top-1 agreement and
    projector-free KV cosine against the teacher (None where not scored)."""
    return {"test_ce": score["ce"], "gr": gap_recovered(ce_start, score["ce"], ce_teacher),
            "kl": score.get(f"kl/{teacher}"), "top1": score.get(f"top1_agree/{teacher}"),
            "kv_cos_free": score.get(f"kv_cos_free/{teacher}")}


def _control_passes(summary: dict, base_arm: str) -> Optional[bool]:
    """Whether the positive control (CONTROL against BASE) helps; None: the control was not run against ce in
    this bench."""
    control = summary.get(CONTROL, {}).get("decision") if base_arm == BASE else None
    return None if control is None else bool(control["helps"])


def _plot(runs: dict, summary: dict, root: Path, ce_teacher: float, base_arm: str) -> dict:
    """Both plots in root: the held-out CE curves per arm (the teacher's CE as a line) and the gap recovered per
    arm; returns {"ce": path, "gr": path}."""
    ce_png, gr_png = root / "heal_ce_curves.png", root / "heal_gap_recovered.png"
    curves = {a: [{"eval_ce": r["curve"]} for r in rs] for a, rs in runs.items()}
    plot_curves(curves, ce_png, log_y=True, teacher_ce=ce_teacher)
    plot_gr(summary, gr_png, base_arm)
    return {"ce": str(ce_png), "gr": str(gr_png)}


def parse_recipe(text: str) -> tuple[str, dict]:
    """`NAME:key=value,key=value` (an arm of its own on top of `ce`, e.g. a Tune sweep's winner) ->
    (NAME, {dotted key: value}); each item is read as an override line (`parse_override`: values are YAML)."""
    name, sep, rest = text.partition(":")
    if not sep or not name or name in ARMS:
        raise KavaError(f"--recipe {text!r}: expected NAME:key=value,... with a new name (not one of {', '.join(ARMS)})")
    out = {}
    for item in filter(None, rest.split(",")):
        if "=" not in item:
            raise KavaError(f"--recipe {text!r}: {item!r} is not key=value")
        try:
            parts, value = parse_override(item)
        except KavaError as e:
            raise KavaError(f"--recipe {text!r}: {e}") from None
        out[".".join(parts)] = value
    return name, out


def load_splits_head(cfg: JobConfig, tok, n: int):
    """The first `n` blocks of the validation split: the curve's held-out CE, cheap enough every few steps."""
    return load_splits(cfg, tok)[1].head(n)


def summarize(runs: dict, base_arm: str = BASE) -> dict:
    """Per arm: mean ± sd of each figure; per non-base arm: paired differences against the base and the
    decision (gains are positive: CE and KL differences are reported as base - arm)."""
    out = {}
    base = runs.get(base_arm, [])
    for arm, rs in runs.items():
        figs = [r["figures"] for r in rs]
        s = {"mean": {k: mean_sd([f.get(k) for f in figs]) for k in figs[0]},
             "step_s": mean_sd([r["step_s"] for r in rs])}
        if arm != base_arm and base:
            ref = [r["figures"] for r in base]
            s["vs_base"] = {k: paired([f.get(k) for f in figs], [f.get(k) for f in ref]) for k in figs[0]}
            d_ce, d_gr = s["vs_base"]["test_ce"], s["vs_base"]["gr"]
            helps = bool(d_ce and d_ce["excludes_zero"] and d_ce["mean"] < 0
                         and (-d_ce["mean"] >= MIN_NATS or d_gr["mean"] >= MIN_GR))
            hurts = bool(d_ce and d_ce["excludes_zero"] and d_ce["mean"] > 0)
            s["decision"] = {"helps": helps, "verdict": "helps" if helps else "hurts" if hurts else "no measurable gain"}
        out[arm] = s
    return out


def plot_gr(summary: dict, path: Path, base_arm: str = BASE) -> None:
    """The gap recovered per arm (mean over seeds) with the 95 % interval of its paired difference to the base."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # matplotlib: heavy, loaded for plots only
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    arms = list(summary)
    means = [100 * summary[a]["mean"]["gr"]["mean"] for a in arms]
    base = means[arms.index(base_arm)] if base_arm in arms else 0.0
    err = []
    for a, m in zip(arms, means):
        d = summary[a].get("vs_base", {}).get("gr")
        err.append(100 * (d["hi"] - d["mean"]) if d and d["lo"] is not None else 0.0)
    ax.bar(arms, means, yerr=err, capsize=4, color=["#999999" if a == base_arm else "#4477aa" for a in arms])
    ax.axhline(base, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel(f"gap recovered, % (error bar: 95 % interval vs {base_arm})")
    ax.set_title("share of the teacher-student gap recovered per arm")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


def format_heal(r: dict) -> str:
    g, base = r["gate"], r.get("base", BASE)
    keys = [("test_ce", "test CE", 4, 1.0), ("gr", "GR %", 1, 100.0), ("kl", "KL(t||s)", 3, 1.0),
            ("top1", "top-1 %", 1, 100.0), ("kv_cos_free", "KV cos (no proj.)", 3, 1.0)]
    rows = [[f"teacher {r['teacher']}", f"{r['teacher_ce']:.4f}", "100.0", "0", "100.0", "—", "—", "—"]]
    for arm, s in r["summary"].items():
        cells = []
        for k, _, d, sc in keys:
            ms = s["mean"].get(k)
            cells.append("—" if ms is None else f"{ms['mean'] * sc:.{d}f} ± {ms['sd'] * sc:.{d}f}")
        rows.append([arm, *cells, f"{s['step_s']['mean']:.2f}" if s.get("step_s") else "—",
                     s.get("decision", {}).get("verdict", "(base)")])
    d_rows = []
    for arm, s in r["summary"].items():
        if "vs_base" not in s:
            continue
        v = s["vs_base"]
        d_rows.append([arm, fmt_interval(v["test_ce"], 4), fmt_interval(v["gr"], 1, 100.0), fmt_interval(v["kl"], 3),
                       fmt_interval(v["top1"], 1, 100.0), fmt_interval(v["kv_cos_free"], 3)])
    return "\n".join([
        f"heal bench ({r['config']}): teacher {r['teacher']}, its pruned student, Python-docs text in "
        f"{r['block']}-token blocks x {r['batch_size']}; warm start {r['warm_steps']} CE steps, then {r['steps']} "
        f"steps per arm; seeds {list(range(r['seeds']))} (each draws the block order and the initialisation)",
        f"gate: teacher {g['teacher_ce']:.3f} nats vs pruned student {g['student_ce']:.3f} nats on the test split "
        f"({r['test_tokens']} tokens): gap {g['gap']:.2f} nats (needs >= {g['min_gap']:g}); warm start "
        f"{r['ce_start']:.3f} nats (GR measured from here)",
        format_table(["arm", *[k[1] for k in keys], "s/step", "decision"], rows),
        "",
        f"paired differences against {base} (arm - {base}, mean [95 % t-interval], * = excludes 0):",
        format_table(["arm", "Δ test CE", "Δ GR %", "Δ KL", "Δ top-1 %", "Δ KV cos"], d_rows),
        f"decision rule (fixed before the run): {r['decision_rule']}",
        f"positive control ({CONTROL} vs {BASE}): " + {True: "passes", False: "FAILS: no conclusion about KV",
                                                        None: "not in this run"}[r["control_passes"]],
        f"teacher forwards per training sample: {r['teacher_forwards_per_sample']:.2f} ({r['cached_blocks']} blocks "
        f"computed once in {r['teacher_forwards']} teacher batches, read by every arm and seed)",
        f"plots: {r['plots']['ce']}, {r['plots']['gr']}; wall {r['wall_s'] / 60:.1f} min; out {r['out']}"])
