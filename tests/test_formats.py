"""Record formats (`kava_ray.data.records`) on Hugging Face `datasets`: which tokens carry loss, token by token,
with the real SmolLM2 tokenizer; packing; exact resume on packed text and on conversations; a teacher of
another tokenizer aligned within a conversation's messages; the Python-docs corpus."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kava_ray.common.errors import KavaError
from kava_ray.data import BatchStream, tokenize_split
from kava_ray.data.corpus import pydoc_topics, split_topics, write_pydoc_corpus
from kava_ray.data.records import detect_format, formats_of

pytestmark = pytest.mark.unit

CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3 + 5?"},
        {"role": "assistant", "content": "8, of course."}]


def loss_tokens(tok, item) -> list[str]:
    return [tok.decode([t]) for t, m in zip(item["input_ids"], item["loss_mask"]) if m]


def expected(tok, pieces) -> tuple[list[int], list[int]]:
    """(ids, loss mask) built by hand from [(text, loss), ...] tokenized one piece at a time."""
    ids, mask = [], []
    for text, loss in pieces:
        got = tok(text, add_special_tokens=False)["input_ids"] if isinstance(text, str) else text
        ids += got
        mask += [int(loss)] * len(got)
    return ids, mask


def test_formats_are_detected_from_columns_and_renamed():
    assert detect_format({"text": "x"}) == "text"
    assert detect_format({"prompt": "p", "completion": "c"}) == "prompt_completion"
    assert detect_format({"messages": CHAT, "text": "also"}) == "messages"
    assert detect_format({"question": "q", "answer": "a"}) == "gsm8k"
    assert detect_format({"question": "q", "answer": None}) is None
    rows = [("r0", {"instruction": "Say hi", "output": "hi"})]
    assert formats_of(rows, "auto", {"prompt": "instruction", "completion": "output"}) == "prompt_completion"


def test_multi_turn_messages_carry_loss_on_both_assistant_turns_only(smollm2_tokenizer):
    tok = smollm2_tokenizer
    split = tokenize_split(tok, [{"messages": CHAT}], 512, source_id="chat")
    item = split.items[0]
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert item["text"] == text and split.format == "messages"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # by hand: the whole template, with loss exactly on the two assistant contents and the <|im_end|> after each
    ids, mask = [], []
    pos = 0
    for m in CHAT:
        at = text.index(m["content"], pos)
        head, _ = expected(tok, [(text[pos:at], False)])
        ids += head
        mask += [0] * len(head)
        body = tok(m["content"], add_special_tokens=False)["input_ids"]
        ids += body
        mask += [int(m["role"] == "assistant")] * len(body)
        pos = at + len(m["content"])
        if m["role"] == "assistant":  # the end-of-turn token the template puts after the turn
            assert text[pos:].startswith("<|im_end|>")
            ids.append(end)
            mask.append(1)
            pos += len("<|im_end|>")
    tail, _ = expected(tok, [(text[pos:], False)])
    ids += tail
    mask += [0] * len(tail)
    assert item["input_ids"] == ids and item["loss_mask"] == mask
    assert loss_tokens(tok, item) == [tok.decode([t]) for t, m in zip(ids, mask) if m]
    assert "".join(loss_tokens(tok, item)) == "It is 4.<|im_end|>8, of course.<|im_end|>"
    assert item["labels"] == [t if m else -100 for t, m in zip(ids, mask)]
    # the segments are the five message contents
    assert [text[a:b] for a, b in item["segments"]] == [m["content"] for m in CHAT]


def test_prompt_completion_strings_and_conversations(smollm2_tokenizer):
    tok = smollm2_tokenizer
    rows = [{"prompt": "Translate to French: cat", "completion": " chat"}]
    item = tokenize_split(tok, rows, 64, source_id="pc").items[0]
    ids, mask = expected(tok, [("Translate to French: cat", False), (" chat", True), ([tok.eos_token_id], True)])
    assert item["input_ids"] == ids and item["loss_mask"] == mask
    conv = [{"prompt": CHAT[:2], "completion": [CHAT[2]]}]  # TRL's conversational prompt-completion
    item = tokenize_split(tok, conv, 128, source_id="pcc").items[0]
    assert "".join(loss_tokens(tok, item)) == "It is 4.<|im_end|>"


def test_text_and_gsm8k(smollm2_tokenizer):
    tok = smollm2_tokenizer
    item = tokenize_split(tok, [{"text": "Hello there."}], 64, source_id="t", packing=False).items[0]
    ids, mask = expected(tok, [("Hello there.", True), ([tok.eos_token_id], True)])
    assert item["input_ids"] == ids and item["loss_mask"] == mask
    q, a = "Tom has 3 apples. How many?", "3 apples.\n#### 3"
    plain = tokenize_split(tok, [{"question": q, "answer": a}], 128, "plain", source_id="g").items[0]
    ids, mask = expected(tok, [(f"Question: {q}\nAnswer: ", False), (a, True), ([tok.eos_token_id], True)])
    assert plain["input_ids"] == ids and plain["loss_mask"] == mask
    text = plain["text"]
    assert [text[s:e] for s, e in plain["segments"]] == [q, "3 apples.\n", "#### 3"]  # question, reasoning, answer
    chat = tokenize_split(tok, [{"question": q, "answer": a}], 128, "chat", source_id="g").items[0]
    assert "".join(loss_tokens(tok, chat)) == a + "<|im_end|>"


def test_packing_leaves_no_padding_and_separates_documents_with_eos(smollm2_tokenizer):
    tok = smollm2_tokenizer
    docs = [{"text": " ".join(f"doc{d} word{i}" for i in range(n))} for d, n in enumerate((30, 7, 55, 12, 40))]
    split = tokenize_split(tok, docs, 32, source_id="pack")
    assert split.packed and split.format == "text" and len(split) > 0
    assert (split.lengths == 32).all()  # every block full: no padding anywhere
    stream = BatchStream(split, 2, seed=0)
    for _ in range(len(split) // 2):
        _, _, _, b = stream.next()
        assert b.attention_mask.all() and (b.labels == b.input_ids).all()
    # every document, in order, is its tokens + EOS; a block's pieces name which document tokens it holds
    whole = [tok(d["text"], add_special_tokens=True)["input_ids"] + [tok.eos_token_id] for d in docs]
    stream_ids = [t for d in whole for t in d]
    got = [t for i in range(len(split)) for t in split.items[i]["input_ids"]]
    assert got == stream_ids[:len(got)] and len(stream_ids) - len(got) < 32  # only the last partial block dropped
    for i in range(len(split)):
        row = split.items[i]
        rebuilt = [t for d, a, b in row["pieces"] for t in whole[d][a:b]]
        assert rebuilt == row["input_ids"]
        for (d, a, b), nxt in zip(row["pieces"], row["pieces"][1:]):  # a document ends with EOS before the next
            assert b == len(whole[d]) and whole[d][b - 1] == tok.eos_token_id and nxt[1] == 0
        # the block's text is its pieces' characters, and each piece is an alignment segment
        assert "".join(row["text"][s:e] for s, e in row["segments"]) == row["text"]


@pytest.mark.parametrize("kind", ["text", "messages"])
def test_exact_resume_mid_epoch(smollm2_tokenizer, kind):
    tok = smollm2_tokenizer
    if kind == "text":
        rows = [{"text": f"Document {i}. " + "lorem ipsum " * (5 + 3 * i)} for i in range(40)]
    else:
        rows = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                              {"role": "assistant", "content": "Answer " * (1 + i % 7)}]} for i in range(40)]
    split = tokenize_split(tok, rows, 48, source_id=kind)
    ref = BatchStream(split, 3, seed=4)
    want = [ref.next() for _ in range(len(split) // 3 + 4)]  # into the second epoch
    stream = BatchStream(split, 3, seed=4)
    for _ in range(5):
        stream.next()
    resumed = BatchStream(split, 3, seed=4, state=json.loads(json.dumps(stream.state())))
    for k, (key, step, epoch, batch) in enumerate(want[5:]):
        got = resumed.next()
        assert got[:3] == (key, step, epoch), k
        assert all(np.array_equal(getattr(got[3], c), getattr(batch, c))
                   for c in ("input_ids", "attention_mask", "labels", "answer_mask")) and not batch.teachers


def test_teacher_of_another_tokenizer_aligns_within_each_message(smollm2_tokenizer, llama3_tokenizer):
    from kava_ray.data import teacher_view
    from kava_ray.data.alignment import canonical_spans, segment_table
    from kava_ray.data.records import render
    from kava_ray.data.tokenize import encode_rendered

    split = tokenize_split(smollm2_tokenizer, [{"messages": CHAT}], 512, source_id="x")
    view = teacher_view(split, llama3_tokenizer, "auto", 512)
    s = split.items[0]
    t = encode_rendered(llama3_tokenizer, render({"messages": CHAT}, "messages", llama3_tokenizer, teacher=True),
                        1 << 30)
    assert s["text"] != t["text"]  # SmolLM2's template vs plain turns (this Llama-3 vocab has no template)
    s_c = canonical_spans(s["offsets"], segment_table(s["segments"], len(s["text"]), False))
    t_c = canonical_spans(t["offsets"], segment_table(t["segments"], len(t["text"]), False))
    lo, hi = view.items[0]["align_lo"], view.items[0]["align_hi"]
    used = 0
    for i in range(len(lo)):
        for j in range(lo[i], hi[i]):
            assert t_c[2][j] == s_c[2][i] >= 0  # the same message
            assert s_c[0][i] < t_c[1][j] <= s_c[1][i]  # overlapping, ending no later (causal)
            used += 1
    # every content token of a message is aligned; template markup is not
    content = s_c[2] >= 0
    assert used > 0 and view.stats["aligned_fraction"] >= 0.9 * content.mean()
    assert view.stats["unanchored"] == 0


def test_pydoc_corpus_splits_by_topic(tmp_path):
    topics = pydoc_topics()
    splits = split_topics(topics)
    names = [n for v in splits.values() for n in v]
    assert sorted(names) == sorted(topics) and len(names) == len(set(names))  # every topic in exactly one split
    chars = {k: sum(len(topics[n]) for n in v) for k, v in splits.items()}
    total = sum(chars.values())
    assert chars["test"] >= 0.1 * total and chars["validation"] >= 0.1 * total and chars["train"] > 0.6 * total
    out = write_pydoc_corpus(tmp_path / "pydoc")
    rows = {k: [json.loads(x) for x in open(v["path"])] for k, v in out.items()}
    assert {k: sorted(r["topic"] for r in v) for k, v in rows.items()} == splits
    assert all(r["text"] == topics[r["topic"]] for v in rows.values() for r in v)
    # written again (a second `bench heal` into the same --out): the files, and so the source fingerprint a
    # teacher cache is keyed by, are unchanged; a file that differs is rewritten
    from kava_ray.data.sources import source_fingerprint

    src = str(tmp_path / "pydoc" / "{split}.jsonl")
    before = {k: os.stat(v["path"]).st_mtime_ns for k, v in out.items()}
    fp = source_fingerprint(src, "train", None)
    os.utime(out["test"]["path"], ns=(1, 1))
    with open(out["validation"]["path"], "a") as f:
        f.write("\n")
    write_pydoc_corpus(tmp_path / "pydoc")
    assert source_fingerprint(src, "train", None) == fp and os.stat(out["train"]["path"]).st_mtime_ns == before["train"]
    assert os.stat(out["test"]["path"]).st_mtime_ns == 1  # same bytes, whatever its mtime: left as it is
    assert [json.loads(x) for x in open(out["validation"]["path"])] == rows["validation"]  # the stray line is gone


@pytest.mark.parametrize("rows,needle", [
    ([{"text": "a"}, {"question": "q", "answer": "a"}], "is a gsm8k record, but"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "no assistant turn"),
    ([{"title": "x", "body": "y"}], "of no known format"),
    ([{"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]}], "both be strings or both lists"),
])
def test_bad_records_are_one_line_naming_the_row(rows, needle):
    with pytest.raises(KavaError) as e:
        formats_of(((f"data file x.jsonl: row {i}", r) for i, r in enumerate(rows)), "auto")
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and "x.jsonl" in msg, msg


def test_data_pydoc_command_writes_counts_and_measures_the_gap(tiny_job, tmp_path, capsys):
    from kava_ray.cli import main

    assert main(["data", "pydoc", "--out", str(tmp_path / "docs"), "--config", str(tiny_job), "--block", "64",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["splits"]) == {"train", "validation", "test"}
    for s in out["splits"].values():
        assert s["blocks"] > 0 and s["tokens"] == 64 * s["blocks"]  # packed: full blocks only
    assert set(out["test_ce"]) == {"teacher", "student"} and out["gap"] == pytest.approx(
        out["test_ce"]["student"] - out["test_ce"]["teacher"])


def test_bench_data_at_toy_sizes(tmp_path):
    """A size prepared in a fresh driver process and read in a fresh worker process (one size: each is two
    process starts); the figures the bench reports are all there (the real sizes are a bench, not a test)."""
    from kava_ray.bench.data import format_data_bench, run_data_bench

    r = run_data_bench(sizes_mb=(0.05,), max_length=32, batch_size=4, batches=5, out=str(tmp_path),
                       progress=False)
    assert [x["size_mb"] for x in r["rows"]] == [0.05] and r["rows"][0]["driver"]["tokens"] > 0
    for x in r["rows"]:
        assert x["worker"]["first_batch_s"] > 0 and x["worker"]["stream_tokens_per_s"] > 0
        assert x["worker"]["padded"] == 0.0 and x["worker"]["peak_rss_mib"] > x["worker"]["base_rss_mib"] > 0
        assert 0 < x["worker"]["peak_anon_mib"] <= x["worker"]["peak_rss_mib"]
    p = r["padding"]
    assert p["pydoc_packed"] == 0.0 < p["gsm8k_by_length"] < p["gsm8k_random"] and p["pydoc_rows"] > 0
    assert r["student_step_tokens_per_s"] > 0 and "target <= 1.5x" in format_data_bench(r)


@pytest.mark.parametrize("packing", [True, False])
def test_text_without_offsets_encodes_as_the_per_record_path(smollm2_tokenizer, llama3_tokenizer, packing):
    """The batched text path (no offsets kept: plain runs of large corpora) gives the per-record path's tokens,
    loss mask, lengths and truncation, on real tokenizers (Llama-3 adds BOS, SmolLM2 does not)."""
    topics = pydoc_topics()
    docs = [{"text": topics[n][:3000]} for n in list(topics)[:6]] + [{"text": "x"}, {"text": "Ünïcödé 123 ✓"}]
    for tok in (smollm2_tokenizer, llama3_tokenizer):
        slow = tokenize_split(tok, docs, 96, source_id="t", packing=packing, with_text=True)
        fast = tokenize_split(tok, docs, 96, source_id="t", packing=packing, with_text=False)
        assert len(fast) == len(slow) and fast.num_truncated == slow.num_truncated
        assert np.array_equal(fast.lengths, slow.lengths)
        for a, b in zip(fast.dataset, slow.dataset):
            assert a["input_ids"] == b["input_ids"] and list(a["loss_mask"]) == list(b["loss_mask"])
        if not packing:
            assert slow.num_truncated > 0  # the long documents were cut at max_length


def test_bench_data_bad_arguments_are_one_line(tmp_path, capsys):
    """`kava-ray bench data --sizes 0` (and other impossible settings): one line, exit 2, nothing written."""
    from kava_ray.cli import main

    for argv in (["--sizes", "0"], ["--sizes", "1", "-2"], ["--batches", "0"]):
        assert main(["bench", "data", "--out", str(tmp_path / "out"), *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: bench data: sizes must be > 0 MB"), err
    assert not (tmp_path / "out").exists()
