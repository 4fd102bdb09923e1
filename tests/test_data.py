"""kava_ray.data: sources, answer parsing, tokenization/label masking, batching, sharding, resume."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import numpy as np
import pytest
import torch

from kava_ray.common.errors import KavaError
from kava_ray.common.fingerprints import tokenizer_fingerprint
from kava_ray.data import (
    IGNORE_INDEX,
    BatchStream,
    Example,
    batch_key,
    collate,
    encode_example,
    encode_prompt,
    final_answer,
    load_examples,
    normalize_number,
    plan_batches,
    shard_batches,
    synthetic_gsm8k,
    tokenize_split,
    with_layers,
)
from kava_ray.data.batching import RELEASE_EVERY
from kava_ray.data.mmap_advice import cache_paths, release_mapped_pages

ANNOT = re.compile(r"<<([0-9+\-*/]+)=(-?\d+)>>(-?\d+)")


# ---------------------------------------------------------------- synthetic generator


def test_synthetic_deterministic_and_varied():
    big = synthetic_gsm8k(10_000, seed=0)
    assert synthetic_gsm8k(50, seed=0) == big[:50]
    assert not set(synthetic_gsm8k(50, seed=1)) & set(big[:50])
    steps = {ex.answer.count("<<") for ex in big}
    assert steps == {2, 3, 4}
    openings = {ex.question.split(" ")[1] for ex in big}  # verbs/nouns differ across templates
    assert len(openings) >= 5


def test_synthetic_annotations_are_correct_and_chain_to_the_answer():
    for ex in synthetic_gsm8k(2000, seed=3):
        found = ANNOT.findall(ex.answer)
        assert 2 <= len(found) <= 4, ex.answer
        for expr, value, shown in found:
            assert eval(expr) == int(value) == int(shown), (expr, value)  # noqa: S307 - digits and ops only
        final = ex.answer.rsplit("####", 1)[1].strip()
        assert final == found[-1][1]
        assert final_answer(ex.answer) == final
        # every operand is stated in the question, an earlier result, or the 2 of "there and back"
        known = set(re.findall(r"\d+", ex.question)) | {"2"}
        for expr, value, _ in found:
            assert all(x in known for x in re.split(r"[+\-*/]", expr)), (ex.question, ex.answer)
            known.add(value)


def test_synthetic_splits_are_disjoint_and_seeded():
    train = load_examples("synthetic", "train", 3000, seed=0)
    test = load_examples("synthetic", "test", 500, seed=0)
    assert len(train) == 3000 and len(test) == 500
    assert not {e.question for e in train} & {e.question for e in test}
    assert load_examples("synthetic", "test", 500, seed=0) == test
    assert load_examples("synthetic", "test", 500, seed=1) != test


# ---------------------------------------------------------------- local files and hub


ROWS = [{"question": "What is 2+3?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
        {"question": "Half of 10?", "answer": "10/2=<<10/2=5>>5\n#### 5", "extra": 1}]


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_local_jsonl_and_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = [Example(r["question"], r["answer"]) for r in ROWS]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert load_examples(str(jl), "train") == expected
    assert load_examples(str(jl), "train", n=1) == expected[:1]
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "test.parquet")
    assert load_examples(str(tmp_path / "{split}.parquet"), "test") == expected


def test_local_file_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(KavaError) as e:
        load_examples(str(bad), "train")
    assert "row 1" in _one_line(e) and "'answer'" in str(e.value) and "bad.jsonl" in str(e.value)

    pq.write_table(pa.Table.from_pylist([{"q": "x", "answer": "1"}]), tmp_path / "bad.parquet")
    with pytest.raises(KavaError) as e:
        load_examples(str(tmp_path / "bad.parquet"), "train")
    assert "'question'" in _one_line(e)

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(KavaError) as e:
        load_examples(str(tmp_path / "empty.jsonl"), "train")
    assert "no examples" in _one_line(e) and "empty.jsonl" in str(e.value)

    with pytest.raises(KavaError) as e:
        load_examples(str(tmp_path / "nope.jsonl"), "train")
    assert "not found" in _one_line(e) and "nope.jsonl" in str(e.value)

    (tmp_path / "d.tsv").write_text("question\tanswer\n")
    with pytest.raises(KavaError) as e:
        load_examples(str(tmp_path / "d.tsv"), "train")
    assert "unknown extension" in _one_line(e) and ".tsv" in str(e.value)


def test_hub_source_uses_load_dataset_and_wraps_failures(monkeypatch):
    import datasets

    calls = []

    def fake_load(source, config, split):
        calls.append((source, config, split))
        if source == "broken/ds":
            raise ConnectionError("Couldn't reach 'broken/ds' on the Hub (LocalEntryNotFoundError)\nlong trace")
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert load_examples("openai/gsm8k", "test", n=1) == [Example(ROWS[0]["question"], ROWS[0]["answer"])]
    assert calls[0] == ("openai/gsm8k", "main", "test")
    with pytest.raises(KavaError) as e:
        load_examples("broken/ds", "train")
    msg = _one_line(e)
    assert "broken/ds" in msg and "Couldn't reach" in msg and "data.source=synthetic" in msg


# ---------------------------------------------------------------- answers


@pytest.mark.parametrize("text,expected", [
    ("1,000", "1000"), ("1000.0", "1000"), ("1000", "1000"), ("$5", "5"), ("-3.50", "-3.5"),
    ("7.", "7"), ("about 12,345.60 dollars", "12345.6"), ("none", None), ("", None), (None, None),
])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_final_answer():
    assert final_answer("so 3*4=12\n#### 1,200") == "1200"
    assert final_answer("#### $5.00 total") == "5"
    assert final_answer("It costs 3 then 7.5 dollars.") == "7.5"  # no ####: the last number
    assert final_answer("no number here") is None
    assert final_answer("12 apples\n#### none") is None


# ---------------------------------------------------------------- tokenization


def test_tokenizer_fingerprint(tiny_tokenizer):
    from tiny_models import build_tokenizer

    other = build_tokenizer()
    other.chat_template = None  # the template is not part of the vocab
    assert tokenizer_fingerprint(tiny_tokenizer) == tokenizer_fingerprint(other)
    other.add_tokens(["<|new|>"])
    assert tokenizer_fingerprint(tiny_tokenizer) != tokenizer_fingerprint(other)


EX = Example("Tom has 3 boxes of 12 apples. How many?", "3 * 12 = <<3*12=36>>36\n#### 36")


def test_encode_chat_labels_mask_exactly_the_answer_and_its_end_of_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    enc = encode_example(tok, EX, max_length=512)  # auto -> chat (the tokenizer has a template)
    prompt = encode_prompt(tok, EX.question)
    n = len(prompt)
    assert enc["input_ids"][:n] == prompt and not enc["truncated"]
    assert enc["labels"][:n] == [IGNORE_INDEX] * n
    carried = [t for t in enc["labels"] if t != IGNORE_INDEX]
    assert tok.decode(carried) == EX.answer + "<|im_end|>"  # the answer and its end of turn, not the newline after
    assert enc["answer_mask"] == [0] * n + [1] * len(carried) + [0] * (len(enc["input_ids"]) - n - len(carried))
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")


def test_encode_plain(tiny_tokenizer):
    tok = tiny_tokenizer
    enc = encode_example(tok, EX, max_length=512, prompt_format="plain")
    n = enc["answer_mask"].index(1)
    assert tok.decode(enc["input_ids"][:n]) == f"Question: {EX.question}\nAnswer: "
    assert enc["labels"][:n] == [IGNORE_INDEX] * n
    assert tok.decode(enc["labels"][n:]) == EX.answer + tok.eos_token
    assert enc["labels"][-1] == tok.eos_token_id


def test_truncation_and_overlength_error(tiny_tokenizer):
    exs = [EX, Example("short?", "1\n#### 1"), Example("q" * 100, "a" * 100 + "\n#### 2")]
    full = [len(encode_example(tiny_tokenizer, e, 10_000)["input_ids"]) for e in exs]
    max_len = sorted(full)[1]  # the longest example overflows, the others fit
    with pytest.warns(UserWarning, match="1 of 3 records"):
        split = tokenize_split(tiny_tokenizer, exs, max_len, source_id="t")
    assert split.num_truncated == 1 and len(split) == 3
    assert max(split.lengths) == max_len
    long = split.items[full.index(max(full))]
    assert long["truncated"] and len(long["labels"]) == max_len == len(long["answer_mask"])
    with pytest.raises(KavaError) as e:
        tokenize_split(tiny_tokenizer, exs, max_len, overlength="error")
    msg = _one_line(e)
    assert f"row {full.index(max(full))}" in msg and str(max(full)) in msg


def test_split_fingerprint(tiny_tokenizer):
    exs = synthetic_gsm8k(8, 0)
    a = tokenize_split(tiny_tokenizer, exs, 512, "auto", source_id="s")
    assert a.fingerprint == tokenize_split(tiny_tokenizer, exs, 512, "auto", source_id="s").fingerprint
    assert a.fingerprint != tokenize_split(tiny_tokenizer, exs, 512, "plain", source_id="s").fingerprint
    assert a.fingerprint != tokenize_split(tiny_tokenizer, exs, 500, "auto", source_id="s").fingerprint
    assert a.fingerprint != tokenize_split(tiny_tokenizer, exs, 512, "auto", source_id="s2").fingerprint


# ---------------------------------------------------------------- batching


def _spread(batches, lengths):
    return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)


def test_plan_batches():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 400, (1003,), generator=g).tolist()
    p_last = plan_batches(lengths, 8, seed=1, epoch=0, drop_last=False)
    assert sorted(i for b in p_last for i in b) == list(range(1003))
    assert len(plan_batches(lengths, 8, seed=1, epoch=0)) == 125  # the partial batch is dropped
    lengths = lengths[:1000]
    p0 = plan_batches(lengths, 8, seed=1, epoch=0)
    assert isinstance(p0, np.ndarray) and p0.shape == (125, 8) and p0.dtype == np.int64  # numpy: no Python lists
    assert np.array_equal(p0, plan_batches(lengths, 8, seed=1, epoch=0))
    assert not np.array_equal(p0, plan_batches(lengths, 8, seed=1, epoch=1))
    assert not np.array_equal(p0, plan_batches(lengths, 8, seed=2, epoch=0))
    flat = [i for b in p0 for i in b]
    assert len(flat) == len(set(flat)) == 1000 and all(len(b) == 8 for b in p0)
    rand = plan_batches(lengths, 8, seed=1, epoch=0, bucket=False)
    assert _spread(p0, lengths) < 0.25 * _spread(rand, lengths)


def test_shard_batches():
    batches = [[i] for i in range(11)]
    shards = [shard_batches(batches, r, 3) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    flat = [b[0] for s in shards for b in s]
    assert len(set(flat)) == 9


def test_collate():
    items = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "answer_mask": [0, 1, 1]},
             {"input_ids": [8], "labels": [8], "answer_mask": [1]}]
    out = collate(items, pad_id=0)
    assert {k: tuple(v.shape) for k, v in _tensors(out).items()} == {
        "input_ids": (2, 3), "attention_mask": (2, 3), "labels": (2, 3), "answer_mask": (2, 3)}
    assert out.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out.labels.tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert out.answer_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    left = collate(items, pad_id=0, padding_side="left")
    assert left.input_ids.tolist()[1] == [0, 0, 8] and left.labels.tolist()[1] == [-100, -100, 8]
    assert out.teachers == {} and out.to("cpu").input_ids.equal(out.input_ids)


def test_batch_key():
    assert batch_key("fp", 1, 2) != batch_key("fp", 2, 1)
    assert batch_key("fp", 1, 2, layers=[3, 1]) == with_layers(batch_key("fp", 1, 2), [1, 3])


# ---------------------------------------------------------------- stream / resume


@pytest.fixture(scope="module")
def small_split(tiny_tokenizer):
    return tokenize_split(tiny_tokenizer, synthetic_gsm8k(40, 0), 512, source_id="synthetic/train")


def _same(a, b):
    assert a[:3] == b[:3]
    _same_batch(a[3], b[3])


def _tensors(batch) -> dict:
    """Every tensor of a Batch by name, its teachers' as `<field>/<teacher>`."""
    out = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
           if isinstance(getattr(batch, f.name), torch.Tensor)}
    for t, view in batch.teachers.items():
        out.update({f"{f.name}/{t}": getattr(view, f.name) for f in dataclasses.fields(view)})
    return out


