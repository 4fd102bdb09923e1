"""An offline natural-text corpus every Python install ships: CPython's reference documentation
(`pydoc_data.topics`, ~465k characters in 79 topics), as `text` records split by topic
(`split_topics`).

`kava-ray data pydoc --out DIR` writes DIR/{train,validation,test}.jsonl, one {"text", "topic"}
record per topic; a job reads them with `data.source: DIR/{split}.jsonl`, `data.val_split:
validation`.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from pydoc_data.topics import topics

from kava_ray.common.files import atomic_write

SPLITS = ("train", "validation", "test")
SHARES = {"validation": 0.1, "test": 0.1}  # the rest trains


def pydoc_topics() -> dict[str, str]:
    """{topic: text} of this Python's reference documentation."""
    return {k: v for k, v in topics.items() if v.strip()}


def split_topics(topics: dict[str, str]) -> dict[str, list[str]]:
    """Every topic in one split: topics ordered by sha256 of their name (never dict order) go to
    test until it holds 10 % of the characters, then to validation until it does too; the rest
    trains."""
    order = sorted(topics, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    total = sum(len(topics[n]) for n in order)
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    held = {s: 0 for s in SHARES}
    for n in order:
        split = next((s for s in ("test", "validation") if held[s] < SHARES[s] * total), "train")
        out[split].append(n)
        if split in held:
            held[split] += len(topics[n])
    return {s: sorted(v) for s, v in out.items()}


def pydoc_test_records() -> list[dict]:
    """The test split's {"text", "topic"} records, in `write_pydoc_corpus`'s order (the shipped
    harness task `kava_pydoc_ppl` reads them)."""
    topics = pydoc_topics()
    return [{"text": topics[n], "topic": n} for n in split_topics(topics)["test"]]


def uniform_bits_per_byte(tokenizer, texts: list[str]) -> float:
    """Bits per byte of a uniform guess over `tokenizer`'s vocabulary on `texts`: log2(V) per token,
    summed over each text's tokens (no special tokens: every token a rolling log-likelihood scores),
    over the texts' UTF-8 bytes. A model below it has learned something of the text; above it, it is
    worse than guessing."""
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    return tokens * math.log2(len(tokenizer)) / sum(len(t.encode()) for t in texts)


def write_pydoc_corpus(out_dir) -> dict:
    """Write the three splits as JSONL (atomically, one file each; a file that already holds the
    same records is left as it is, so a teacher cache computed over it stays valid); returns {split:
    {topics, records, chars, path}}."""
    topics = pydoc_topics()
    out = Path(out_dir).expanduser().resolve()
    result = {}
    for split, names in split_topics(topics).items():
        lines = [json.dumps({"text": topics[n], "topic": n}) for n in names]
        path = atomic_write(out / f"{split}.jsonl", "\n".join(lines) + "\n", keep_same=True)
        result[split] = {"topics": len(names), "records": len(lines), "chars": sum(len(topics[n]) for n in names),
                         "path": str(path)}
    return {split: result[split] for split in SPLITS}
