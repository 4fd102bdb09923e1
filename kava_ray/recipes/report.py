"""metrics.jsonl -> PNG plots + a short Markdown summary (and the same headline numbers as text).

A run dir holds `metrics.jsonl`: one JSON object per line, `{"step": int, "kind": "train" | "eval",
...}`. Train records may carry loss, ce, kv_loss, cos_sim, cos_raw, cos/<teacher>,
cos_raw/<teacher>, cos_layer/{first,middle,last}, contrast_gap, fusion/<teacher>, lr_student,
lr_projector, grad_norm, tokens_per_s, teacher_wait_s, phase and time_s (seconds of that step, the
interval teacher_wait_s is part of); eval records carry eval/ce, eval/cos_sim, eval/cos_raw,
eval/contrast_gap, eval/cos/<teacher>, eval/cos_raw/<teacher>. `cos_sim` and `cos/<teacher>` are
centred per (layer, head) over the batch's tokens (a constant target scores 0), `cos_raw` is the
plain cosine (flattered by constants). A resumed run re-logs steps: the last record of a (kind,
step) wins. Records of other kinds are ignored.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_path, atomic_write, format_table
from kava_ray.common.metrics_file import METRICS, read_metrics, wall_seconds
from kava_ray.core.metric_names import CE, CONTRAST_GAP, COS, COS_RAW, COS_SIM, KV_LOSS, LOSS, TASK_PREFIX, of, phase

REPORT_DIR = "report"
TASKS_TITLE = "Harness tasks (the newest `kava-ray eval --tasks` of this run)"
COLLAPSE_GAP = 0.01  # a final contrast gap below this means nothing sample-specific was learned
COLLAPSE_WARNING = ("the student matches other samples' targets as well as its own — nothing "
                    "sample-specific was learned (the collapse trap)")


# ------------------------------------------------------------------------------------------ reading


def _metrics_path(run_dir) -> Path:
    p = Path(run_dir)
    return p if p.is_file() else p / METRICS


def _load(run_dir) -> tuple[list[dict], list[dict]]:
    path = _metrics_path(run_dir)
    train, evals = read_metrics(path)
    if not train and not evals:
        raise KavaError(f"{path}: no train or eval records yet")
    return train, evals


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in records if _num(r.get(key))]
    return [s for s, _ in pts], [v for _, v in pts]


def _first_last(records: list[dict], key: str) -> Optional[tuple[float, float]]:
    _, vals = _series(records, key)
    return (vals[0], vals[-1]) if vals else None


def _teachers(records: list[dict], prefix: str) -> list[str]:
    """Teacher names from keys `<prefix><teacher>`, in order of first appearance."""
    seen: dict[str, None] = {}
    for r in records:
        for k in r:
            if k.startswith(prefix) and "/" not in k[len(prefix):]:
                seen[k[len(prefix):]] = None
    return list(seen)


# --------------------------------------------------------------------------------------- headlines


def headline(train: list[dict], evals: list[dict], wall_s: Optional[float] = None) -> dict:
    """The numbers a report leads with: first/last values, final phase, teacher wait share, last
    eval. wall_s: the run's wall time as its driver measured it (`metrics_file.wall_seconds`); else
    the steps' own time, marked so."""
    h: dict = {"first_step": None, "last_step": None, "num_train_records": len(train),
               "num_eval_records": len(evals)}
    steps = [r["step"] for r in train] or [r["step"] for r in evals]
    h["first_step"], h["last_step"] = steps[0], steps[-1]
    for key in (LOSS, CE, KV_LOSS, COS_SIM, COS_RAW, CONTRAST_GAP):
        h[key] = _first_last(train, key)
    h["cos"] = {t: _first_last(train, of(COS, t)) for t in _teachers(train, of(COS, ""))}
    h["eval_ce"] = _first_last(evals, "eval/ce")
    task_keys = sorted({k for r in evals for k in r if k.startswith(TASK_PREFIX)})  # train.eval_tasks
    h["eval_tasks"] = {k: _first_last(evals, k) for k in task_keys}
    times = _series(train, "time_s")[1]
    # without the driver's clock: ~ mean step time x steps done (records are logged every few
    # steps), which leaves out start-up, evaluation and saving
    h["wall_time_s"] = wall_s if wall_s is not None else (sum(times) / len(times) * max(steps[-1], 1) if times
                                                          else None)
    h["wall_time_measured"] = wall_s is not None
    both = [r for r in train if _num(r.get("time_s")) and _num(r.get("teacher_wait_s"))]
    total = sum(float(r["time_s"]) for r in both)
    h["teacher_wait_share"] = sum(float(r["teacher_wait_s"]) for r in both) / total if total > 0 else None
    last_phase = next((r["phase"] for r in reversed(train) if isinstance(r.get("phase"), str)), None)
    h["phase"] = last_phase or (phase(h[COS_SIM][1]) if h[COS_SIM] else None)
    gap = h[CONTRAST_GAP][1] if h[CONTRAST_GAP] else None
    h["collapse_warning"] = gap is not None and math.isfinite(gap) and gap < COLLAPSE_GAP
    h["last_eval"] = {k: v for k, v in evals[-1].items() if k != "kind"} if evals else None
    return h


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.4f}"
    return str(v)


