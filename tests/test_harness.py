"""lm-evaluation-harness tasks (`kava_ray.data.tasks`, `kava_ray.recipes.harness`): the shipped synthetic GSM8K scores
what `evaluate.gsm8k_accuracy` scores, a user's JSONL task is greedy exact match, and a task that cannot load is one
line before any model. The run-level paths (`train.eval_tasks`, `kava-ray eval RUN --tasks`): tests/test_train.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.models import load_model
from kava_ray.data.synthetic import synthetic_split
from kava_ray.data.tasks import resolve_tasks
from kava_ray.recipes.evaluate import generate_answers, gsm8k_accuracy, score_answers
from kava_ray.recipes.harness import run_tasks, task_metrics
from kava_ray.testing.tiny import build_tiny_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def smol_model(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama around the real SmolLM2 tokenizer (its chat template: the harness's chat path)."""
    d = build_tiny_model(tmp_path_factory.mktemp("harness"), family="llama", num_layers=2, hidden_size=32, num_heads=2,
                         num_kv_heads=1, head_dim=16, tokenizer=smollm2_tokenizer, max_position_embeddings=1024, seed=4)
    return load_model(d, dtype="float32")


# completions where lm-eval's own gsm8k filters (strict-match: the first `####`; flexible-extract: the last number,
# compared as strings) and kava-ray's answer (the number after the last `####`, else the last, canonicalised) differ
CANNED = [("The answer is 7.", "#### 7"), ("#### 7.0", "#### 7"), ("#### $7", "#### 7"), ("1,000 dollars", "#### 1000"),
          ("#### 2.50", "#### 2.5"), ("#### 7\nQuestion: next #### 9", "#### 7"), ("#### 8 then #### 7", "#### 7"),
          ("#### -0", "#### 0"), ("...5", "#### 5"), ("no number", "#### 3"), ("#### 4", "#### 3")]


def test_the_shipped_gsm8k_task_scores_what_gsm8k_accuracy_scores(smol_model, smollm2_tokenizer):
    """Through the harness, `kava_gsm8k` gives the same completions and accuracy as `gsm8k_accuracy` on the same
    problems (the first N of the synthetic test split), with the chat template and with the plain prompt; its
    scoring function agrees with `score_answers` case by case where lm-eval's own GSM8K filters would not. The
    model's train mode and the caller's random stream are as they were."""
    from kava_ray.data.lm_eval_tasks.kava_utils import gsm8k_results  # the shipped file lm-eval loads by path

    tasks = resolve_tasks(["kava_gsm8k"])
    n = 3
    examples = synthetic_split(n, 0, "test")
    smol_model.train()
    for fmt in ("auto", "plain"):
        torch.manual_seed(7)
        got = run_tasks(smol_model, smollm2_tokenizer, tasks, fmt, limit=n, batch_size=2, responses=True)
        after = torch.rand(3)
        torch.manual_seed(7)
        assert torch.equal(after, torch.rand(3))  # the harness seeds torch; the caller's stream continues untouched
        assert smol_model.training
        r = got["kava_gsm8k"]
        assert r["n"] == n and r["responses"] == generate_answers(smol_model, smollm2_tokenizer,
                                                                  [e.question for e in examples], fmt, 128, 2)
        assert r["metrics"]["accuracy"] == gsm8k_accuracy(smol_model, smollm2_tokenizer, examples, fmt)["accuracy"]
    assert task_metrics(got) == {"eval/task/kava_gsm8k/accuracy": got["kava_gsm8k"]["metrics"]["accuracy"]}
    ours = [gsm8k_results({"answer": g}, [p])["accuracy"] for p, g in CANNED]
    assert ours == [float(score_answers([p], [g])["correct"]) for p, g in CANNED]
    assert sum(ours) == 7  # 7 of the 11 read as kava-ray reads them


def test_a_users_jsonl_is_a_greedy_exact_match_task(tmp_path, smol_model, smollm2_tokenizer):
    """`file:PATH`: each prompt as written (no template), greedy; a completion counts when it is the model's
    answer, surrounding whitespace aside. Rows whose gold is the model's own answer score, the others do not."""
    prompts = ["Sort: 3 1 2\n", "Capital of France?", "2 + 2 =", "Say hi."]
    path = tmp_path / "my task.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "completion": "?"}) + "\n" for p in prompts))
    first = run_tasks(smol_model, smollm2_tokenizer, resolve_tasks([f"file:{path}"]), responses=True)["file_my_task"]
    said = first["responses"]
    assert first["metrics"] == {"exact_match": 0.0} and first["n"] == 4 and len(set(said)) > 1
    gold = [" " + said[0] + "\n", said[1], said[0] + "x", "?"]  # the model's own, padded; its own; another; another
    path.write_text("".join(json.dumps({"prompt": p, "completion": g}) + "\n" for p, g in zip(prompts, gold)))
    again = run_tasks(smol_model, smollm2_tokenizer, resolve_tasks([f"file:{path}"]), limit=3)["file_my_task"]
    assert again["metrics"] == {"exact_match": pytest.approx(2 / 3)} and again["n"] == 3


