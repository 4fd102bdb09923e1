"""`kava-ray bench recipes`: which recipe gives the better student at equal compute.

The same student, data, batch, steps, optimizer and seeds under four recipes — `ce` (plain fine-tuning),
`ce+kv` (this product's default), `ce+logits` (standard top-k logit KD) and `ce+kv+logits` — each run by
the production `kava_ray.train.run_training` in one Ray. The teachers run once: `kava_ray.job.precompute`
writes every batch's KV and top-k logits to one cache, which every recipe x seed reads
(`data.kv_source: cache`). Seeds vary only the model-side randomness (`train.seed`: projector init, dropout);
the data order is `train.data_seed`, fixed, so every run reads the same cached batches. By default the
training split is sized to exactly the batches the runs train on (one epoch), so no batch is computed that
no run reads.

Reported per recipe, mean ± std over seeds: test-split answer-token CE, greedy exact-match accuracy on the
first `limit` test problems, centred KV cos and contrast gap, top-1 agreement with each teacher (only
recipes that train on logits have the teachers' logits at evaluation: `—` otherwise), wall time per step;
the teacher forwards per training sample across the whole bench; a PNG of the validation CE curves.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

from kava_ray._io import format_table
from kava_ray.config import JobConfig, load_config, validate_config

# recipe: (loss.kv_weight, loss.logit_weight)
RECIPES: dict[str, tuple[float, float]] = {"ce": (0.0, 0.0), "ce+kv": (1.0, 0.0), "ce+logits": (0.0, 1.0),
                                           "ce+kv+logits": (1.0, 1.0)}
CURVES_PNG = "eval_ce_curves.png"


def _merge(d: dict, **sections) -> dict:
    return {**d, **{k: {**d[k], **v} for k, v in sections.items()}}


def _mean_std(xs: Sequence[Optional[float]]) -> Optional[dict]:
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def bench_configs(base: JobConfig, steps: int, out: Path, eval_steps: Optional[int] = None,
                  fit_data: bool = True) -> tuple[JobConfig, dict]:
    """(the precompute config, the run dict every recipe x seed is derived from)."""
    d = base.to_dict()
    t, o = base.train, base.optim
    batches = steps * o.accumulation * base.ray.num_workers  # global batches every run trains on
    train = {"steps": steps, "eval_steps": eval_steps or max(1, steps // 8), "save_steps": steps,
             "data_seed": t.seed if t.data_seed is None else t.data_seed}
    data = {"kv_cache_dir": str(out / "kv_cache")}
    if fit_data:  # one epoch = exactly the batches the runs train on (validation is carved off on top)
        data["num_train"] = batches * t.batch_size
    d = _merge(d, train=train, data=data, ray={"storage_path": str(out / "runs")})
    pre = validate_config(_merge(d, data={"kv_source": "live"},
                                 loss={"logit_weight": max(1.0, base.loss.logit_weight)}))
    return pre, _merge(d, data={"kv_source": "cache"})


def _run_one(run_cfg: JobConfig, name: str, limit: int, max_new_tokens: int, progress: bool) -> dict:
    from kava_ray.checkpoint import read_state
    from kava_ray.evaluate import gsm8k_accuracy
    from kava_ray.job import load_test_split
    from kava_ray.models import load_model, load_tokenizer
    from kava_ray.report import read_metrics
    from kava_ray.train import run_training
    from kava_ray.worker import METRICS

    res = run_training(run_cfg, name=name, progress=progress)
    run_dir = Path(res["run_dir"])
    train, evals = read_metrics(run_dir / METRICS)  # the last record of each step wins (resumed runs)
    test = read_state(run_dir / "final")["test"]  # the worker writes the test split's metrics there
    times = [r["time_s"] for r in train if "time_s" in r]
    curve = [(r["step"], r["eval/ce"]) for r in evals if "eval/ce" in r]
    acc = None
    if limit > 0:
        student = load_model(run_dir / "final" / "student", dtype="float32")
        tok = load_tokenizer(run_dir / "final" / "student")
        examples = load_test_split(run_cfg, tok).examples[:limit]
        acc = gsm8k_accuracy(student, tok, examples, run_cfg.data.prompt_format, max_new_tokens)["accuracy"]
    return {"run_dir": str(run_dir), "wall_s": res["wall_s"], "test": test, "gsm8k_accuracy": acc,
            "s_per_step": statistics.fmean(times) if times else None, "eval_ce": curve}


def _aggregate(runs: list[dict], teachers: list[str]) -> dict:
    def test_metric(k):
        return _mean_std([r["test"].get(k) for r in runs])

    agg = {"test_ce": test_metric("test/ce"), "gsm8k_accuracy": _mean_std([r["gsm8k_accuracy"] for r in runs]),
           "cos_sim": test_metric("test/cos_sim"), "contrast_gap": test_metric("test/contrast_gap"),
           "top1_agree": {t: test_metric(f"test/top1_agree/{t}") for t in teachers},
           "s_per_step": _mean_std([r["s_per_step"] for r in runs])}
    steps = sorted({s for r in runs for s, _ in r["eval_ce"]})
    curve = []
    for s in steps:
        ms = _mean_std([dict(r["eval_ce"]).get(s) for r in runs])
        if ms:
            curve.append({"step": s, **ms})
    agg["eval_ce_curve"] = curve
    return agg


def plot_curves(recipes: dict, path: Path) -> None:
    """Validation CE over steps, one line per recipe (seed mean), shaded ± std."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, r in recipes.items():
        c = r["eval_ce_curve"]
        if not c:
            continue
        xs, ms, sd = [p["step"] for p in c], [p["mean"] for p in c], [p["std"] for p in c]
        line, = ax.plot(xs, ms, marker="o", markersize=3, label=name)
        ax.fill_between(xs, [m - s for m, s in zip(ms, sd)], [m + s for m, s in zip(ms, sd)],
                        color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation CE (answer tokens)")
    ax.set_title("validation CE per recipe (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


def run_recipes_bench(config="demo_cpu", overrides: Optional[list[str]] = None, steps: int = 40, seeds: int = 3,
                      out: Optional[str] = None, limit: int = 8, max_new_tokens: int = 32,
                      eval_steps: Optional[int] = None, recipes: Optional[Sequence[str]] = None,
                      fit_data: bool = True, address: Optional[str] = None, progress: bool = True) -> dict:
    """Every recipe x seed (seeds `train.seed`, +1, ...) over one precomputed teacher cache; see the module doc."""
    import ray

    from kava_ray.errors import KavaError
    from kava_ray.job import connect_job, load_splits, load_test_split, precompute, student_tokenizer
    from kava_ray.preflight import check_model_files

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
    pre, run_dict = bench_configs(base, steps, root, eval_steps, fit_data)

    tok = student_tokenizer(pre)[0]
    train_split, val = load_splits(pre, tok)
    b = pre.train.batch_size
    per_epoch = len(train_split) // b
    train_batches = steps * pre.optim.accumulation * pre.ray.num_workers
    distinct = train_batches + len(val) // b + len(load_test_split(pre, tok)) // b
    epochs = math.ceil(train_batches / max(per_epoch, 1))

    t_start = time.time()
    connected = connect_job(pre, address)  # sized for the teachers + one run; every run below reuses it
    try:
        t0 = time.time()
        stats = precompute(pre, root / "kv_cache", epochs=epochs, progress=progress)
        precompute_s = time.time() - t0
        print(f"[bench recipes] teacher cache: {stats['written']} batches written, {stats['skipped']} already there "
              f"({precompute_s:.0f} s)", file=sys.stderr, flush=True)
        results: dict = {}
        for name in names:
            kv_w, logit_w = RECIPES[name]
            runs = []
            for i in range(seeds):
                seed = base.train.seed + i
                cfg = validate_config(_merge(run_dict, loss={"kv_weight": kv_w, "logit_weight": logit_w},
                                             train={"seed": seed}))
                run_name = f"{name.replace('+', '_')}-seed{seed}"
                runs.append(_run_one(cfg, run_name, limit, max_new_tokens, progress))
                print(f"[bench recipes] {name} seed {seed}: test CE {runs[-1]['test'].get('test/ce')}, "
                      f"{runs[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
            results[name] = {"kv_weight": kv_w, "logit_weight": logit_w,
                             **_aggregate(runs, [t.name for t in pre.teachers]), "runs": runs}
    finally:
        if connected == "embedded":
            ray.shutdown()
    png = root / CURVES_PNG
    plot_curves(results, png)
    result = {"config": str(config), "out": str(root), "steps": steps, "seeds": seeds,
              "seed_values": [base.train.seed + i for i in range(seeds)], "data_seed": pre.train.data_seed,
              "batch_size": b, "accumulation": pre.optim.accumulation, "num_workers": pre.ray.num_workers,
              "teachers": [t.name for t in pre.teachers], "limit": limit, "max_new_tokens": max_new_tokens,
              "teacher_forwards": stats["written"], "cache_batches_skipped": stats["skipped"],
              "distinct_batches": distinct, "teacher_forwards_per_sample": stats["written"] / distinct,
              "precompute_s": precompute_s, "wall_s": time.time() - t_start, "plot": str(png), "recipes": results}
    (root / "bench_recipes.json").write_text(json.dumps(result, indent=1, default=float))
    return result


def _fmt(ms: Optional[dict], digits: int = 4, pct: bool = False) -> str:
    if ms is None:
        return "—"
    k = 100.0 if pct else 1.0
    return f"{ms['mean'] * k:.{digits}f} ± {ms['std'] * k:.{digits}f}"


def format_recipes(out: dict) -> str:
    teachers = out["teachers"]
    headers = (["recipe", "test CE", f"exact match % (n={out['limit']})", "centred KV cos", "contrast gap"]
               + [f"top-1 agree {t}" for t in teachers] + ["s/step"])
    rows = []
    for name, r in out["recipes"].items():
        rows.append([name, _fmt(r["test_ce"]), _fmt(r["gsm8k_accuracy"], 1, pct=True), _fmt(r["cos_sim"]),
                     _fmt(r["contrast_gap"])] + [_fmt(r["top1_agree"].get(t), 3) for t in teachers]
                    + [_fmt(r["s_per_step"], 2)])
    best = min((n for n in out["recipes"] if out["recipes"][n]["test_ce"]),
               key=lambda n: out["recipes"][n]["test_ce"]["mean"], default=None)
    return "\n".join([
        f"recipes bench ({out['config']}): {out['steps']} steps x batch {out['batch_size']}, seeds "
        f"{out['seed_values']} (model-side only; data order seed {out['data_seed']}), mean ± std over seeds",
        format_table(headers, rows),
        f"lowest test CE: {best}" if best else "",
        f"teacher forwards per training sample: {out['teacher_forwards_per_sample']:.2f} "
        f"({out['teacher_forwards']} batches computed once, {out['distinct_batches']} distinct batches read by "
        f"{len(out['recipes'])} recipes x {out['seeds']} seeds; precompute {out['precompute_s']:.0f} s)",
        "top-1 agree: — for recipes without logit_weight (their evaluation does not ask the teachers for logits)",
        f"validation CE curves: {out['plot']}; wall {out['wall_s'] / 60:.1f} min; runs under {out['out']}"])