def _rows(h: dict) -> list[list[str]]:
    """(metric, first, last) rows of the headline numbers that are present."""
    named = [(k, h[k]) for k in (LOSS, CE, KV_LOSS, COS_SIM, COS_RAW)]
    named += [(of(COS, t), fl) for t, fl in h["cos"].items()]
    named += [(CONTRAST_GAP, h[CONTRAST_GAP]), ("held-out ce (eval)", h["eval_ce"])]
    named += list(h.get("eval_tasks", {}).items())
    return [[name, _fmt(fl[0]), _fmt(fl[1])] for name, fl in named if fl is not None]


def _facts(h: dict) -> list[tuple[str, str]]:
    wall = h["wall_time_s"]
    share = h["teacher_wait_share"]
    return [("steps", f"{h['first_step']} -> {h['last_step']}"),
            ("wall time", "-" if wall is None else f"{wall:.0f} s" if h["wall_time_measured"] else
             f"~{wall:.0f} s in training steps (start-up, evaluation and saving not counted)"),
            ("final phase", h["phase"] or "-"),
            ("teacher wait share of step time", f"{share:.1%}" if share is not None else "-")]


def summarize_run(run_dir) -> str:
    """The headline numbers of a run as plain text tables (for `kava-ray report RUN_DIR`)."""
    h = headline(*_load(run_dir), wall_seconds(_metrics_path(run_dir).parent))
    text = format_table(["metric", "first", "last"], _rows(h))
    text += "\n\n" + "\n".join(f"{k}: {v}" for k, v in _facts(h))
    if h["collapse_warning"]:
        text += f"\n\nwarning: final contrast gap {_fmt(h['contrast_gap'][1])} < {COLLAPSE_GAP}: {COLLAPSE_WARNING}"
    from kava_ray.recipes.eval_tasks import format_tasks, latest_tasks_result  # (torch: at report time, not at import)

    tasks = latest_tasks_result(_metrics_path(run_dir).parent)
    if tasks is not None:
        text += f"\n\n{TASKS_TITLE}\n{format_tasks(tasks)}"
    return text