def _same_batch(a, b):
    a, b = _tensors(a), _tensors(b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _collated(split, idx):
    """What a stream's batch of example indices `idx` must be."""
    return collate([split.items[i] for i in idx], split.pad_id)


def test_batch_stream_resume(small_split):
    ref = BatchStream(small_split, batch_size=4, seed=0)  # 10 steps per epoch
    expected = [ref.next() for _ in range(12)]
    s = BatchStream(small_split, batch_size=4, seed=0)
    for _ in range(7):
        s.next()
    state = json.loads(json.dumps(s.state()))
    resumed = BatchStream(small_split, batch_size=4, seed=0, state=state)
    for exp in expected[7:12]:  # crosses the epoch boundary
        _same(resumed.next(), exp)
    by_step = BatchStream(small_split, batch_size=4, seed=0, start_step=7)
    _same(by_step.next(), expected[7])

    key, step, epoch, batch = expected[0]
    assert step == 0 and epoch == 0 and expected[10][2] == 1
    assert batch.input_ids.shape[0] == 4
    plan = plan_batches(small_split.lengths, 4, seed=0, epoch=0)  # epoch 0 as documented (one worker)
    for (_, _, _, got), idx in zip(expected[:10], plan, strict=True):
        _same_batch(got, _collated(small_split, idx))
    assert sorted(i for idx in plan for i in idx) == list(range(40))
    assert len({e[0] for e in expected}) == 12


def test_batch_stream_ranks(small_split):
    ranks = [BatchStream(small_split, batch_size=4, seed=0, rank=r, world_size=3) for r in range(3)]
    assert all(r.steps_per_epoch == 3 for r in ranks)
    seen = [[r.next() for _ in range(3)] for r in ranks]
    plan = plan_batches(small_split.lengths, 4, seed=0, epoch=0)
    idx = []
    for rank, rs in enumerate(seen):
        for (_, _, _, got), b in zip(rs, shard_batches(plan, rank, 3), strict=True):
            _same_batch(got, _collated(small_split, b))
            idx += b.tolist()
    assert len(idx) == len(set(idx)) == 36
    single = BatchStream(small_split, batch_size=4, seed=0)
    keys = {single.next()[0] for _ in range(10)}
    assert {b[0] for rs in seen for b in rs} <= keys  # keys are global batch ids, independent of rank
    with pytest.raises(KavaError, match="too few"):
        BatchStream(small_split, batch_size=16, seed=0, world_size=3)


def test_batch_stream_without_drop_last_reads_every_row(small_split):
    """Held-out evaluation (`drop_last=False`): 40 rows in batches of 6 are 6 full batches and a short one of 4,
    every row once; the full batches are the ones a drop-last stream reads, in the same order."""
    whole = BatchStream(small_split, batch_size=6, seed=0, bucket=False, drop_last=False)
    assert whole.steps_per_epoch == 7
    batches = [whole.next_indexed() for _ in range(7)]
    assert [len(b[4]) for b in batches] == [6] * 6 + [4]
    assert sorted(i for b in batches for i in b[4]) == list(range(40))
    cut = BatchStream(small_split, batch_size=6, seed=0, bucket=False)
    assert cut.steps_per_epoch == 6 and [cut.next_indexed()[4] for _ in range(6)] == [b[4] for b in batches[:6]]
    _same_batch(batches[6][3], _collated(small_split, batches[6][4]))
    assert whole.next_indexed()[2] == 1  # then the next epoch
    single = BatchStream(small_split, batch_size=64, seed=0, bucket=False, drop_last=False)
    assert single.steps_per_epoch == 1 and len(single.next_indexed()[4]) == 40  # a split smaller than one batch


def _mapped_rss_kib(paths) -> int:
    """Resident KiB of this process's mappings of `paths` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) == 6 and head[5] in paths
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / smaps are Linux")
def test_batch_stream_releases_the_pages_its_random_reads_map(tiny_tokenizer, tmp_path):
    """Random row reads map the Arrow cache around every row (readahead, fault-around); the stream drops those
    mappings every RELEASE_EVERY batches, so the worker's RSS does not grow with what it has read -- and the
    batches are the same as without the release."""
    docs = [{"text": " ".join(f"word{(i * 7 + j) % 997}" for j in range(300))} for i in range(600)]
    split = tokenize_split(tiny_tokenizer, docs, 64, source_id="docs", cache_dir=tmp_path, with_text=False)
    paths = cache_paths([split.dataset])
    assert paths and all(os.path.getsize(p) > 1 << 20 for p in paths)
    ref = BatchStream(split, batch_size=8, seed=1).next()[3]
    s = BatchStream(split, batch_size=8, seed=1)
    got = [s.next()[3] for _ in range(RELEASE_EVERY - 1)]
    _same_batch(got[0], ref)
    held = _mapped_rss_kib(paths)
    assert held > 0  # the reads mapped pages of the cache
    s.next()  # the RELEASE_EVERY-th batch releases them
    assert _mapped_rss_kib(paths) < held / 4
    assert release_mapped_pages(paths) > 0 and _mapped_rss_kib(paths) == 0
    again = BatchStream(split, batch_size=8, seed=1)
    for b in got:  # reading after a release faults the same bytes back in
        _same_batch(again.next()[3], b)
