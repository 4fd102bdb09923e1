"""Token (time) alignment across tokenizers, by characters: teacher token positions -> student token positions.

A teacher of another tokenizer renders the same record itself; its token spans (fast tokenizers'
`offset_mapping`) and the student's are mapped into one character coordinate per record, within its
content segments (`data.records`), and student token i gets the teacher tokens lo[i]:hi[i] that
overlap it and have read nothing past it (causal); `pair_positions` finds the teacher position that
predicts the same text (for logits). Pure numpy, no tokenizer calls; done when a split is tokenized
(`tokenize.teacher_view`), applied to KV by `kava_ray.core.align.tokens.apply_alignment`. Segments,
the canonical coordinate and the causal rule: docs/internals/core.md#align-tokens.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

ANSWER_MARKER = "####"
NO_SPAN = -1


def segment_table(spans, text_len: int, same_text: bool) -> Optional[np.ndarray]:
    """Segment spans [(start, end)] of a text -> int64 [n, 3] rows (text_start, text_end, canonical_start): a
    row's canonical span is [canonical_start, canonical_start + text_end - text_start). None for no segments.
    same_text: canonical = raw offsets and the segments cover the whole text; else the contents concatenated."""
    spans = [(int(a), int(b)) for a, b in (spans or [])]
    if not spans:
        return None
    rows, prev, c = [], 0, 0
    for i, (s, e) in enumerate(spans):
        if same_text:
            end = text_len if i == len(spans) - 1 else e
            rows.append((prev, end, prev))
            prev = end
        else:
            rows.append((s, e, c))
            c += e - s
    return np.asarray(rows, dtype=np.int64)


def segment_bounds(text: str, question: str, answer: str, same_text: bool) -> Optional[np.ndarray]:
    """A GSM8K record's `segment_table`: question, reasoning and final answer (from the last
    `####`), found in `text`; None when the question, or the answer after it, is not there."""
    q0 = text.find(question)
    if q0 < 0 or not question:
        return None
    q1 = q0 + len(question)
    a0 = text.find(answer, q1)
    if a0 < 0:
        return None
    m = answer.rfind(ANSWER_MARKER)
    m = len(answer) if m < 0 else m
    return segment_table([(q0, q1), (a0, a0 + m), (a0 + m, a0 + len(answer))], len(text), same_text)


def canonical_spans(offsets: Sequence, bounds: Optional[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token offsets [(start, end)] into a text -> canonical (starts, ends, segment), int64 [T] each.

    A token goes to the segment holding most of its characters (ties: the earlier) and is clipped to
    it; tokens in no segment, empty spans (specials) and every token when `bounds` is None get -1 in
    all three.
    """
    n = len(offsets)
    off = np.asarray(offsets, dtype=np.int64).reshape(n, 2)
    none = np.full(n, NO_SPAN, dtype=np.int64)
    if bounds is None or n == 0:
        return none, none.copy(), none.copy()
    s, e = off[:, :1], off[:, 1:]  # [T, 1]
    lo, hi, c = bounds[:, 0][None], bounds[:, 1][None], bounds[:, 2][None]  # [1, 3]
    cs, ce = np.maximum(s, lo), np.minimum(e, hi)
    overlap = np.maximum(ce - cs, 0)  # [T, 3]
    seg = overlap.argmax(axis=1)  # first maximum: ties go to the earlier segment
    rows = np.arange(n)
    has = overlap[rows, seg] > 0
    shift = (c - lo)[0, seg]
    starts = np.where(has, cs[rows, seg] + shift, NO_SPAN)
    ends = np.where(has, ce[rows, seg] + shift, NO_SPAN)
    return starts, ends, np.where(has, seg, NO_SPAN)


