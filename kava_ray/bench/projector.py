"""Synthetic A/B of LinearProjector vs ElasticBottleneck, repeating the predecessor's published table.

Three d -> d regression scenarios (`gaussian`, `shifted_outliers`, `tanh`); per scenario and seed
fresh data and models, full-batch Adam on MSE, then the held-out MSE in eval mode. The predecessor
did not publish its dims, data recipe or learning rate, so its numbers are shown for reference only.
The scenarios and settings: docs/internals/runtime.md#bench-projector.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kava_ray.bench.stats import mean_sd
from kava_ray.common.errors import KavaError
from kava_ray.common.files import format_table
from kava_ray.core.projectors import ElasticBottleneck, LinearProjector

SCENARIOS = ("gaussian", "shifted_outliers", "tanh")

# Held-out MSE the predecessor reported: (Linear, MLP).
REPORTED = {"gaussian": (0.0032, 0.0512), "shifted_outliers": (19.67, 5.37), "tanh": (0.0029, 0.0236)}


def _data(scenario: str, n: int, d: int, W: torch.Tensor, g: torch.Generator, outlier_frac: float):
    x = torch.randn(n, d, generator=g)
    if scenario == "shifted_outliers":
        x = 2.4 + 5.6 * x
        hit = torch.rand(n, d, generator=g) < outlier_frac
        sign = torch.where(torch.rand(n, d, generator=g) < 0.5, -1.0, 1.0)
        x = torch.where(hit, 20.0 * sign, x)
    y = x @ W
    if scenario == "tanh":
        y = torch.tanh(y)
    return x, y


def _fit(model: torch.nn.Module, x, y, x_test, y_test, steps: int, lr: float) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return float(F.mse_loss(model(x_test), y_test))


def run_projector_ab(
    seeds: int = 5,
    steps: int = 40,
    d: int = 64,
    n: int = 1024,
    lr: float = 1e-3,
    mlp_ratio: float = 1.0,
    dropout: float = 0.1,
    outlier_frac: float = 0.03,
) -> dict:
    """Run the A/B; returns {"config": ..., "rows": [one dict per scenario], "seconds": float}.

    Each row: scenario, linear_mean, linear_std, mlp_mean, mlp_std (held-out MSE over
    seeds, sample std), reported_linear, reported_mlp, winner ("linear" | "mlp", lower
    mean), clear (means differ by more than the two stds together),
    reported_winner.
    """
    if seeds < 1 or steps < 1 or d < 1 or n < 1 or not lr > 0:
        raise KavaError(f"bench: seeds, steps, d, n must be >= 1 and lr > 0 (got {seeds}, {steps}, {d}, {n}, {lr})")
    start = time.perf_counter()
    rows = []
    for si, scenario in enumerate(SCENARIOS):
        lin, mlp = [], []
        for seed in range(seeds):
            g = torch.Generator().manual_seed(1000 * si + seed)
            W = torch.randn(d, d, generator=g) / d**0.5
            x, y = _data(scenario, n, d, W, g, outlier_frac)
            x_test, y_test = _data(scenario, n, d, W, g, outlier_frac)
            torch.manual_seed(seed)
            lin.append(_fit(LinearProjector(d, d), x, y, x_test, y_test, steps, lr))
            torch.manual_seed(seed)
            mlp.append(_fit(ElasticBottleneck(d, d, mlp_ratio, dropout), x, y, x_test, y_test, steps, lr))
        (lm, ls), (mm, ms) = ((s["mean"], s["sd"]) for s in (mean_sd(lin), mean_sd(mlp)))
        rep_l, rep_m = REPORTED[scenario]
        rows.append({
            "scenario": scenario,
            "linear_mean": lm, "linear_std": ls, "mlp_mean": mm, "mlp_std": ms,
            "reported_linear": rep_l, "reported_mlp": rep_m,
            "winner": "linear" if lm <= mm else "mlp",
            "clear": abs(lm - mm) > ls + ms,
            "reported_winner": "linear" if rep_l <= rep_m else "mlp",
        })
    config = {"seeds": seeds, "steps": steps, "d": d, "n": n, "lr": lr, "mlp_ratio": mlp_ratio,
              "dropout": dropout, "outlier_frac": outlier_frac, "optimizer": "adam", "batch": "full"}
    return {"config": config, "rows": rows, "seconds": time.perf_counter() - start}


def format_projector_ab(result: dict) -> str:
    """Plain aligned text table of a `run_projector_ab` result."""
    header = ["scenario", "linear (mean±std)", "mlp (mean±std)", "reported lin/mlp", "winner", "reported winner"]
    lines = []
    for r in result["rows"]:
        lines.append([
            r["scenario"],
            f"{r['linear_mean']:.4g} ± {r['linear_std']:.2g}",
            f"{r['mlp_mean']:.4g} ± {r['mlp_std']:.2g}",
            f"{r['reported_linear']:g} / {r['reported_mlp']:g}",
            r["winner"] + ("" if r["clear"] else " (within noise)"),
            r["reported_winner"],
        ])
    c = result["config"]
    title = (f"projector A/B: held-out MSE after {c['steps']} Adam steps (lr {c['lr']:g}, full batch), "
             f"d={c['d']}, N={c['n']}, {c['seeds']} seeds, "
             f"elastic mlp_ratio {c['mlp_ratio']:g} dropout {c['dropout']:g}")
    out = [title, format_table(header, lines)]
    out.append(f"({result['seconds']:.1f} s)")
    return "\n".join(out)