def test_a_task_that_cannot_load_is_one_line(tmp_path):
    """Unknown names, lm-eval's own tasks whose Hub data is out of reach (tests run with HF_HUB_OFFLINE=1), a missing
    or malformed file, a name given twice: one KavaError naming it, nothing loaded."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n')
    cases = {"nosuch_task": r"unknown eval task 'nosuch_task': not one of kava-ray's .* "
                            r"\(`lm-eval ls tasks` lists them\)",
             "arc_easey": r"unknown eval task 'arc_easey' \(did you mean 'arc_easy'\?\): not one of",
             "arc_easy": r"eval task 'arc_easy': its data cannot be loaded \(ConnectionError: .*allenai/ai2_arc.*"
                         r"Hugging Face cache",
             f"file:{tmp_path}/none.jsonl": r"none.jsonl: no such file",
             f"file:{bad}": r"bad.jsonl: line 2 needs string fields prompt and completion",
             "kava_gsm8k,kava_gsm8k": "kava_gsm8k is named twice", ",": "give one or more task names"}
    for names, message in cases.items():
        with pytest.raises(KavaError, match=message):
            resolve_tasks(names.split(","))


def test_a_task_named_by_its_yaml_path_reports_under_its_own_name(smol_model, smollm2_tokenizer):
    """A name lm-eval expands (a YAML path here; a tag or a group without an aggregate alike) is reported under
    each task it ran, not as an empty row under the name given."""
    from kava_ray.data.tasks import SHIPPED_DIR

    got = run_tasks(smol_model, smollm2_tokenizer, resolve_tasks([str(SHIPPED_DIR / "kava_pydoc_ppl.yaml")]), limit=1)
    assert list(got) == ["kava_pydoc_ppl"] and got["kava_pydoc_ppl"]["n"] == 1
    assert set(got["kava_pydoc_ppl"]["metrics"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert got["kava_pydoc_ppl"]["higher_is_better"] == dict.fromkeys(got["kava_pydoc_ppl"]["metrics"], False)


def test_share_and_gap_recovered():
    """The student's share of a teacher's figure (inverted for a lower-is-better one) and the gap recovered from a
    baseline, which is no figure where the teacher does not beat the baseline (the ratio would flip sign), and none
    at all on a perplexity (a ratio scale: the gap there means nothing), only on accuracy-like metrics and bits per
    byte; the table shows "—" in its place."""
    from kava_ray.recipes.eval_tasks import compare, format_tasks, has_gap

    def res(acc, bpb):
        metrics = {"acc": acc, "exact_match/strict-match": acc, "bits_per_byte": bpb, "word_perplexity": 2 ** bpb,
                   "byte_perplexity": 2 ** bpb}
        return {"t": {"metrics": metrics, "n": 4, "higher_is_better": {m: m.startswith(("acc", "exact")) for m in
                                                                        metrics}}}

    out = compare({"student": res(0.4, 2.0), "baseline": res(0.2, 4.0), "teacher a": res(0.6, 1.0),
                   "teacher b": res(0.1, 5.0)})
    assert out["share"]["a"] == {"t/acc": pytest.approx(0.4 / 0.6), "t/exact_match/strict-match": pytest.approx(2 / 3),
                                 "t/bits_per_byte": 0.5, "t/word_perplexity": 0.5, "t/byte_perplexity": 0.5}
    assert out["gap_recovered"] == {"a": {"t/acc": pytest.approx(0.5), "t/exact_match/strict-match": pytest.approx(0.5),
                                          "t/bits_per_byte": pytest.approx(2 / 3)},
                                    "b": {"t/acc": None, "t/exact_match/strict-match": None, "t/bits_per_byte": None}}
    assert compare({"student": res(0.4, 2.0), "teacher a": res(0.6, 1.0)})["gap_recovered"] == {}
    assert [has_gap(m) for m in ("perplexity", "word_perplexity", "byte_perplexity", "accuracy", "bits_per_byte")] == \
        [False, False, False, True, True]
    models = {"student": res(0.4, 2.0), "baseline": res(0.2, 4.0), "teacher a": res(0.6, 1.0)}
    table = format_tasks({**compare(models), "models": models, "step": 1, "checkpoint": "c", "device": "cpu",
                          "wall_s": 1.0})
    rows = {line.split()[1]: line.split() for line in table.splitlines() if line.startswith("t ")}
    assert rows["word_perplexity"][-1] == rows["byte_perplexity"][-1] == "—"  # (the share beside it stays)
    assert rows["bits_per_byte"][-1] == "0.6667" and rows["acc"][-1] == "0.5000"


def test_a_missing_package_is_one_line(monkeypatch, tmp_path, smol_model, smollm2_tokenizer):
    """Without lm-eval (the `eval` extra) a task is one line with the install; a metric whose module is missing
    (scikit-learn's, for lm-eval's f1 / mcc: the Makefile leaves it out) is one line naming the package."""
    import dataclasses
    import importlib.util

    from kava_ray.data.tasks import parse_task

    def results(doc, out):
        import kava_no_such_module  # noqa: F401 - what a metric of a package that is not installed meets

    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "1 + 1 =", "completion": "2"}) + "\n")
    task = parse_task(f"file:{path}")
    task = dataclasses.replace(task, spec={**task.spec, "process_results": results})
    with pytest.raises(KavaError, match=r"eval task 'file_one': lm-eval needs kava_no_such_module for it: pip install "
                                        r"kava_no_such_module$"):
        run_tasks(smol_model, smollm2_tokenizer, [task], limit=1)
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find(name, *a))
    with pytest.raises(KavaError, match=r"^eval tasks need lm-evaluation-harness: pip install 'kava-ray\[eval\]'"):
        resolve_tasks(["kava_gsm8k"])


def test_an_untrained_model_scores_the_uniform_guess_on_the_perplexity_task(smol_model, smollm2_tokenizer):
    """The reference `kava-ray eval` prints beside `kava_pydoc_ppl` (a uniform guess over the vocabulary: log2 V bits a
    token, over the bytes) counts the tokens lm-eval scores: a random tiny model, whose logits are near zero, lands on
    it to 0.2 %, and the reference is far from what a model that has learned the text scores (the demo's teacher:
    0.78 bits per byte)."""
    from kava_ray.recipes.eval_tasks import uniform_reference

    got = run_tasks(smol_model, smollm2_tokenizer, resolve_tasks(["kava_pydoc_ppl"]), limit=2)["kava_pydoc_ppl"]
    uniform = uniform_reference(smollm2_tokenizer, 2)
    assert got["metrics"]["bits_per_byte"] == pytest.approx(uniform["kava_pydoc_ppl/bits_per_byte"], rel=2e-3)
    assert uniform["kava_pydoc_ppl/byte_perplexity"] == pytest.approx(2 ** uniform["kava_pydoc_ppl/bits_per_byte"])
    assert 3 < uniform["kava_pydoc_ppl/bits_per_byte"] < 5


def _waiting_rank(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks (spawned) whose training group times out after 2 s. Twice, rank 0 "runs harness tasks"
    for 4 s before both all-reduce on the training group: first with `rank_zero_wait` between, then without (the
    control); each rank writes what each all-reduce did."""
    import os
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from kava_ray.recipes.rank_wait import rank_zero_wait

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    training = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    results = []
    for wait in (rank_zero_wait(["kava_gsm8k"], 2), lambda: None):
        if rank == 0:
            time.sleep(4)
        wait()
        try:
            x = torch.ones(1)
            dist.all_reduce(x, group=training)
            results.append(f"sum {x.item():g}")
        except RuntimeError as e:
            results.append(f"error {str(e).splitlines()[0]}")
    (Path(out) / f"rank{rank}").write_text(json.dumps(results))
    os._exit(0)  # (a timed-out gloo group cannot be destroyed cleanly)


def test_the_other_ranks_wait_for_rank_0s_tasks_past_the_training_groups_timeout(tmp_path):
    """`train.eval_tasks` on rank 0 takes longer than the training group's timeout: with `rank_zero_wait` the other
    rank waits on a gloo group of its own and the next collective succeeds; without it (the control) the other rank
    meets the training group's timeout."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_waiting_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    waited, control = json.loads((tmp_path / "rank1").read_text())
    assert waited == "sum 2" and control.startswith("error") and "Timed out" in control, (waited, control)
