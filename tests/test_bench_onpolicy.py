"""`kava-ray bench onpolicy` end to end on its tiny models (a few steps): the figures it reports are the ones it
measured, in the regime it says (no timing is asserted: timings are the bench's to report)."""

import pytest

from kava_ray.bench.onpolicy import format_onpolicy_bench, run_onpolicy_bench

pytestmark = pytest.mark.unit


def test_bench_onpolicy_reports_lag_0_and_lag_1_beside_teachers_as_busy_as_the_student():
    r = run_onpolicy_bench(steps=3, batch=2, new_tokens=4, warmup=1)
    alone, lag0, lag1 = r["alone"], r["lag0"], r["lag1"]
    assert r["teacher_s"] == pytest.approx(alone["sample_s"] + alone["train_s"])
    for d in (alone, lag0, lag1):
        assert d["steps"] == 2 and d["sample_s"] > 0 and d["train_s"] > 0 and d["wait_s"] >= 0
        assert d["tokens_per_s"] > 0
        assert d["step_s"] == pytest.approx(d["sample_s"] + d["wait_s"] + d["train_s"])
    assert r["lag1_over_hidden"] == pytest.approx(
        lag1["step_s"] / max(lag1["sample_s"] + lag1["train_s"], r["teacher_s"]))
    text = format_onpolicy_bench(r)
    assert "lag 1: step / max(S + T, D)" in text and "lag 0: step / (S + T + D)" in text