def align_positions(s_starts, s_ends, t_starts, t_ends, causal: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Student token i uses teacher tokens lo[i]:hi[i]: those whose canonical span overlaps its own
    and, with `causal`, ends at or before its end (no teacher token that has read characters past
    it).

    Inputs: canonical spans (`canonical_spans`), -1 = no span. Returns int64 (lo, hi) [T_s]; hi == lo: unaligned.
    """
    ss, se = np.asarray(s_starts, np.int64), np.asarray(s_ends, np.int64)
    ts, te = np.asarray(t_starts, np.int64).copy(), np.asarray(t_ends, np.int64).copy()
    # spans are monotone in token order, so each student token's teacher set is one contiguous range
    # found by searchsorted; a teacher token without a span borrows its neighbours' (below) so the
    # arrays stay monotone: it never matches by itself, only inside a range whose both ends qualify
    if len(ts):
        miss = ts < 0
        big = np.iinfo(np.int64).max
        te = np.maximum.accumulate(np.where(miss, -1, te))  # previous spanned end (-1: none yet)
        ts = np.minimum.accumulate(np.where(miss, big, ts)[::-1])[::-1]  # next spanned start (big: none)
    lo = np.searchsorted(te, ss, side="right")  # first teacher token with end > student start
    hi = np.searchsorted(ts, se, side="left")  # first teacher token with start >= student end
    if causal:  # ... and before the first teacher token that ends past the student's end
        hi = np.minimum(hi, np.searchsorted(te, se, side="right"))
    hi = np.where((ss < 0) | (hi < lo), lo, hi)
    return lo.astype(np.int64), hi.astype(np.int64)


def pair_positions(s_canon, t_canon) -> np.ndarray:
    """Where a student and a teacher position predict the same text: for each student token i, the
    teacher token j ending at the same canonical character of the same segment, both followed by a
    token of that segment (a segment's last token, followed by template text, is never paired); -1
    where none. Int64 [T_s]. Inputs: each side's `canonical_spans`; see
    docs/internals/core.md#align-tokens."""
    def followed(canon) -> np.ndarray:  # has a span, and so has the next token, in the same segment
        st, en, sg = (np.asarray(a, np.int64) for a in canon)
        ok = np.zeros(len(st), dtype=bool)
        ok[:-1] = (sg[:-1] >= 0) & (sg[1:] == sg[:-1]) & (st[1:] >= en[:-1])
        return ok

    s_ok, t_ok = followed(s_canon), followed(t_canon)
    se, sg = np.asarray(s_canon[1], np.int64), np.asarray(s_canon[2], np.int64)
    te, tg = np.asarray(t_canon[1], np.int64), np.asarray(t_canon[2], np.int64)
    cand = np.flatnonzero(t_ok)  # teacher tokens that can pair; their ends increase with j (monotone spans)
    k = np.searchsorted(te[cand], se)
    j = cand[np.minimum(k, max(len(cand) - 1, 0))] if len(cand) else np.zeros(len(se), np.int64)
    hit = s_ok & (k < len(cand)) & (te[j] == se) & (tg[j] == sg) if len(cand) else np.zeros(len(se), bool)
    return np.where(hit, j, -1).astype(np.int64)


def align_texts(s_offsets, s_text: str, s_segments, t_offsets, t_text: str, t_segments):
    """One record end to end: (lo, hi, s_canon, t_canon) where *_canon = (starts, ends, segment).

    `*_segments`: each side's content spans in its own text, in one order; a record whose segments
    differ in number or content between the two sides is all-unaligned.
    """
    same = s_text == t_text
    s_segs, t_segs = list(s_segments or []), list(t_segments or [])
    anchored = len(s_segs) == len(t_segs) and all(
        s_text[a:b] == t_text[c:d] for (a, b), (c, d) in zip(s_segs, t_segs))
    s_canon = canonical_spans(s_offsets, segment_table(s_segs, len(s_text), same) if anchored else None)
    t_canon = canonical_spans(t_offsets, segment_table(t_segs, len(t_text), same) if anchored else None)
    lo, hi = align_positions(s_canon[0], s_canon[1], t_canon[0], t_canon[1])
    return lo, hi, s_canon, t_canon
