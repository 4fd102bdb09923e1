"""`kava-ray bench heal --quick` end to end on tiny models: the gate, the warm start, every arm over one cache,
the paired table, both plots, the JSON; and the gate refusing a teacher that is no better than its student."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from jobs import write_job


@pytest.fixture(scope="module")
def trained_teacher(tmp_path_factory):
    """A 4-layer tiny Llama trained for a few dozen steps on the Python docs (byte tokens): a teacher that knows
    the text better than a copy of it with half its layers dropped."""
    from kava_ray.core.models import load_model, load_tokenizer
    from kava_ray.data.corpus import pydoc_topics
    from kava_ray.testing.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("heal") / "teacher", family="llama", num_layers=4,
                            hidden_size=64, num_heads=4, num_kv_heads=2, seed=5)
    model = load_model(path, dtype="float32").train()
    text = "\n".join(pydoc_topics().values())[:200_000]
    ids = torch.tensor(load_tokenizer(path)(text)["input_ids"], dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=g)
        batch = torch.stack([ids[s:s + 64] for s in starts])
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(path)
    return path


def heal_job(tmp_path, teacher, student_keep=(0, 3)):
    return write_job(tmp_path, teacher, teacher, teacher,
                     teachers=[{"name": "tiny", "model": str(teacher), "dtype": "float32"}],
                     student={"model": str(teacher), "dtype": "float32", "keep_layers": list(student_keep)})


@pytest.fixture(scope="module")
def heal_out(tmp_path_factory):
    """The quick bench's --out, shared: the on-policy arms below start from its teacher cache and warm start."""
    return tmp_path_factory.mktemp("heal_out") / "heal"