def _markdown(h: dict, title: str, tasks: Optional[dict] = None) -> str:
    def table(header, rows):
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])

    parts = [f"# kava-ray run: {title}", "\n".join(f"- **{k}**: {v}" for k, v in _facts(h)),
             table(["metric", "first", "last"], _rows(h))]
    if h["collapse_warning"]:
        parts.append(f"> **Warning:** the final contrast gap is {_fmt(h['contrast_gap'][1])} (< {COLLAPSE_GAP}): "
                     f"{COLLAPSE_WARNING}.")
    if h["last_eval"]:
        ev = h["last_eval"]
        parts.append(f"## Last eval (step {ev['step']})\n\n"
                     + table(["metric", "value"], [[k, _fmt(v)] for k, v in ev.items() if k != "step"]))
    if tasks is not None:
        from kava_ray.recipes.eval_tasks import format_tasks

        parts.append(f"## {TASKS_TITLE}\n\n```\n{format_tasks(tasks)}\n```")
    parts.append("Plots: ![loss](loss.png) ![cos](cos.png) ![contrast gap](contrast_gap.png) "
                 "![teacher wait](teacher_wait.png)")
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------ writing


def _plot(path: Path, title: str, ylabel: str, lines, markers=(), twin=None, hline=None) -> None:
    """One PNG: `lines`/`markers` are (label, steps, values); `twin` is one (label, steps, values) on a right axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # matplotlib: heavy, loaded for plots only
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors: dict[str, str] = {}
    for label, x, y in lines:
        if x:
            colors[label] = ax.plot(x, y, label=label)[0].get_color()
    for label, x, y, like in markers:
        if x:
            ax.plot(x, y, "o", label=label, color=colors.get(like), markersize=6, markeredgecolor="black")
    if hline is not None:
        ax.axhline(hline[1], color="grey", linestyle=":", label=hline[0])
    handles, labels = ax.get_legend_handles_labels()
    if twin and twin[1]:
        ax2 = ax.twinx()
        handles += ax2.plot(twin[1], twin[2], color="tab:green", linestyle="--", label=twin[0])
        labels.append(twin[0])
        ax2.set_ylabel(twin[0])
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:  # readers never see a half-written PNG
        fig.savefig(tmp, format="png")


def write_report(run_dir) -> dict:
    """Write loss/cos/contrast_gap/teacher_wait PNGs and summary.md into run_dir/report/.

    Returns {"report_dir", "summary", "plots": {name: path}, **headline numbers}.
    """
    train, evals = _load(run_dir)
    run_dir = _metrics_path(run_dir).parent
    out = run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    h = headline(train, evals, wall_seconds(run_dir))
    tr = lambda k: (k, *_series(train, k))  # noqa: E731
    ev = lambda k, like: (k, *_series(evals, k), like)  # noqa: E731
    teachers = list(h["cos"])
    plots = {name: out / f"{name}.png" for name in ("loss", "cos", "contrast_gap", "teacher_wait")}
    _plot(plots["loss"], "Loss", "loss", [tr(LOSS), tr(CE), tr(KV_LOSS)], [ev(of("eval", CE), CE)])
    cos = [COS_SIM] + [of(COS, t) for t in teachers] + [COS_RAW]
    _plot(plots["cos"], "KV cosine similarity (centred; raw for reference)", "cos", [tr(k) for k in cos],
          [ev(of("eval", k), k) for k in cos])
    _plot(plots["contrast_gap"], "Contrast gap (own - other sample's target)", "gap", [tr(CONTRAST_GAP)],
          [ev(of("eval", CONTRAST_GAP), CONTRAST_GAP)], hline=(f"collapse threshold {COLLAPSE_GAP}", COLLAPSE_GAP))
    _plot(plots["teacher_wait"], "Teacher wait and throughput", "teacher_wait_s (s)", [tr("teacher_wait_s")],
          twin=tr("tokens_per_s"))
    summary = out / "summary.md"
    from kava_ray.recipes.eval_tasks import latest_tasks_result

    tasks = latest_tasks_result(run_dir)
    text = _markdown(h, run_dir.name, tasks)
    atomic_write(summary, text)
    return {"report_dir": str(out), "summary": str(summary), "plots": {k: str(p) for k, p in plots.items()}, **h,
            "tasks": tasks}
