"""`kava-ray bench all`: the performance benches at small defaults, and the "Performance" table of docs/results.md.

Runs `bench feed` (regimes, replicas, teacher early stop, transport), `bench step` (the student step
of each recipe against plain fine-tuning, its breakdown, and peak memory per recipe beside `kava-ray
plan`) and `bench vocab` (the vocabulary maps and paired shares of the real tokenizer pairs; no
timing), then rewrites the docs/results.md block between PERF_BEGIN and PERF_END with one summary
row per figure, each naming the command that regenerates it, followed by the tables the benches
print. ~10 min on a 2-core CPU.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Optional

from kava_ray.bench.feed import format_feed_bench, run_feed_bench
from kava_ray.bench.step import format_step_bench, run_step_bench
from kava_ray.bench.vocab import format_vocab_bench, run_vocab_bench
from kava_ray.common.errors import KavaError
from kava_ray.common.files import format_table

PERF_BEGIN = "<!-- perf:begin (written by `kava-ray bench all`; edit the bench, not this block) -->"
PERF_END = "<!-- perf:end -->"
FEED_CMD = "`kava-ray bench feed`"
STEP_CMD = "`kava-ray bench step`"
MEMORY_CMD = "`kava-ray bench step --memory`"


def run_all(feed_kwargs: Optional[dict] = None, step_kwargs: Optional[dict] = None) -> dict:
    """Every bench once, in this order (each its own Ray or none); wall seconds of each."""
    out, wall = {}, {}
    step_kwargs = {"memory": True} if step_kwargs is None else step_kwargs
    for name, fn, kw in (("feed", run_feed_bench, feed_kwargs), ("step", run_step_bench, step_kwargs),
                         ("vocab", run_vocab_bench, {})):
        t0 = time.perf_counter()
        out[name] = fn(**(kw or {}))
        wall[name] = time.perf_counter() - t0
    out["wall_s"] = wall
    return out


def _fmt_range(xs: list[float]) -> str:
    return f"{min(xs):.2f}–{max(xs):.2f} (median {statistics.median(xs):.2f})" if len(xs) > 1 else f"{xs[0]:.2f}"


def summary_rows(r: dict) -> list[list[str]]:
    """[figure, measured, target, command] rows of the Performance table."""
    feed, step = r["feed"], r.get("step")
    timed = [g for g in feed["regimes"] if g["mode"] == "timed"]
    real = [g for g in feed["regimes"] if g["mode"] == "real"]
    rows = []
    if timed:
        eff2 = [g["efficiency"]["2"] for g in timed if "2" in g["efficiency"]]
        rows.append([f"KVFeed overlap efficiency at depth 2, timed teachers ({len(eff2)} regimes: T/S "
                     f"{min(g['t_over_s'] for g in timed):.2f}–{max(g['t_over_s'] for g in timed):.1f}, "
                     f"{'/'.join(sorted({str(g['teachers']) for g in timed}))} teachers)",
                     _fmt_range(eff2), "≥ 0.95 in every regime", FEED_CMD])
        bound = [g["step_over_slowest_teacher"]["2"] for g in timed if g["t_over_s"] > 1 and g["teachers"] > 1]
        if bound:
            rows.append(["several teachers, teacher-bound (T/S > 1): step / slowest teacher at depth 2",
                         _fmt_range(bound), "≤ 1.05", FEED_CMD])
    for g in real:
        rows.append([f"real teacher actor ({g['teacher_layers']} layers, T/S {g['t_over_s']:.2f}) on this CPU: "
                     "overlap efficiency d1/d2/d4",
                     " / ".join(f"{v:.2f}" for v in g["efficiency"].values()), "(shares the 2 cores)", FEED_CMD])
    if feed["replicas"]:
        reps = feed["replicas"]
        rows.append([f"replicas N = {'/'.join(str(x['replicas']) for x in reps)} at T/S "
                     f"{feed['config']['replica_ratio']:g}: step / max(T/N, S)",
                     " / ".join(f"{x['step_over_expected']:.2f}" for x in reps), "within 10 %", FEED_CMD])
    e = feed["early_stop"]
    rows.append([f"teacher forward serving layers 0–{e['served_layers'][-1]} of {e['teacher_layers']}: whole → "
                 "stopped after the last served layer",
                 f"{e['full_ms']:.1f} → {e['stopped_ms']:.1f} ms ({e['stopped_over_full']:.2f}×)", "", FEED_CMD])
    t = feed["transport"]
    rows.append([f"KV wire format, {t['bytes'] / 2**20:.0f} MiB actor → driver: vs pickled torch, vs memcpy",
                 f"{t['wire_over_pickle']:.1f}×, {100 * t['wire_over_memcpy']:.0f} % (an actor's first payloads: "
                 f"{100 * t['wire_first_over_memcpy']:.0f} %)", "≥ 50 % of memcpy", FEED_CMD])
    x = feed.get("cross_node")
    if x:
        runs = x["runs"]
        rows.append([f"teacher on another node ({x['bytes_per_step'] / 2**20:.0f} MiB per step crossing): step / "
                     "same node, with prefetch (without)",
                     f"{runs['cross node, prefetch']['over_same_node']:.2f} "
                     f"({runs['cross node, no prefetch']['over_same_node']:.2f})", "≤ 1.05", FEED_CMD])
        rows.append(["prefetch on one node: step with / without (what the pull callbacks cost)",
                     f"{runs['same node']['step_s'] / runs['same node, no prefetch']['step_s']:.2f}", "≈ 1.00",
                     FEED_CMD])
    if step:
        rows += step_summary_rows(step)
    return rows


def step_summary_rows(step: dict) -> list[list[str]]:
    """The `bench step` rows: each recipe's step over plain CE, and memory measured vs planned."""
    rows = []
    base = step["variants"]["ce"]["step_s"]
    for name, v in step["variants"].items():
        if name == "ce":
            continue
        target = "≤ 1.25" if name == "ce+kv structured" else ""
        rows.append([f"student step {name} / plain CE fine-tuning ({1000 * base:.0f} ms)",
                     f"{v['step_s'] / base:.2f}", target, STEP_CMD])
    x = step.get("cross_vocab")
    if x:
        rows.append([f"student step {x['variant']} / {x['against']} (teacher vocabulary {x['teacher_vocab']}: its "
                     f"KV aligned, its logits by the hybrid loss)", f"{x['ratio']:.2f}", f"≤ {x['max_ratio']:.2f}",
                     STEP_CMD])
    for name, m in (step.get("memory") or {}).items():
        rows.append([f"peak memory {name} ({m['device']}): measured vs `kava-ray plan`",
                     f"{m['measured'] / 2**20:.0f} vs {m['planned'] / 2**20:.0f} MiB ({m['error']:+.0%})",
                     "within 30 %", MEMORY_CMD])
    return rows