def test_bench_heal_quick_end_to_end(ray_session, trained_teacher, heal_out, tmp_path, capsys):
    from kava_ray.bench.heal import DEFAULT_ARMS as ARMS
    from kava_ray.bench.heal import format_heal, run_heal_bench
    from kava_ray.cli.shared import print_json_last

    job = heal_job(tmp_path, trained_teacher)
    r = run_heal_bench(str(job), quick=True, out=str(heal_out), min_gap=0.02, progress=False)
    assert r["gate"]["gap"] >= 0.02 and r["gate"]["teacher_ce"] < r["gate"]["student_ce"]
    assert r["ce_start"] < r["gate"]["student_ce"]  # the shared warm start already healed some of it
    assert Path(r["out"], "warm_start", "config.json").is_file()
    w = r["warm_start"]  # CE every 2 steps until a stretch gains < 0 nats, at most 4 steps
    assert [s for s, _ in w["curve"]] == [0, 2, 4][:len(w["curve"])] and w["steps"] == w["curve"][-1][0]
    assert w["flattened"] == (w["curve"][-2][1] - w["curve"][-1][1] < 0) and (w["flattened"] or w["steps"] == 4)
    assert list(r["summary"]) == list(ARMS) and all(len(r["runs"][a]) == 2 for a in ARMS)
    # the KV weights come from the gradient they give: the 1x arms' KV gradient equals CE's at the warm start
    calib = r["kv_calibration"]
    assert calib["ratio_at_1"] > 0 and calib["weights"]["ce+kv"] == pytest.approx(1 / calib["ratio_at_1"])
    assert calib["weights"]["ce+kv-0.3"] == pytest.approx(0.3 / calib["ratio_at_1"])
    # each arm's rate is the grid's best by validation CE on seed 0, and its test seeds (1, 2: not 0) train at it
    assert all([x["seed"] for x in r["runs"][a]] == [1, 2] for a in ARMS) and r["test_seeds"] == [1, 2]
    for arm, v in r["lr"].items():
        runs = r["runs"][arm]
        assert all(run["lr"] == v["lr"] for run in runs), arm
        if arm != "kv-only":
            assert len(v["grid"]) == 2 and v["grid"][str(v["lr"])] == min(v["grid"].values()), arm
    assert r["lr"]["kv-only"]["lr"] == r["lr"]["ce"]["lr"] and r["kv_control"]["start"] == r["start"]["kv_cos_free"]
    # the other-batch arm reads other blocks' KV: same CE data, another target
    assert r["runs"]["ce+kv-otherbatch"][0]["figures"] != r["runs"]["ce+kv"][0]["figures"]
    assert Path(r["out"], "kv_cache_nf4", "manifest.json").is_file() and r["nf4"]["cached_blocks"] > 0
    # the hidden-state arm reads a cache with the teacher's hidden states, at Minitron's α fixed at the warm start
    hidden_meta = json.loads(Path(r["out"], "kv_cache_hidden", "manifest.json").read_text())["meta"]
    assert hidden_meta["hidden"] is True and r["hidden"]["cached_blocks"] == r["cached_blocks"]
    assert calib["hidden_unit"] == pytest.approx(calib["logit_kl_at_start"] / calib["hidden_loss_at_1"])
    for arm, runs in r["runs"].items():
        for run in runs:
            f = run["figures"]
            assert math.isfinite(f["test_ce"]) and math.isfinite(f["gr"]) and f["kl"] > 0, arm
            assert f["kv_cos_free"] is not None and -1 <= f["kv_cos_free"] <= 1, arm  # direct: the layers' sources
            assert [s for s, _ in run["curve"]] == [0, 3], arm
        if arm != "ce":
            d = r["summary"][arm]["vs_base"]["test_ce"]
            assert d["n"] == 2 and d["lo"] <= d["mean"] <= d["hi"], arm
            assert r["summary"][arm]["decision"]["verdict"] in ("helps", "hurts", "no measurable gain")
    # seed 1's arms saw the same blocks: their first eval (step 0, the warm start) is the same number
    assert len({runs[0]["curve"][0][1] for runs in r["runs"].values()}) == 1
    assert r["teacher_forwards_per_sample"] == 1.0
    # heal_job.yaml (what `kava-ray tune --space heal_kv` trains) reads the bench's teacher cache: the warm
    # start's layers map to their source layers, the ones the cache holds
    from kava_ray.common.config import load_config
    from kava_ray.core.plans import student_geometry, student_tokenizer, teacher_plans
    from kava_ray.data.splits import load_splits
    from kava_ray.runtime.job import kv_source

    tuned = load_config(r["job"], ["loss.kv_parts=keys", "align.projector.kind=elastic"])
    cache = json.loads(Path(tuned.data.kv_cache_dir, "manifest.json").read_text())["meta"]
    geoms = {n: t["geometry"] for n, t in cache["teachers"].items()}
    plans = teacher_plans(tuned.student, tuned.teachers, tuned.align, geoms, student_geometry(tuned.student))
    assert plans["tiny"].layers == cache["teachers"]["tiny"]["layers"] == [0, 3]
    kv_source(tuned, plans, load_splits(tuned.data, tuned.train,
                                        student_tokenizer(tuned.student)[0])[0].fingerprint)  # raises on a mismatch
    assert all(Path(p).stat().st_size > 0 for p in r["plots"].values())
    text = format_heal(r)
    assert "decision rule" in text and "positive control (ce+logits vs ce): " in text and "teacher tiny" in text
    assert "KV control (kv-only raises the projector-free KV cosine): " in text and "warm start" in text
    assert r["kv_decision"]["verdict"] in ("helps", "no measurable effect", "unsettled") and "KV rule" in text
    # a re-run into the same --out reads every finished run back: nothing trains again, the same figures
    again = run_heal_bench(str(job), quick=True, out=str(heal_out), min_gap=0.02, progress=False,
                           arms=["ce", "ce+logits"])
    assert again["runs"]["ce+logits"] == json.loads(json.dumps(r["runs"]["ce+logits"])) and (
        again["runs_wall_s"] == pytest.approx(sum(x["wall_s"] for a in ("ce", "ce+logits") for x in r["runs"][a])))
    capsys.readouterr()
    print_json_last(r)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"gate", "summary", "runs", "decision_rule", "control_passes", "wall_s"} <= set(out)


