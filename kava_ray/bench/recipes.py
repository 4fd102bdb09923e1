"""`kava-ray bench recipes`: which recipe gives the better student at equal compute, with error bars.

Four recipes (`RECIPES`) x seeds, each the production step in this process over one precomputed
teacher cache, every student scored alike (`Scorer`), differences against `ce` paired per seed. The
method: docs/internals/runtime.md#bench-recipes.
"""

from __future__ import annotations

import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

from kava_ray.bench.inprocess import train_in_process
from kava_ray.bench.stats import fmt_interval, mean_sd, paired
from kava_ray.common.config import JobConfig, derive, load_config
from kava_ray.common.errors import KavaError
from kava_ray.common.files import format_table, write_json
from kava_ray.core.models import load_model, load_tokenizer
from kava_ray.core.plans import copied_layers
from kava_ray.data.splits import load_splits, load_test_split
from kava_ray.recipes.evaluate import gsm8k_accuracy, heldout_ce, kv_alignment, score_student
from kava_ray.runtime.console import status
from kava_ray.runtime.job import kv_source, precompute, setup_teachers
from kava_ray.runtime.preflight import check_model_files

# recipe: (loss.kv_weight, loss.logit_weight)
RECIPES: dict[str, tuple[float, float]] = {"ce": (0.0, 0.0), "ce+logits": (0.0, 1.0), "ce+kv": (1.0, 0.0),
                                           "ce+kv+logits": (1.0, 1.0)}
BASE = "ce"
TOP_K = 64  # teacher log-probs cached for every recipe (scoring reads them for the `ce` runs too)
CURVES_PNG = "eval_ce_curves.png"
# figure -> (label, lower is better, digits, scale)
FIGURES = {"test_ce": ("test CE", True, 4, 1.0), "kl": ("KL(teacher||student)", True, 3, 1.0),
           "top1": ("top-1 agree %", False, 1, 100.0), "kv_cos_free": ("KV cos, no projector", False, 3, 1.0),
           "exact": ("exact match %", False, 1, 100.0)}


