"""`kava-ray bench scarce` (Run 1): the paired bootstrap over seeds and prompts against hand cases, the decision's
guards (a collapsed arm never helps, a failed positive control is said), and `--quick` end to end on tiny models
through the real CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kava_ray.bench.scarce import ARMS, BASE, CONTROL, decide_scarce
from kava_ray.bench.stats import paired_bootstrap
from kava_ray.bench.task_records import sort_rows
from kava_ray.cli import main

pytestmark = pytest.mark.unit


def test_the_sort_rows_are_the_readmes_file_split_as_bench_task_splits_it():
    """The sort snippet of docs/results.md, byte for byte: 1,200 distinct prompts, each completion its prompt's
    numbers sorted."""
    rows = sort_rows({"train": 2000, "validation": 64, "test": 256})
    assert [len(rows[s]) for s in ("test", "validation", "train")] == [256, 64, 880]
    every = [r for s in rows.values() for r in s]
    assert len({r["question"] for r in every}) == 1200
    for r in every:
        xs = [int(x) for x in r["question"].rsplit(": ", 1)[1].split()]
        assert r["answer"] == " ".join(map(str, sorted(xs)))


def test_the_paired_bootstrap_carries_both_seeds_and_prompts():
    """A constant per-prompt difference has a zero-width interval at it; a difference that lives in one seed only
    is wide (seeds resampled); one that lives in a few prompts only is wide too (prompts resampled)."""
    a = np.ones((4, 50))
    b = np.zeros((4, 50))
    r = paired_bootstrap(a, b, 500)
    assert r["mean"] == r["lo"] == r["hi"] == 1.0 and r["excludes_zero"]
    one_seed = np.zeros((4, 50))
    one_seed[0] = 1
    r = paired_bootstrap(one_seed, b, 500)
    assert r["mean"] == pytest.approx(0.25) and r["lo"] == 0.0 and r["hi"] >= 0.5 and not r["excludes_zero"]
    few = np.zeros((4, 50))
    few[:, :2] = 1  # every seed gains on the same 2 prompts of 50
    r = paired_bootstrap(few, b, 500)
    assert r["mean"] == pytest.approx(0.04) and r["lo"] == 0.0 and not r["excludes_zero"]


def _runs(gain: float, entropy: float) -> dict:
    rng = np.random.default_rng(0)

    def arm(p, ent):
        return [{"ok": (rng.random(200) < p).astype(int).tolist(), "figures": {"test_ce": 1.0, "entropy": ent}}
                for _ in range(4)]
    return {BASE: arm(0.3, 2.0), CONTROL: arm(0.3 + gain, entropy), "seqkd-opd": arm(0.9, 0.1)}


def test_the_decision_never_rewards_a_collapsed_arm_and_says_when_the_control_fails():
    d = decide_scarce(_runs(0.4, 2.0), floor=1.0, n_boot=300)
    assert d["control_passes"] and d["control"]["verdict"] == "helps"
    assert d["vs_base"]["seqkd-opd"]["verdict"] == "collapsed"  # right far more often, at entropy 0.1 < floor 1
    assert d["vs_seqkd"]["seqkd-opd"]["verdict"] == "collapsed"
    d = decide_scarce(_runs(0.0, 2.0), floor=1.0, n_boot=300)
    assert not d["control_passes"]


def test_bench_scarce_quick_through_the_cli(tmp_path, capsys):
    out = tmp_path / "scarce"
    code = main(["bench", "scarce", "--quick", "--out", str(out), "--json"])
    stdout = capsys.readouterr().out
    assert code == 0
    r = json.loads(stdout.strip().splitlines()[-1])
    assert r["arms"] == list(ARMS) and "positive control (seqkd - sft-gold)" in stdout
    for arm in ARMS:
        assert [x["seed"] for x in r["runs"][arm]] == [1, 2]  # the test seeds; the selection seed 0 chose the rate
        assert all(len(x["ok"]) == 8 and len(x["curve"]) == 4 for x in r["runs"][arm])  # steps 0..3, a point each
        assert r["lr"][arm]["grid"]
    assert r["runs"]["seqkd-opd"][0]["curve"][-1][0] == 3
    assert r["teacher_train"] <= 32 and (out / "bench_scarce.json").is_file()
    assert main(["bench", "scarce", "--quick", "--out", str(out), "--arms", "seqkd", "opd"]) == 2
    assert "arms must be among" in capsys.readouterr().err