def test_bench_heal_onpolicy_quick_pairs_the_on_policy_arms_against_off_policy_kd(ray_session, trained_teacher,
                                                                                  heal_out, tmp_path):
    """`bench heal --onpolicy --quick` from the quick bench's warm start (same --out): prompt/completion records cut
    from the same text, the four arms paired over seeds, each scored by the teacher on the student's own held-out
    samples; seq_kd's teacher wrote one completion per training sample, the others none."""
    from kava_ray.bench.heal import run_heal_bench
    from kava_ray.bench.heal_onpolicy import OP_ARMS, OP_BASE, format_onpolicy

    job = heal_job(tmp_path, trained_teacher)
    r = run_heal_bench(str(job), quick=True, out=str(heal_out), min_gap=0.02, progress=False, onpolicy=True)
    o = r["onpolicy"]
    assert list(o["runs"]) == list(OP_ARMS) and all(len(rs) == 2 for rs in o["runs"].values())
    recs = [json.loads(x) for x in Path(o["records"], "test.jsonl").read_text().splitlines()]
    assert recs and all(set(x) == {"prompt", "completion"} for x in recs)
    assert o["start"]["tokens"] > 0 and math.isfinite(o["start"]["rkl"])
    for arm, rs in o["runs"].items():
        for run in rs:
            f = run["figures"]
            assert math.isfinite(f["test_ce"]) and math.isfinite(f["rkl"]) and f["teacher_nll"] > 0, arm
            assert run["teacher_rows_per_sample"] == pytest.approx(1.0), arm  # one scoring forward per sample
            assert run["teacher_written_per_sample"] == (1.0 if arm == "seq_kd" else 0.0), arm
            assert (run["sampled_tokens"] > 0) == arm.startswith("onpolicy"), arm
    s = o["summary"]
    assert "vs_start" in s[OP_BASE] and all("vs_base" in s[a] and "decision" in s[a] for a in OP_ARMS if a != OP_BASE)
    text = format_onpolicy(r)
    assert "reverse KL of own samples" in text and "harness control" in text and "decision rule" in text


def test_the_gate_refuses_a_teacher_no_better_than_its_student(tmp_path, tiny_student_dir):
    from kava_ray.bench.heal import run_heal_bench
    from kava_ray.common.errors import KavaError

    job = heal_job(tmp_path, tiny_student_dir, student_keep=(0, 1))  # a random teacher: a copy is as good
    with pytest.raises(KavaError, match="is not 1 nat.* better than the student") as e:
        run_heal_bench(str(job), quick=True, out=str(tmp_path / "heal"), progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "heal" / "warm_start").exists()
    assert not (tmp_path / "heal" / "kv_cache").exists()  # refused before any teacher ran
    # a typo in a --recipe arm: one line naming the recipe and the key, before the gate loads any model
    with pytest.raises(KavaError, match=r"--recipe kv: config key 'loss.kv_weigth': unknown key") as e:
        run_heal_bench(str(job), quick=True, out=str(tmp_path / "typo"), progress=False,
                       arm_overrides={"kv": {"loss.kv_weigth": 0.3}})
    assert "\n" not in str(e.value) and not (tmp_path / "typo").exists()


def test_a_recipe_base_pairs_every_arm_against_it_and_leaves_the_control_unjudged():
    """`--base NAME`: a tuned recipe is judged against ce at its own learning rate, not the default ce."""
    from kava_ray.bench.heal import summarize

    def runs(ces):
        return [{"figures": {"test_ce": c, "gr": -c, "kl": 1.0, "top1": 0.5, "kv_cos_free": 0.3}, "step_s": 1.0}
                for c in ces]

    arms = {"ce": runs([7.0, 7.1, 7.2]), "ce_fast": runs([6.6, 6.7, 6.8]), "kv_fast": runs([6.59, 6.71, 6.79])}
    s = summarize(arms, "ce_fast")
    assert "vs_base" not in s["ce_fast"] and "decision" not in s["ce_fast"]
    d = s["kv_fast"]["vs_base"]["test_ce"]
    assert d["diffs"] == pytest.approx([-0.01, 0.01, -0.01]) and not d["excludes_zero"]
    assert s["kv_fast"]["decision"]["verdict"] == "no measurable gain"
    assert s["ce"]["decision"]["verdict"] == "hurts"  # the default ce, 0.4 nats behind ce at the tuned rate
    assert summarize(arms)["ce_fast"]["decision"]["verdict"] == "helps"  # against ce, the learning rate "helps"


