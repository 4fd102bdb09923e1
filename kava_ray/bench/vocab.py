"""`kava-ray bench vocab`: what a teacher of another tokenizer can give the student's logits, for real pairs.

For every ordered (teacher, student) pair of the real SmolLM2, Qwen2 and Llama-3 tokenizers
(`kava_ray.testing.tokenizers`, no download at run time): the vocabulary map's coverage, and on
natural text and on math word problems the share of student tokens with a teacher position to
compare logits with, beside the KV alignment's share. Tokenization only: no model runs (~1 min on a
2-core CPU). The figures: docs/internals/runtime.md#bench-vocab.
"""

from __future__ import annotations

import warnings
from typing import Optional

from kava_ray.common.files import format_table
from kava_ray.core.align.vocab import build_vocab_map
from kava_ray.data import teacher_view, tokenize_split
from kava_ray.data.corpus import pydoc_topics
from kava_ray.data.synthetic import synthetic_gsm8k
from kava_ray.testing.tokenizers import real_tokenizer

NAMES = ("smollm2", "qwen2", "llama3")


def _corpora(docs: int, problems: int) -> dict[str, list]:
    topics = pydoc_topics()
    return {"python docs": [{"text": topics[k]} for k in sorted(topics)[:docs]],
            "math problems": synthetic_gsm8k(problems, seed=0)}


def run_vocab_bench(names=NAMES, docs: int = 24, problems: int = 64, max_length: int = 512) -> dict:
    """{"pairs": [{teacher, student, map: {coverage, student_coverage, matched}, <corpus>: {paired,
    kv, student_tokens}}], "config"}."""
    toks = {n: real_tokenizer(n) for n in names}
    corpora = _corpora(docs, problems)
    pairs = []
    for s in names:
        with warnings.catch_warnings():  # long doc topics are cut at max_length: said in the table's header
            warnings.simplefilter("ignore", UserWarning)
            splits = {c: tokenize_split(toks[s], recs, max_length, "auto", "truncate",
                                        source_id=f"bench-vocab/{c}", packing=False)
                      for c, recs in corpora.items()}
        for t in names:
            if t == s:
                continue
            m = build_vocab_map(toks[s], toks[t])
            row = {"teacher": t, "student": s,
                   "map": {"coverage": m.coverage, "student_coverage": m.student_coverage, "matched": m.matched}}
            for c, split in splits.items():
                st = teacher_view(split, toks[t], "auto", max_length).stats
                row[c] = {"paired": st["paired_fraction"], "kv": st["aligned_fraction"],
                          "student_tokens": st["student_tokens"]}
            pairs.append(row)
    return {"pairs": pairs, "config": {"docs": docs, "problems": problems, "max_length": max_length,
                                       "corpora": list(corpora)}}


def format_vocab_bench(r: dict, corpora: Optional[list] = None) -> str:
    corpora = corpora or r["config"]["corpora"]
    heads = ["teacher -> student", "map: teacher vocab", "student vocab reached"]
    for c in corpora:
        heads += [f"paired ({c})", f"kv aligned ({c})"]
    rows = []
    for p in r["pairs"]:
        row = [f"{p['teacher']} -> {p['student']}", f"{p['map']['coverage']:.1%}",
               f"{p['map']['student_coverage']:.1%}"]
        for c in corpora:
            row += [f"{p[c]['paired']:.1%}", f"{p[c]['kv']:.1%}"]
        rows.append(row)
    cfg = r["config"]
    tokens = {c: r["pairs"][0][c]["student_tokens"] for c in corpora}
    return "\n".join([
        f"vocab bench: real tokenizers, {cfg['docs']} Python doc topics and {cfg['problems']} math problems "
        f"(each cut at {cfg['max_length']} student tokens; "
        f"{', '.join(f'{c}: {n} tokens of the first student' for c, n in tokens.items())})",
        "map: share of the teacher's vocabulary with a student token of the same string (the hybrid loss's matched "
        "weight), and of the student's it reaches; paired: student tokens whose next-token distribution meets a "
        "teacher's (logit_aligned); kv aligned: student tokens the KV alignment covers (aligned)",
        format_table(heads, rows)])
