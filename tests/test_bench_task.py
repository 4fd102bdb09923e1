"""`kava-ray bench task`: the records and their refusals, the decision rule's guards (a collapsed arm never helps),
the TRL arm's pinned generation config, and `--quick` end to end on tiny models (the gate, the table's rows, TRL's
GKDTrainer ran and trained) through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kava_ray.bench.stats import paired
from kava_ray.bench.task import ARMS, QUICK_ARMS, samples_own
from kava_ray.bench.task_finetune import plateaued
from kava_ray.bench.task_records import (
    SPECIALISTS,
    TASKS,
    arith_rows,
    file_rows,
    synthetic_rows,
    write_records,
)
from kava_ray.bench.task_report import BASE, CE_MARGIN, decide, pair, summarize
from kava_ray.bench.task_trl import pin_generation_config
from kava_ray.cli import main
from kava_ray.common.errors import KavaError
from kava_ray.data.answers import correct

COUNTS = {"train": 8, "validation": 2, "test": 2}


def _cli(capsys, *args):
    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_synthetic_records_are_routed_by_template_half_and_checked_by_final_number():
    rows = synthetic_rows({"train": 64, "validation": 4, "test": 4})
    assert {r["teacher"] for r in rows["train"]} == set(SPECIALISTS)
    assert not {r["question"] for r in rows["train"]} & {r["question"] for r in rows["test"]}
    gold = rows["test"][0]["answer"]
    assert correct("number", "blah\n#### " + gold.rsplit("####", 1)[1].strip(), gold)
    assert not correct("number", "no number here", gold)
    assert correct("exact", " 42 \n", "42") and not correct("exact", "42.", "42")


def test_the_arith_task_is_right_distinct_across_splits_and_routed_by_operator():
    """The default task's records: every worked answer's final number is the question's value (Python evaluates
    it left to right, as the answer works it), no question in two splits, products routed to spec-b."""
    rows = arith_rows({"train": 400, "validation": 16, "test": 16})
    assert TASKS["arith"] is arith_rows and [len(rows[s]) for s in ("train", "validation", "test")] == [400, 16, 16]
    seen = [r["question"] for s in rows for r in rows[s]]
    assert len(seen) == len(set(seen))
    for r in rows["train"]:
        expr = r["question"].removeprefix("What is ").removesuffix("?")
        assert correct("number", r["answer"], f"#### {eval(expr)}") and eval(expr) > 0, r
        assert r["teacher"] == ("spec-b" if "*" in expr else "spec-a")
    assert {r["teacher"] for r in rows["train"]} == set(SPECIALISTS)
    assert arith_rows({"train": 400, "validation": 16, "test": 16}) == rows  # seeded: the cache finds its teachers


@pytest.mark.parametrize("line, checker, says", [
    ("not json", "number", "line 1 is not JSON"),
    ('{"prompt": "q"}', "number", "line 1 needs a non-empty string \"prompt\" and \"completion\""),
    ('{"prompt": "q", "completion": "no number"}', "number", "line 1: the completion has no final number"),
])
def test_a_bad_records_file_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, line, checker, says):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    out = tmp_path / "out"
    code, stdout, err = _cli(capsys, "bench", "task", "--quick", "--records", bad, "--checker", checker, "--out", out)
    assert code == 2 and err.strip().startswith("error: bench task:") and says in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("args, says", [(["--task", "gsm8k", "--records", "x.jsonl"], "give one"),
                                        (["--task", "arithmetic"], "--task 'arithmetic': one of arith, gsm8k")])
def test_a_wrong_task_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, args, says):
    out = tmp_path / "out"
    code, stdout, err = _cli(capsys, "bench", "task", "--quick", *args, "--out", out)
    assert code == 2 and err.strip().startswith("error: bench task:") and says in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_records_file_that_repeats_a_prompt_is_refused(tmp_path):
    """A repeated prompt could land in train and test: a test score that measures memory, so refused."""
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i % 15}", "completion": f"#### {i}"}) + "\n" for i in range(20)))
    with pytest.raises(KavaError, match="record 16's prompt is record 1's too"):
        file_rows(str(f), "number", COUNTS)


def test_records_file_needs_enough_rows_and_two_teachers(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"#### {i}", "teacher": f"t{i % 3}"}) + "\n"
                         for i in range(20)))
    with pytest.raises(KavaError, match="must name one of two teachers"):
        file_rows(str(f), "number", COUNTS)
    f.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"#### {i}"}) + "\n" for i in range(4)))
    with pytest.raises(KavaError, match="has 4 records; needs at least 5"):
        file_rows(str(f), "number", COUNTS)


def test_a_records_file_splits_by_seed_and_routes_its_two_halves(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "completion": f"{i} + 1 = {i + 1}\n#### {i + 1}",
                                     "teacher": "even" if i % 2 == 0 else "odd"}) + "\n" for i in range(20)))
    rows = file_rows(str(f), "number", COUNTS)
    assert [len(rows[s]) for s in ("train", "validation", "test")] == [8, 2, 2]
    assert rows == file_rows(str(f), "number", COUNTS)  # the same split every time
    rec = write_records(rows, tmp_path / "records", "number")
    assert rec.specialists == ("even", "odd")
    assert all("teacher" not in r for r in rec.rows("train"))  # the plain records: every arm but mopd
    assert [r["teacher"] for r in rec.rows("train", rec.routed)] == [r["teacher"] for r in rows["train"]]
    even = rec.rows("train", rec.halves["even"])
    assert even and all(int(r["question"].split()[2]) % 2 == 0 for r in even)


def test_a_fine_tune_flat_at_zero_has_not_plateaued_before_its_least_steps():
    flat0 = [(0, {"em": 0.0}), (12, {"em": 0.0})]
    assert not plateaued(flat0, patience=1, delta=0.02, min_step=36)  # it has not learnt the format yet
    assert plateaued(flat0 + [(24, {"em": 0.1}), (36, {"em": 0.11})], patience=1, delta=0.02, min_step=36)
    assert not plateaued(flat0 + [(24, {"em": 0.1}), (36, {"em": 0.2})], patience=1, delta=0.02, min_step=36)


def test_decision_guards_a_collapsed_arm_never_helps():
    base, arm = [0.10, 0.12, 0.08, 0.11, 0.09], [0.30, 0.33, 0.29, 0.31, 0.35]
    em = paired(arm, base)
    assert em["excludes_zero"] and em["mean"] > 0.2
    ce_same = paired([1.0] * 5, [1.0] * 5)
    assert decide(em, ce_same, entropy=0.5, floor=0.2) == {"helps": True, "verdict": "helps"}
    assert decide(em, ce_same, entropy=0.05, floor=0.2)["verdict"] == "collapsed"  # the gain does not matter
    ce_worse = paired([1.0 + 2 * CE_MARGIN] * 5, [1.0] * 5)
    assert not decide(em, ce_worse, entropy=0.5, floor=0.2)["helps"]
    assert decide(paired(base, arm), ce_same, 0.5, 0.2)["verdict"] == "hurts"

    def run(em_, ent):
        return {"figures": {"em": em_, "test_ce": 1.0, "rkl": 0.1, "entropy": ent}, "s_per_step": 1.0,
                "wall_s": 1.0, "teacher_rows_per_sample": 1.0, "teacher_written_per_sample": 0.0,
                "generated_per_sample": 10.0}
    s = summarize({BASE: [run(b, 0.5) for b in base], "collapsed-arm": [run(a, 0.01) for a in arm]}, floor=0.2)
    assert s["collapsed-arm"]["decision"] == {"helps": False, "verdict": "collapsed"}
    assert s["collapsed-arm"]["vs_base"]["em"]["excludes_zero"]  # it did gain exact match: still not "helps"
    # an on-policy arm that sampled no token trained on nothing of its own: its verdict says that, not a gain
    silent = [dict(run(a, 0.5), generated_per_sample=0.0) for a in arm]
    s = summarize({BASE: [run(b, 0.5) for b in base], "onpolicy-gkd": silent, "seq_kd": silent}, floor=0.2,
                  own_samples=["onpolicy-gkd"])
    assert s["onpolicy-gkd"]["decision"]["verdict"].startswith("sampled nothing")
    assert s["seq_kd"]["decision"]["verdict"] == "helps"  # (the teacher writes its samples: none of its own)
    assert samples_own("onpolicy-gkd") and samples_own("trl-gkd") and not samples_own("seq_kd")


def test_two_arms_doing_the_same_work_are_same_only_inside_the_margins_over_seeds_and_prompts():
    """kava-ray's GKD against TRL's (`task_report.pair`): an arm against a copy of itself is "same"; one that gets
    every prompt right against one that gets none "differs"; a copy on 8 prompts, where chance alone spreads the
    bootstrap past the 5-point margin, is "undecided at this size" - never "same" for want of data."""
    import random

    rng = random.Random(0)

    def runs(oks, ce=0.2):
        return [{"figures": {"ok": o, "em": sum(o) / len(o), "test_ce": ce + 0.001 * i}, "s_per_step": 1.0}
                for i, o in enumerate(oks)]

    many = [[rng.random() < 0.5 for _ in range(400)] for _ in range(5)]
    same = pair({"a": runs(many), "b": runs(many)}, "a", "b")
    assert same["parity"] == "same" and same["em_sp"]["prompts"] == 400 and same["em_sp"]["mean"] == 0
    noisy = pair({"a": runs([[rng.random() < 0.5 for _ in range(8)] for _ in range(5)]),
                  "b": runs([[rng.random() < 0.5 for _ in range(8)] for _ in range(5)])}, "a", "b")
    assert noisy["parity"] == "undecided at this size", noisy["em_sp"]
    apart = pair({"a": runs([[1] * 64] * 5), "b": runs([[0] * 64] * 5)}, "a", "b")
    assert apart["parity"] == "differs" and apart["em_sp"]["lo"] == 1.0
    old = pair({"a": [{**r, "figures": {k: v for k, v in r["figures"].items() if k != "ok"}} for r in runs(many)],
                "b": runs(many)}, "a", "b")  # a run saved before per-prompt scores were kept
    assert old["em_sp"] is None and old["parity"] == "undecided at this size"


def test_trl_arm_pins_the_students_generation_config(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.generation_config.repetition_penalty, model.generation_config.min_p = 1.5, 0.2
    eos = model.generation_config.eos_token_id
    pin_generation_config(model)
    # what GKDTrainer passes (its own fields), resolved as transformers 5 fills the unset ones from the model's
    resolved, _ = model._prepare_generation_config(GenerationConfig(max_new_tokens=4, temperature=1.0, do_sample=True,
                                                                    top_k=0, top_p=1.0))
    assert resolved.repetition_penalty in (None, 1.0) and not resolved.min_p
    assert resolved.eos_token_id == eos


@pytest.mark.parametrize("argv, line", [
    (["--steps", "-1"], "bench task: --steps -1: give at least 1 student step per arm"),
    (["--seeds", "0"], "bench task: --seeds 0: give at least 2 (the intervals are paired over seeds)"),
    (["--arms", "sft", "onpolicy-gdk"], "bench task: --arms 'onpolicy-gdk' is not an arm (did you mean "
                                        "'onpolicy-gkd'?); the arms: "),
    (["--arms", "onpolicy-gkd"], "bench task: --arms must include 'sft' (every arm is compared with it)"),
    (["--min-start", "500"], "bench task: --min-start 500: a percentage from 0 to 100"),
    (["--min-gap", "-3"], "bench task: --min-gap -3: a percentage from 0 to 100"),
    (["--min-start", "90", "--min-gap", "20"], "bench task: no result on 128 test prompts can pass the gate (a warm "
                                               "start >= 90 % and >= 20 points below the teacher's)"),
])
def test_bench_task_flags_are_checked_on_their_own_before_anything(tmp_path, capsys, argv, line):
    """Each flag is one line naming it (the arms with a did-you-mean; the gate in the README's percent), exit 2,
    before any record, model or output dir is touched."""
    out = tmp_path / "task"
    code, _, err = _cli(capsys, "bench", "task", "--out", out, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {line}"), err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bench_task_quick_runs_on_its_own_as_a_harness_check(tmp_path):
    """`bench task --quick` alone: exit 0 with every arm's table; its tiny random models answer nothing, so its gate
    is stated as skipped and no verdict reads as a result."""
    out = tmp_path / "task"
    # the real command, in a process of its own: its imports' chatter (torchao, torch's deprecations, the weights'
    # and datasets' progress bars) goes to OUT/logs, and the console holds its own lines only
    proc = subprocess.run([str(Path(sys.executable).with_name("kava-ray")), "bench", "task", "--quick", "--out",
                           str(out), "--json"], capture_output=True, text=True, timeout=600)
    code, stdout, err = proc.returncode, proc.stdout, proc.stderr
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert all(line.startswith("[bench task] ") for line in err.splitlines()), err
    assert "Loading weights" in (out / "logs" / "driver.log").read_text()  # the bars: in the bench's log
    assert "gate: teacher 0.0 %, warm start 0.0 % exact match on 4 test prompts: skipped (--quick: " in err
    r = json.loads(stdout.strip().splitlines()[-1])
    assert r["gate"]["skipped"] and not r["gate"]["passes"]  # (what it would have said: the models score 0)
    assert r["arms"] == list(QUICK_ARMS)
    # one model for teacher and student (as the demo's job): the student starts from the fine-tuned teacher's layers
    assert r["finetunes"]["warm"]["from"] == r["finetunes"]["teacher"]["path"] and "warm start: " in stdout
    for arm in QUICK_ARMS:
        assert len(r["runs"][arm]) == 2 and arm in stdout
        assert len(r["lr"][arm]["grid"]) == 2
        assert r["summary"][arm]["decision"]["verdict"] == "— (--quick)"
    assert "skipped (--quick: tiny random models, a check of the harness, not a result)" in stdout
    trl = r["runs"]["trl-gkd"]
    assert all(t["teacher_rows_per_sample"] == 1.0 and t["loss"] is not None for t in trl)
    assert sum(t["generated_per_sample"] for t in trl) > 0  # GKD's coin (λ 0.5) sampled on some step
    assert all(t["figures"]["test_ce"] != r["start"]["test_ce"] for t in trl)  # it trained: the student moved
    assert r["summary"]["onpolicy-gkd"]["teacher_rows_per_sample"]["mean"] == 1.0
    assert r["summary"]["mopd"]["teacher_rows_per_sample"]["mean"] == 2.0  # both specialists score every row
    assert r["vs_trl"]["step_ratio"] > 0 and r["vs_trl"]["parity"] == "— (--quick)"  # 0 % against 0 %: no "same"
    assert "kava-ray onpolicy-gkd against TRL trl-gkd" in stdout and ARMS["mopd"].get("routed")