def test_a_recipe_reads_its_items_as_override_lines():
    from kava_ray.bench.heal import parse_recipe
    from kava_ray.common.errors import KavaError

    assert parse_recipe("tuned:optim.lr_student=1.0e-4,loss.kv_parts=keys") == \
        ("tuned", {"optim.lr_student": 1e-4, "loss.kv_parts": "keys"})
    for bad, words in (("ce:train.steps=2", "with a new name"), ("x:train.steps", "is not key=value"),
                       ("x:train..steps=2", "expected KEY=VALUE")):
        with pytest.raises(KavaError, match=words):
            parse_recipe(bad)


def test_the_on_policy_verdict_never_calls_a_broken_student_helps():
    """The guards of `bench heal --onpolicy`'s rule (and the task bench's), on the figures of the run that labelled
    two broken arms "helps" (docs/results.md): the sampled reverse KL's collapse (entropy 0.0001 against the warm
    start's 5.27, test CE +40 nats) is "collapsed", JSD's lower reverse KL at +3.4 nats of test CE is "worse test CE";
    the same gain within the test-CE margin is "helps"."""
    from kava_ray.bench.heal_onpolicy import CE_MARGIN, ENTROPY_FLOOR, MIN_RKL
    from kava_ray.bench.stats import guarded_verdict

    def iv(mean, lo, hi):
        return {"mean": mean, "lo": lo, "hi": hi, "n": 5, "excludes_zero": lo > 0 or hi < 0}

    floor = ENTROPY_FLOOR * 5.2727
    gain = iv(1.1409, 0.6864, 1.5955)  # reverse KL lowered by 1.14 nats/token (a gain: sign flipped)
    assert guarded_verdict(gain, iv(40.24, 37.98, 42.50), 0.0001, CE_MARGIN, floor, MIN_RKL) == "collapsed"
    assert guarded_verdict(iv(1.0769, 0.5797, 1.5742), iv(3.36, 2.91, 3.81), 4.76, CE_MARGIN, floor,
                           MIN_RKL) == "worse test CE"
    assert guarded_verdict(gain, iv(0.01, -0.05, 0.07), 4.9, CE_MARGIN, floor, MIN_RKL) == "helps"
    assert guarded_verdict(iv(-0.3, -0.5, -0.1), iv(0.0, -0.1, 0.1), 4.9, CE_MARGIN, floor, MIN_RKL) == "hurts"
    assert guarded_verdict(iv(0.02, 0.01, 0.03), iv(0.0, -0.1, 0.1), 4.9, CE_MARGIN, floor, MIN_RKL) == \
        "no measurable gain"  # below the minimum gain


def test_a_learning_rate_grid_is_extended_until_its_best_is_inside():
    """`stats.bracketed` (both heal benches and the task bench): a best on the grid's edge adds a rate past it, at
    the grid's own ratio, until the best is inside or the extensions run out (then it says so)."""
    from kava_ray.bench.stats import bracketed

    calls = []

    def run(m):  # validation loss, best at 16x: three extensions past the top of (1, 2, 4)
        calls.append(m)
        return {"val_ce": (m - 16) ** 2}

    best, grid, on_edge = bracketed(run, (1.0, 2.0, 4.0), lambda r: -r["val_ce"], extend=3)
    assert (best, sorted(grid), on_edge) == (16.0, [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], False) and len(calls) == 6
    best, grid, on_edge = bracketed(run, (1.0, 2.0, 4.0), lambda r: -r["val_ce"], extend=1)
    assert (best, on_edge) == (8.0, True)  # out of extensions: still on the edge, and said
    best, grid, on_edge = bracketed(lambda m: {"val_ce": (m - 0.25) ** 2}, (1.0, 2.0), lambda r: -r["val_ce"], 2)
    assert (best, sorted(grid), on_edge) == (0.25, [0.25, 0.5, 1.0, 2.0], True)  # downwards too