def bench_configs(base: JobConfig, steps: int, out: Path, eval_steps: Optional[int] = None,
                  fit_data: bool = True, num_test: Optional[int] = None) -> tuple[JobConfig, JobConfig]:
    """(the precompute config, the cache config every recipe x seed is derived from). fit_data: the
    training split holds exactly the examples one run trains on (one epoch; every seed reshuffles
    the same examples)."""
    t, o = base.train, base.optim
    run = {"train.steps": steps, "train.eval_steps": eval_steps or max(1, steps // 8), "train.save_steps": steps,
           "data.kv_cache_dir": str(out / "kv_cache"), "ray.storage_path": str(out / "runs")}
    if fit_data:
        run["data.num_train"] = steps * o.accumulation * base.ray.num_workers * t.batch_size
    if num_test:
        run["data.num_test"] = num_test
    pre = derive(base, {**run, "data.kv_source": "live", "loss.logit_weight": max(1.0, base.loss.logit_weight),
                        "loss.logit_top_k": max(TOP_K, base.loss.logit_top_k)})
    return pre, derive(base, {**run, "data.kv_source": "cache"})


class Scorer:
    """Scores finished students the same way, whatever trained them: `score_student` on the test
    split from the cache (CE, KL and top-1 per teacher, projector-free KV cosine) plus greedy exact
    match."""

    def __init__(self, cache_cfg: JobConfig, limit: int, max_new_tokens: int):
        self.cfg, self.limit, self.max_new_tokens = cache_cfg, limit, max_new_tokens
        _, self.plans, _ = setup_teachers(cache_cfg)  # the cache: no Ray, no teacher model
        self.source = kv_source(cache_cfg, self.plans)
        tok = load_tokenizer(cache_cfg.student.model)
        self.train_split = load_splits(cache_cfg.data, cache_cfg.train, tok)[0]
        self.test = load_test_split(cache_cfg.data, cache_cfg.train, tok)
        self.copied = {t: copied_layers(cache_cfg.student, cache_cfg.teacher(t)) for t in self.plans}

    def model(self, model, tokenizer, split=None) -> dict:
        """Score a student model on `split` (default the test split); exact match on gsm8k records only."""
        split = self.test if split is None else split
        align = kv_alignment(model, self.source, self.plans, self.train_split, self.cfg, self.copied)
        out = score_student(model, self.source, self.plans, split, self.cfg, logit_top_k=TOP_K, alignment=align)
        if self.limit > 0 and split.format == "gsm8k":
            acc = gsm8k_accuracy(model, tokenizer, split.examples[:self.limit], self.cfg.data.prompt_format,
                                 self.max_new_tokens)
            out.update(exact=acc["accuracy"], exact_n=acc["n"], exact_samples=acc["samples"][:2])
        return out

    def teacher(self, name: str) -> dict:
        t = self.cfg.teacher(name)
        model = load_model(t.model, dtype=t.dtype, quantization=t.quantization)
        out = {"test_ce": heldout_ce(model, self.test)}
        if self.limit > 0 and self.test.format == "gsm8k":
            acc = gsm8k_accuracy(model, load_tokenizer(t.model), self.test.examples[:self.limit],
                                 self.cfg.data.prompt_format, self.max_new_tokens)
            out.update(exact=acc["accuracy"], exact_n=acc["n"])
        return out


def figures_of(score: dict, teachers: list[str]) -> dict:
    """A run's score -> the bench's figures (KL, top-1 and KV cosine averaged over the teachers)."""
    def mean(prefix):
        xs = [score[f"{prefix}/{t}"] for t in teachers if f"{prefix}/{t}" in score]
        return statistics.fmean(xs) if xs else None

    return {"test_ce": score["ce"], "kl": mean("kl"), "top1": mean("top1_agree"), "kv_cos_free": mean("kv_cos_free"),
            "exact": score.get("exact")}


def summarize(arms: dict, base: str = BASE) -> dict:
    """Per arm: mean ± sd of every figure over seeds, and the paired difference against `base` per seed."""
    out = {}
    for name, runs in arms.items():
        figs = [r["figures"] for r in runs]
        out[name] = {"mean": {k: mean_sd([f.get(k) for f in figs]) for k in FIGURES},
                     "s_per_step": mean_sd([r.get("s_per_step") for r in runs])}
        if name != base and base in arms:
            ref = [r["figures"] for r in arms[base]]
            out[name]["vs_base"] = {k: paired([f.get(k) for f in figs], [f.get(k) for f in ref]) for k in FIGURES}
    return out


def plot_curves(arms: dict, path: Path, log_y: bool = False, teacher_ce: Optional[float] = None) -> None:
    """Validation CE over steps, one line per arm (mean over seeds), shaded min-max; the teacher as a line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # matplotlib: heavy, loaded for plots only
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, runs in arms.items():
        steps = sorted({s for r in runs for s, _ in r["eval_ce"]})
        per = [[dict(r["eval_ce"]).get(s) for r in runs] for s in steps]
        ms = [statistics.fmean([v for v in p if v is not None]) for p in per]
        line, = ax.plot(steps, ms, marker="o", markersize=3, label=name)
        ax.fill_between(steps, [min(v for v in p if v is not None) for p in per],
                        [max(v for v in p if v is not None) for p in per], color=line.get_color(), alpha=0.15)
    if teacher_ce is not None:
        ax.axhline(teacher_ce, color="black", linestyle="--", linewidth=1, label="teacher")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("validation CE")
    ax.set_title("validation CE per arm (mean over seeds, min-max shaded)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


def run_recipes_bench(config="demo_cpu", overrides: Optional[list[str]] = None, steps: int = 40, seeds: int = 3,
                      out: Optional[str] = None, limit: int = 64, max_new_tokens: int = 192, num_test: int = 128,
                      eval_steps: Optional[int] = None, recipes: Optional[Sequence[str]] = None,
                      address: Optional[str] = None, progress: bool = True) -> dict:
    """Every recipe x seed over one precomputed teacher cache, every student scored alike; see the module doc."""
    names = list(recipes or RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown or seeds < 1 or steps < 1:
        raise KavaError(f"bench recipes: recipes must be among {', '.join(RECIPES)} (got {unknown}), "
                        f"seeds and steps >= 1")
    base = load_config(config, overrides)
    check_model_files(base)
    root = Path(out or Path(base.ray.storage_path) / f"bench-recipes-{datetime.now():%Y%m%d-%H%M%S}")
    root = root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    pre, cache_cfg = bench_configs(base, steps, root, eval_steps, num_test=num_test)
    seed_values = [base.train.seed + i for i in range(seeds)]

    def say(msg):
        status(f"[bench recipes] {msg}")

    t_start = time.time()
    stats = precompute(pre, root / "kv_cache", progress=progress, address=address)  # the only part that needs Ray
    precompute_s = time.time() - t_start
    say(f"teacher cache: {stats['written']} examples in {stats['forwards']} teacher batches, "
        f"{stats['skipped']} already there ({precompute_s:.0f} s)")
    scorer = Scorer(cache_cfg, limit, max_new_tokens)
    teachers = [t.name for t in pre.teachers]
    tok = load_tokenizer(cache_cfg.student.model)
    arms: dict = {n: [] for n in names}
    for seed in seed_values:
        for name in names:
            kv_w, logit_w = RECIPES[name]
            cfg = derive(cache_cfg, {"loss.kv_weight": kv_w, "loss.logit_weight": logit_w, "train.seed": seed,
                                     "train.data_seed": seed})
            t0 = time.time()
            run = train_in_process(cfg, scorer.plans, scorer.source, steps, cfg.train.eval_steps,
                                   lambda recipe: recipe.evaluate(scorer.source)["eval/ce"])
            score = scorer.model(run["recipe"].distiller.student, tok)
            arms[name].append({"seed": seed, "wall_s": time.time() - t0, "s_per_step": run["step_s"],
                               "eval_ce": run["curve"], "score": score, "figures": figures_of(score, teachers)})
            say(f"{name} seed {seed}: test CE {score['ce']:.4f} ({time.time() - t0:.0f} s)")
    teacher_rows = {t: scorer.teacher(t) for t in teachers}
    png = root / CURVES_PNG
    plot_curves(arms, png, teacher_ce=teacher_rows[teachers[0]]["test_ce"])
    result = {"config": str(config), "out": str(root), "steps": steps, "seeds": seed_values,
              "batch_size": pre.train.batch_size, "accumulation": pre.optim.accumulation,
              "num_workers": pre.ray.num_workers, "teachers": teachers, "base": BASE,
              "test_examples": len(scorer.test), "test_tokens": arms[names[0]][0]["score"]["tokens"],
              "limit": limit, "max_new_tokens": max_new_tokens,
              "teacher_forwards": stats["forwards"], "cached_examples": stats["written"] + stats["skipped"],
              "train_examples": len(scorer.train_split),
              "teacher_forwards_per_sample": stats["written"] / max(stats["total"], 1),
              "precompute_s": precompute_s, "wall_s": time.time() - t_start, "plot": str(png),
              "teacher_rows": teacher_rows, "summary": summarize(arms), "arms": arms}
    write_json(root / "bench_recipes.json", result)
    return result


def _cell(ms: Optional[dict], key: str) -> str:
    if ms is None:
        return "—"
    _, _, digits, scale = FIGURES[key]
    return f"{ms['mean'] * scale:.{digits}f} ± {ms['sd'] * scale:.{digits}f}"


def format_table_of(out: dict, title: str) -> str:
    """The per-arm table (mean ± sd over seeds, teachers' row first) and the paired-difference table."""
    keys = [k for k in FIGURES if any(s["mean"].get(k) for s in out["summary"].values())]
    headers = ["arm"] + [FIGURES[k][0] for k in keys] + ["s/step"]
    rows = []
    for t, row in out["teacher_rows"].items():
        cells = [f"{row[k] * FIGURES[k][3]:.{FIGURES[k][2]}f}" if row.get(k) is not None else "—" for k in keys]
        rows.append([f"teacher {t}", *cells, "—"])
    for name, s in out["summary"].items():
        sps = s["s_per_step"]
        rows.append([name] + [_cell(s["mean"].get(k), k) for k in keys] + [f"{sps['mean']:.2f}" if sps else "—"])
    base = out["base"]
    d_headers = ["arm", *[f"Δ {FIGURES[k][0]}" for k in keys]]
    d_rows = [[name] + [fmt_interval(s["vs_base"].get(k), FIGURES[k][2] + 1, FIGURES[k][3]) for k in keys]
              for name, s in out["summary"].items() if "vs_base" in s]
    return "\n".join([
        title,
        format_table(headers, rows),
        "",
        f"paired differences against {base}, per seed (mean [95 % t-interval]; * = the interval excludes 0; "
        f"lower CE and KL are better):",
        format_table(d_headers, d_rows)])


def format_recipes(out: dict) -> str:
    em = (f"exact match: greedy, <= {out['max_new_tokens']} new tokens, first {out['limit']} test problems"
          if out["limit"] else "exact match: not run (--limit 0)")
    return "\n".join([
        format_table_of(out, f"recipes bench ({out['config']}): {out['steps']} steps x batch {out['batch_size']}, "
                             f"seeds {out['seeds']} (each draws the data order and the initialisation)"),
        f"test split: {out['test_examples']} examples, {out['test_tokens']} next-token positions (CE, KL, top-1); "
        f"{em}",
        f"teacher forwards per training sample: {out['teacher_forwards_per_sample']:.2f} "
        f"({out['cached_examples']} examples computed once in {out['teacher_forwards']} teacher batches, read by "
        f"{len(out['summary'])} recipes x {len(out['seeds'])} seeds; precompute {out['precompute_s']:.0f} s)",
        f"validation CE curves: {out['plot']}; wall {out['wall_s'] / 60:.1f} min; runs under {out['out']}"])
