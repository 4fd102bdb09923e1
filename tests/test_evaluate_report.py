"""evaluate.py (held-out CE, batched greedy generation, GSM8K scoring) and report.py (metrics -> plots + summary)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kava_ray.common.errors import KavaError
from kava_ray.core.models import load_model
from kava_ray.data import IGNORE_INDEX, Example, tokenize_split
from kava_ray.recipes.evaluate import generate_answers, gsm8k_accuracy, heldout_ce, score_answers
from kava_ray.recipes.report import phase, read_metrics, summarize_run, write_report

EXAMPLES = [
    Example("What is 2 + 3?", "2 + 3 = <<2+3=5>>5\n#### 5"),
    Example("Tom has 12 apples and gives 5 away. How many are left?", "12 - 5 = <<12-5=7>>7\n#### 7"),
    Example("x?", "#### 1"),
    Example("A book has 300 pages. Mia reads 120. How many pages are left?",
            "300 - 120 = <<300-120=180>>180 pages are left.\n#### 180"),
    Example("How many legs do 3 cats have?", "3 * 4 = <<3*4=12>>12\n#### 12"),
]


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen2_dir):
    return load_model(str(tiny_qwen2_dir), dtype="float32")


# ------------------------------------------------------------------------------------------ evaluate


def test_heldout_ce_matches_hand_computation_for_any_batch_size(tiny_model, tiny_tokenizer):
    split = tokenize_split(tiny_tokenizer, EXAMPLES, max_length=256)
    logits, targets = [], []
    with torch.no_grad():
        for it in split.items:
            out = tiny_model(input_ids=torch.tensor([it["input_ids"]])).logits[0]
            labels = torch.tensor(it["labels"])
            keep = labels[1:] != IGNORE_INDEX
            logits.append(out[:-1][keep])
            targets.append(labels[1:][keep])
    expected = F.cross_entropy(torch.cat(logits), torch.cat(targets)).item()

    tiny_model.train()
    got1 = heldout_ce(tiny_model, split, batch_size=1)
    assert tiny_model.training  # previous mode restored
    tiny_model.eval()
    got3 = heldout_ce(tiny_model, split, batch_size=3)  # batches of 3 and 2, right-padded
    assert not tiny_model.training
    assert got1 == pytest.approx(expected, abs=1e-5)
    assert got3 == pytest.approx(expected, abs=1e-5)


def test_generate_answers_left_padding_matches_one_by_one(tiny_model, tiny_tokenizer):
    questions = [ex.question for ex in EXAMPLES[:4]]  # prompt lengths differ -> real left padding
    side = tiny_tokenizer.padding_side
    batched = generate_answers(tiny_model, tiny_tokenizer, questions, max_new_tokens=12, batch_size=4)
    assert tiny_tokenizer.padding_side == side
    alone = [generate_answers(tiny_model, tiny_tokenizer, [q], max_new_tokens=12, batch_size=1)[0]
             for q in questions]
    assert batched == alone
    assert len(batched) == 4 and all(isinstance(a, str) and a for a in batched)
    assert not any(q in a for q, a in zip(questions, batched))  # completions only, no prompt


def test_score_answers():
    preds = ["The answer is 1,000.", "So she has 7 left.", "I think 41", "no number here"]
    golds = ["#### 1000", "steps ... 3 + 4 = 7\n#### 7.0", "#### 42", "#### 5"]
    r = score_answers(preds, golds, questions=["q1", "q2", "q3", "q4"])
    assert (r["n"], r["correct"], r["accuracy"]) == (4, 2, 0.5)
    assert [s["ok"] for s in r["samples"]] == [True, True, False, False]
    assert r["samples"][0] == {"question": "q1", "gold": "1000", "predicted": "The answer is 1,000.",
                               "pred_number": "1000", "ok": True}
    assert r["samples"][3]["pred_number"] is None
    assert len(score_answers(["1"] * 9, ["#### 1"] * 9)["samples"]) == 5
    with pytest.raises(KavaError):
        score_answers(["1"], [])


def test_gsm8k_accuracy_runs_on_tiny_model(tiny_model, tiny_tokenizer):
    r = gsm8k_accuracy(tiny_model, tiny_tokenizer, EXAMPLES[:3], max_new_tokens=8, batch_size=2)
    assert r["n"] == 3 and 0 <= r["accuracy"] <= 1 and r["correct"] == round(r["accuracy"] * 3)
    assert len(r["samples"]) == 3 and r["samples"][0]["gold"] == "5"


# ------------------------------------------------------------------------------------------ generate


def _generate(capsys, *args):
    """`kava-ray generate ARGS` in this process: (exit code, stdout, stderr's lines)."""
    from kava_ray.cli import main

    capsys.readouterr()
    code = main(["generate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


@pytest.mark.parametrize("prompt", ["", " \n "], ids=["empty", "blank"])
def test_generate_with_an_empty_prompt_is_one_line(capsys, tiny_student_dir, prompt):
    code, out, err = _generate(capsys, tiny_student_dir, "--prompt", prompt)
    assert code == 2 and out == "" and err == [f"error: --prompt {prompt!r}: empty; give the text the student should "
                                               f"continue, e.g. --prompt \"Why is the sky blue?\""], err


def test_generate_from_a_sharded_checkpoint_is_one_line(capsys, tmp_path, tiny_student_dir):
    """A run mid-way under FSDP2, no final/ yet: its checkpoint holds the student's config and tokenizer, the
    weights only in DCP shards (the layout `core.checkpoint.save_checkpoint` writes for a sharded Distiller). The
    run dir, the checkpoint and its student/ each: one line saying it is sharded and naming final/, nothing
    written."""
    from kava_ray.core.fsdp import SHARDED

    run = tmp_path / "run"
    ckpt = run / "checkpoint_2026-01-01_00-00-00.000000"
    (ckpt / SHARDED).mkdir(parents=True)
    for name, data in ((".metadata", b"\x80\x04."), ("__0_0.distcp", b"\x00" * 64)):
        (ckpt / SHARDED / name).write_bytes(data)
    (ckpt / "student").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_student_dir / name, ckpt / "student" / name)
    (ckpt / "state.json").write_text(json.dumps({"step": 2, "sharded": True}))
    before = sorted(tmp_path.rglob("*"))
    for path in (run, ckpt, ckpt / "student"):
        code, out, err = _generate(capsys, path, "--prompt", "hi")
        assert code == 2 and out == "" and len(err) == 1, err
        assert err[0].startswith(f"error: checkpoint {ckpt} is sharded: its student is in FSDP2 shards") and \
            "use the run's final/" in err[0], err
    assert sorted(tmp_path.rglob("*")) == before


def test_generate_prints_the_completion_and_nothing_else(tiny_student_dir):
    """The installed command in a fresh interpreter, as a user runs it (no TRANSFORMERS_VERBOSITY): stdout is the
    completion, stderr is empty -- no torchao kernel lines, torch deprecations or weights progress bar."""
    exe = shutil.which("kava-ray", path=str(Path(sys.executable).parent))
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    r = subprocess.run([exe, "generate", str(tiny_student_dir), "--prompt", "2+2?", "--max-new-tokens", "3",
                        "--json"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    gen = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.stdout.startswith(gen["completion"]) and 1 <= gen["new_tokens"] <= 3


# -------------------------------------------------------------------------------------------- report


def _write_metrics(run_dir, final_gap: float):
    recs = []
    for step in (1, 2, 3, 4):
        cos_a, cos_b = 0.2 * step, 0.1 + 0.2 * step
        recs.append({"step": step, "kind": "train", "loss": 3.0 - 0.5 * step, "ce": 2.0 - 0.3 * step,
                     "kv_loss": 1.0 - 0.2 * step, "cos_sim": (cos_a + cos_b) / 2, "cos/qwen": cos_a,
                     "cos/llama": cos_b, "cos_layer/first": 0.5, "contrast_gap": 0.3 if step < 4 else final_gap,
                     "fusion/qwen": 0.5, "fusion/llama": 0.5, "lr_student": 1e-4, "grad_norm": 1.0,
                     "tokens_per_s": 1000.0 + step, "teacher_wait_s": 0.25, "time_s": 1.0,
                     "phase": phase((cos_a + cos_b) / 2)})
        if step % 2 == 0:
            recs.append({"step": step, "kind": "eval", "eval/ce": 2.5 - 0.1 * step, "eval/cos_sim": 0.1 * step,
                         "eval/contrast_gap": 0.2, "eval/cos/qwen": 0.1 * step, "eval/cos/llama": 0.1 * step})
    # the first attempt logged step 3, failed, and the resumed run re-logged it: the last record wins
    recs.insert(3, {"step": 3, "kind": "train", "loss": 99.0, "cos/qwen": 0.01})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


@pytest.mark.parametrize("final_gap, warned", [(0.002, True), (0.25, False)])
def test_write_report(tmp_path, final_gap, warned):
    _write_metrics(tmp_path, final_gap)
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    assert train[2]["loss"] == 3.0 - 1.5 and "eval/ce" not in train[1]  # the re-logged step 3 won

    r = write_report(tmp_path)
    for name in ("loss", "cos", "contrast_gap", "teacher_wait"):
        with open(r["plots"][name], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in (tmp_path / "report").iterdir() if p.name.startswith(".") or ".tmp" in p.name]
    md = (tmp_path / "report" / "summary.md").read_text()
    assert "| cos/qwen | 0.2000 | 0.8000 |" in md and "| cos/llama | 0.3000 | 0.9000 |" in md
    assert ("collapse trap" in md) is warned and r["collapse_warning"] is warned
    assert r["cos"] == {"qwen": (0.2, 0.8), "llama": (0.30000000000000004, 0.9)}
    assert r["eval_ce"] == (2.3, 2.1) and r["last_step"] == 4 and r["phase"] == "Good"
    assert r["teacher_wait_share"] == pytest.approx(0.25) and r["wall_time_s"] == pytest.approx(4.0)
    assert "## Last eval (step 4)" in md and "| eval/ce | 2.1000 |" in md
    text = summarize_run(tmp_path)
    assert "cos/llama" in text and "0.9000" in text and ("collapse trap" in text) is warned


def test_phase_thresholds():
    assert [phase(c) for c in (0.1, 0.5, 0.69, 0.7, 0.9, 0.94, 0.95, 1.0)] == [
        "Adapting", "Learning", "Learning", "Good", "Great", "Great", "Excellent", "Excellent"]


def test_read_metrics_errors(tmp_path):
    with pytest.raises(KavaError, match="not found"):
        read_metrics(tmp_path / "missing.jsonl")
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1, "kind": "train", "loss": 1.0}\n\n{"step": 2, "kind": "tr\n')
    with pytest.raises(KavaError, match="line 3") as e:
        read_metrics(bad)
    assert "\n" not in str(e.value)
    bad.write_text('{"step": 1, "kind": "train"}\n{"kind": "train", "loss": 1.0}\n')
    with pytest.raises(KavaError, match="line 2"):
        write_report(tmp_path)


def test_the_final_table_shows_every_term_and_a_figure_the_last_step_did_not_measure(tmp_path):
    """`kava-ray train`'s table: the on-policy figures, the train logit terms and the sampling time are rows (they
    were dropped); a figure the last step did not measure (it sampled nothing) is its last measurement, with its
    step (`metrics_file.last_values`)."""
    from kava_ray.cli.train import format_final
    from kava_ray.common.metrics_file import MetricsLog, last_values

    log = MetricsLog(tmp_path / "metrics.jsonl", 0)
    first = {"step": 1, "kind": "train", "loss": 2.0, "logit_kl": 0.5, "onpolicy/sampled_tokens": 24,
             "onpolicy/reverse_kl/qwen": 0.25, "time/sample_s": 1.5, "lr_student": 1e-3}
    last = {"step": 2, "kind": "train", "loss": 1.5, "logit_kl": 0.4, "onpolicy/sampled_tokens": 0,
            "time/sample_s": 0.0, "lr_student": 1e-3}
    for r in (first, last, {"step": 2, "kind": "eval", "eval/ce": 3.0}):
        log.write(r)
    assert last_values(tmp_path / "metrics.jsonl")["onpolicy/reverse_kl/qwen"] == (1, 0.25)
    table = format_final({"metrics": {**last, "eval/ce": 3.0}, "last_measured": last_values(tmp_path / "metrics.jsonl"),
                          "run_dir": str(tmp_path), "wall_s": 1.0})
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:-1]}
    assert rows["onpolicy/reverse_kl/qwen"] == ["0.2500", "(step", "1)"], table
    assert rows["logit_kl"] == ["0.4000"] and rows["time/sample_s"] == ["0.0000"] and rows["loss"] == ["1.5000"]
    assert rows["onpolicy/sampled_tokens"] == ["0"] and rows["eval/ce"] == ["3.0000"]
    assert "lr_student" not in rows