@pytest.mark.unit
def test_the_kv_rule_helps_settles_no_effect_and_counts_the_seeds_an_unsettled_result_needs():
    """Run 2's rule on hand-made test CEs over 5 seeds: KV 0.1 nats below logits with a tight spread and below its
    other-batch control -> helps; the same gain matched by the control -> not 'helps' (the interval against the
    control holds 0); a difference of 0.01 ± 0.005 -> no measurable effect; a mean of -0.03 with a wide spread ->
    unsettled, with the seeds a t-interval of that spread would need (more than the 5 run)."""
    from kava_ray.bench.heal import CONTROL, KV_ARM, KV_OTHER, kv_decision

    logits = [3.0, 3.1, 2.9, 3.05, 2.95]
    runs = {CONTROL: logits, KV_ARM: [x - 0.1 + e for x, e in zip(logits, (0.01, -0.01, 0.0, 0.005, -0.005))],
            KV_OTHER: logits}
    mk = lambda d: {a: [{"figures": {"test_ce": c}} for c in v] for a, v in d.items()}  # noqa: E731
    assert kv_decision(mk(runs))["verdict"] == "helps"
    matched = dict(runs, **{KV_OTHER: runs[KV_ARM]})
    d = kv_decision(mk(matched))
    assert d["verdict"] == "unsettled" and d["kv_vs_control"]["mean"] == 0.0
    small = dict(runs, **{KV_ARM: [x + 0.01 + e / 2 for x, e in zip(logits, (0.01, -0.01, 0.0, 0.005, -0.005))]})
    assert kv_decision(mk(small))["verdict"] == "no measurable effect"
    wide = dict(runs, **{KV_ARM: [x - 0.03 + e for x, e in zip(logits, (0.2, -0.2, 0.1, -0.1, -0.15))]})
    d = kv_decision(mk(wide))
    assert d["verdict"] == "unsettled" and d["seeds_needed"] > 5
    assert kv_decision(mk({CONTROL: logits, KV_ARM: logits})) is None  # the control arm did not run
    # Part B: each projector arm against logits alone, no control: a tight 0.1-nat gain helps, a tight 0.17-nat loss
    # is "unsettled" by the rule's letter and said to be worse (no seed count offered), a wide one counts its seeds
    gain = [x - 0.1 + e for x, e in zip(logits, (0.01, -0.01, 0.0, 0.005, -0.005))]
    proj = kv_decision(mk({CONTROL: logits, "ce+logits+kv-fit": gain, "ce+logits+kv-linear": [x + 0.27 for x in gain],
                           "ce+logits+kv-elastic": wide[KV_ARM]}))["projectors"]
    assert proj["ce+logits+kv-fit"]["verdict"] == "helps"
    assert proj["ce+logits+kv-linear"]["verdict"] == "unsettled" and proj["ce+logits+kv-linear"]["worse"]
    assert proj["ce+logits+kv-linear"]["seeds_needed"] is None and proj["ce+logits+kv-elastic"]["seeds_needed"] > 5


def test_bench_heal_width_pruned_student_takes_the_kv_through_each_projector(ray_session, trained_teacher, tmp_path):
    """`--width-kv 1` (Run 2's real projector): the student is the layer-dropped copy with its attention cut to 1 of
    the teacher's 2 KV groups per layer (the most active kept), so its KV is [1, 16] where the teacher's is [2, 16];
    the layer map stays identity (the cache holds the copied layers), and each projector arm trains at the KV weight
    measured through its own projector."""
    from kava_ray.bench.heal import WIDTH_ARMS, format_heal, run_heal_bench
    from kava_ray.core.models import kv_geometry, load_model

    out = tmp_path / "width"
    r = run_heal_bench(str(heal_job(tmp_path, trained_teacher)), quick=True, out=str(out), min_gap=0.02,
                       progress=False, width_kv=1)
    assert r["arms"] == list(WIDTH_ARMS) and all(len(r["runs"][a]) == 2 for a in WIDTH_ARMS)
    w = r["width"]
    assert w["kv_groups"] == 1 and len(w["kept"]) == 2 and all(len(k) == 1 for k in w["kept"])
    g = kv_geometry(load_model(str(out / "student-kv1"), dtype="float32").config)
    assert (g.num_kv_heads, g.head_dim) == (1, 16)
    units = r["kv_calibration"]["units"]
    assert set(units) == {"linear", "fit", "elastic"} and all(u > 0 for u in units.values())
    for arm in WIDTH_ARMS:
        assert all(math.isfinite(x["figures"]["test_ce"]) for x in r["runs"][arm]), arm
    text = format_heal(r)
    assert "width-pruned student: 1 KV group(s) per layer" in text
    assert set(r["kv_decision"]["projectors"]) == set(WIDTH_ARMS[1:]) and "KV through this projector" in text