def performance_block(r: dict, machine: str) -> str:
    """The Performance block: the summary table, then each bench's own tables."""
    rows = summary_rows(r)
    table = ["| figure | measured | target | regenerate |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    wall = r.get("wall_s", {})
    parts = [PERF_BEGIN,
             f"Measured by `kava-ray bench all` on {machine} ({sum(wall.values()) / 60:.0f} min). Timings on a "
             "shared box are noisy: read the ratios (each measured side by side in one run).", "",
             *table, "", "```", format_feed_bench(r["feed"]), "```"]
    if r.get("step"):
        parts += ["", "```", format_step_bench(r["step"]), "```"]
    if r.get("vocab"):  # not a timing: what teachers of another tokenizer can give the logits, real tokenizers
        parts += ["", "`kava-ray bench vocab`:", "", "```", format_vocab_bench(r["vocab"]), "```"]
    parts.append(PERF_END)
    return "\n".join(parts)


def _split_results(path: Path) -> tuple[str, str]:
    """(text before the block, text after it); KavaError unless each marker is there once, in order."""
    if not path.is_file():
        raise KavaError(f"--results {path}: no such file (run from the repository, or pass --no-write)")
    text = path.read_text()
    if text.count(PERF_BEGIN) != 1 or text.count(PERF_END) != 1 or text.index(PERF_BEGIN) > text.index(PERF_END):
        raise KavaError(f"{path}: expected one '{PERF_BEGIN}' line and then one '{PERF_END}' line to write the "
                        f"table between")
    head, rest = text.split(PERF_BEGIN)
    return head, rest.split(PERF_END, 1)[1]


def check_results(path: Path) -> None:
    """Fail before the benches run, not after, when the results file cannot take the table."""
    _split_results(path)


def write_results(path: Path, block: str) -> None:
    """Replace the block between the markers; the file is rewritten atomically (temp file, then rename)."""
    head, tail = _split_results(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(head + block + tail)
    tmp.replace(path)


def format_all(r: dict) -> str:
    return format_table(["figure", "measured", "target", "regenerate"], summary_rows(r))
