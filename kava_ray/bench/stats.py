"""The benches' statistics: mean ± sd over seeds, and paired per-seed differences against a baseline
with a Student-t interval (`bench recipes`, `bench heal`, `bench projector`).

A seed draws the data order and the initialisation, so the per-seed difference removes what the seed
alone explains. The t quantile comes from the regularised incomplete beta function (no SciPy).
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

import numpy as np


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on `t_cdf`; t_quantile(0.975, 2) = 4.303)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mean_sd(xs: Sequence[Optional[float]]) -> Optional[dict]:
    """{mean, sd, n} of the values that exist (sd 0.0 for one value), or None when there are none."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def paired(arm: Sequence[Optional[float]], base: Sequence[Optional[float]], level: float = 0.95) -> Optional[dict]:
    """Per-seed differences arm - base (seeds where both exist): {mean, lo, hi, n, diffs,
    excludes_zero}. With one seed there is no interval (lo = hi = None)."""
    d = [float(a) - float(b) for a, b in zip(arm, base) if a is not None and b is not None]
    if not d:
        return None
    mean = statistics.fmean(d)
    if len(d) < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": 1, "diffs": d, "excludes_zero": False}
    half = t_quantile(0.5 + level / 2, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": len(d), "diffs": d,
            "excludes_zero": mean - half > 0 or mean + half < 0}


def paired_bootstrap(a: list, b: list, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """The mean of a - b over seeds and prompts, with a percentile interval from resampling both: a,
    b [seeds][prompts] of per-prompt scores (1 / 0), paired by seed and prompt. Each resample draws
    seeds with replacement and, apart, prompts with replacement (the same draw for both arms): the
    interval carries both sources of error."""
    x = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)  # [S, N]
    rng = np.random.default_rng(seed)
    S, N = x.shape
    means = np.empty(n_boot)
    for i in range(n_boot):
        means[i] = x[rng.integers(0, S, S)][:, rng.integers(0, N, N)].mean()
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": float(x.mean()), "lo": float(lo), "hi": float(hi), "n": int(S), "prompts": int(N),
            "excludes_zero": bool(lo > 0 or hi < 0)}


def fmt_interval(p: Optional[dict], digits: int = 3, scale: float = 1.0) -> str:
    """'-0.012 [-0.020, -0.004] *' (a star: the interval excludes 0), or '—'."""
    if p is None:
        return "—"
    m = p["mean"] * scale
    if p["lo"] is None:
        return f"{m:+.{digits}f}"
    star = " *" if p["excludes_zero"] else ""
    return f"{m:+.{digits}f} [{p['lo'] * scale:+.{digits}f}, {p['hi'] * scale:+.{digits}f}]{star}"


def guarded_verdict(gain: Optional[dict], ce: Optional[dict], entropy: Optional[float], ce_margin: float,
                    entropy_floor: float, min_gain: float = 0.0) -> str:
    """An arm's verdict against its base that cannot reward a broken student. gain: the paired
    difference in the figure the arm is meant to improve, signed so that larger is better
    (`paired`); ce: the paired test-CE difference (arm - base); entropy: the arm's samples' mean
    entropy (nats/token). "collapsed" when the entropy is below `entropy_floor`, whatever else;
    "helps" when the gain's 95 % interval excludes 0 with a mean of at least `min_gain`, AND the
    test CE is not worse by more than `ce_margin` (the interval's upper end: non-inferiority);
    "worse test CE" when the gain holds but the guard does not; "hurts" when the gain's interval is
    below 0; else "no measurable gain"."""
    if entropy is not None and entropy < entropy_floor:
        return "collapsed"
    if gain and gain["excludes_zero"] and gain["mean"] >= max(min_gain, 0.0) and gain["mean"] > 0:
        upper = None if not ce else (ce["hi"] if ce["hi"] is not None else ce["mean"])
        return "helps" if upper is not None and upper <= ce_margin else "worse test CE"
    if gain and gain["excludes_zero"] and gain["mean"] < 0:
        return "hurts"
    return "no measurable gain"


def bracketed(run, multiples: Sequence[float], better, extend: int) -> tuple[float, dict, bool]:
    """A learning rate whose best sits inside its grid: `run(m)` at every multiple `m`, the best by
    `better(result)` (a sort key, larger is better); while the best is the grid's lowest or highest
    multiple, one more multiple past that edge (the grid's own ratio), at most `extend` times.
    Returns (the best multiple, {multiple: result}, whether it still sits on an edge)."""
    grid: dict = {}
    todo = sorted(multiples)
    for _ in range(extend + 1):
        for m in todo:
            if m not in grid:
                grid[m] = run(m)
        best = max(grid, key=lambda m: better(grid[m]))
        ms = sorted(grid)
        if len(ms) < 2 or best not in (ms[0], ms[-1]):
            break
        ratio = ms[1] / ms[0] if best == ms[0] else ms[-1] / ms[-2]
        todo = [ms[0] / ratio] if best == ms[0] else [ms[-1] * ratio]
    ms = sorted(grid)
    return best, grid, len(ms) > 1 and best in (ms[0], ms[-1])
