"""Cross-tokenizer token alignment (data.alignment, core.align.tokens) on real tokenizers, and its data plumbing.

Correctness is checked against a brute-force reference written here from the rule alone (per-character
segment labels, O(T_s * T_t) overlap), independent of the module's searchsorted code.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np
import pytest
import torch

from kava_ray.core.align.tokens import MODES, aligned_mask, alignment_stats, apply_alignment
from kava_ray.data import (
    BatchStream,
    Example,
    TeacherView,
    collate_view,
    encode_example,
    synthetic_gsm8k,
    teacher_view,
    tokenize_split,
)
from kava_ray.data.alignment import (
    align_positions,
    align_texts,
    canonical_spans,
    pair_positions,
    segment_bounds,
    segment_table,
)

PAIRS = [("smollm2", "qwen2"), ("smollm2", "llama3"), ("llama3", "smollm2"), ("qwen2", "llama3")]
FORMATS = ["plain", "auto"]


def tok(request, name):
    return request.getfixturevalue(f"{name}_tokenizer")


@pytest.fixture(scope="module")
def examples():
    return synthetic_gsm8k(12, seed=7)


# ----------------------------------------------------------------------------- brute-force reference


def char_labels(text: str, ex: Example, same: bool) -> list:
    """(segment, canonical char id) for every character of `text`, None outside every segment."""
    q0 = text.find(ex.question)
    a0 = text.find(ex.answer, q0 + len(ex.question)) if q0 >= 0 else -1
    if q0 < 0 or a0 < 0:
        return [None] * len(text)
    q1, a1, nq = q0 + len(ex.question), a0 + len(ex.answer), len(ex.question)
    m = a0 + (ex.answer.rfind("####") if "####" in ex.answer else len(ex.answer))
    out = []
    for p in range(len(text)):
        if same:
            out.append((0 if p < q1 else 1 if p < m else 2, p))
        elif q0 <= p < q1:
            out.append((0, p - q0))
        elif a0 <= p < m:
            out.append((1, nq + p - a0))
        elif m <= p < a1:
            out.append((2, nq + p - a0))
        else:
            out.append(None)
    return out


def token_chars(offsets, labels) -> list:
    """Per token: (segment, set of canonical char ids) by majority segment (ties: earlier), or None."""
    out = []
    for s, e in offsets:
        labs = [labels[p] for p in range(s, e) if labels[p] is not None]
        if not labs:
            out.append(None)
            continue
        counts = [sum(seg == k for seg, _ in labs) for k in range(3)]
        seg = counts.index(max(counts))
        out.append((seg, {c for k, c in labs if k == seg}))
    return out


def check_alignment(s_item, t_item, ex, lo, hi, n_teacher=None):
    """Every used teacher token overlaps the student token in the same segment and ends at or before its end
    (causal), the used set is exactly that set (restricted to the first n_teacher teacher tokens), and
    unaligned tokens have none. Returns (aligned student tokens, tokens left out only by the causal rule)."""
    same = s_item["text"] == t_item["text"]
    s_chars = token_chars(s_item["offsets"], char_labels(s_item["text"], ex, same))
    t_chars = token_chars(t_item["offsets"], char_labels(t_item["text"], ex, same))[:n_teacher]
    canon = ex.question + ex.answer
    n_aligned = n_causal = 0
    for i, sc in enumerate(s_chars):
        used = set(range(lo[i], hi[i]))
        overlapping = set() if sc is None else {
            j for j, tc in enumerate(t_chars) if tc is not None and tc[0] == sc[0] and tc[1] & sc[1]}
        causal = {j for j in overlapping if max(t_chars[j][1]) <= max(sc[1])}  # read nothing past the student
        assert used == causal, (i, s_item["text"][slice(*s_item["offsets"][i])], used, causal)
        n_aligned += bool(used)
        n_causal += bool(overlapping) and not causal
        for j in used:  # the shared characters really are the same text in both tokenizations
            shared = sorted(t_chars[j][1] & sc[1])
            if not same:
                s_txt = s_item["text"][slice(*s_item["offsets"][i])]
                t_txt = t_item["text"][slice(*t_item["offsets"][j])]
                common = "".join(canon[c] for c in shared)
                assert common in s_txt and common in t_txt, (s_txt, t_txt, common)
    return n_aligned, n_causal


def check_pairs(s_item, t_item, ex, pair, n_teacher=None):
    """The logit pairs, by brute force over character sets: student token i pairs with teacher token j (< n_teacher)
    exactly when both end at the same character of the same segment and both are followed by a token of it."""
    same = s_item["text"] == t_item["text"]
    s_chars = token_chars(s_item["offsets"], char_labels(s_item["text"], ex, same))
    t_chars = token_chars(t_item["offsets"], char_labels(t_item["text"], ex, same))

    def followed(chars, k):
        return chars[k] is not None and k + 1 < len(chars) and chars[k + 1] is not None \
            and chars[k + 1][0] == chars[k][0]

    n_t = len(t_chars) if n_teacher is None else n_teacher
    for i, sc in enumerate(s_chars):
        want = [j for j in range(n_t) if followed(s_chars, i) and followed(t_chars, j)
                and t_chars[j][0] == sc[0] and max(t_chars[j][1]) == max(sc[1])]
        assert pair[i] == (want[0] if want else -1), (i, pair[i], want)
    return sum(p >= 0 for p in pair)


# ------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_alignment_matches_brute_force(request, examples, pair, fmt):
    student, teacher = tok(request, pair[0]), tok(request, pair[1])
    split = tokenize_split(student, examples, 512, fmt, source_id="t")
    view = teacher_view(split, teacher, fmt, 512)
    total = causal = paired = 0
    for ex, s_item, v_item in zip(examples, split.items, view.items):
        t_item = encode_example(teacher, ex, 1 << 30, fmt)
        assert v_item["input_ids"] == t_item["input_ids"][:len(v_item["input_ids"])]
        for tid, (s, e) in zip(t_item["input_ids"], t_item["offsets"]):  # offsets really index the text
            if e > s and tid not in teacher.all_special_ids:
                assert teacher.decode([tid]) == t_item["text"][s:e]
        n, c = check_alignment(s_item, t_item, ex, v_item["align_lo"], v_item["align_hi"])
        total, causal = total + n, causal + c
        paired += check_pairs(s_item, t_item, ex, v_item["logit_pair"])
    assert view.stats["unanchored"] == 0 and view.stats["unaligned"] == view.stats["student_tokens"] - total
    assert view.stats["paired_fraction"] == paired / view.stats["student_tokens"] and paired <= total
    assert view.stats["causal_unaligned"] == causal
    # every content token of the student overlaps a teacher token: aligned, or left out only by the causal rule
    covered = (total + causal) / view.stats["student_tokens"]
    assert covered > (0.95 if fmt == "plain" else 0.6), view.stats


def test_causal_alignment_never_uses_a_teacher_token_that_ends_after_the_student_token(smollm2_tokenizer,
                                                                                       llama3_tokenizer):
    """SmolLM2 cuts numbers into single digits, Llama-3 into up to 3 digits: the student's "1" of "123" must not
    receive the KV of the teacher's "123" (which has read "23"); its "3" may."""
    ex = Example("Tom has 123 apples and 4567 pears. How many fruits?", "123 + 4567 = 4690.\n#### 4690")
    split = tokenize_split(smollm2_tokenizer, [ex], 512, "plain", source_id="t")
    view = teacher_view(split, llama3_tokenizer, "plain", 512)
    s_item, v_item = split.items[0], view.items[0]
    t_item = encode_example(llama3_tokenizer, ex, 1 << 30, "plain")
    s_text, t_text = s_item["text"], t_item["text"]
    q = s_text.find(ex.question)
    lo, hi = v_item["align_lo"], v_item["align_hi"]
    s_canon = canonical_spans(s_item["offsets"], segment_bounds(s_text, ex.question, ex.answer, True))
    t_canon = canonical_spans(t_item["offsets"], segment_bounds(t_text, ex.question, ex.answer, True))
    # every used teacher token ends (in the shared coordinate) where the student's does or before
    for i in range(len(lo)):
        assert all(t_canon[1][j] <= s_canon[1][i] for j in range(lo[i], hi[i])), i
    # the digits of "123" in the question: "1" and "2" uncovered, "3" takes the teacher's "123"
    digits = [i for i, (s0, s1) in enumerate(s_item["offsets"]) if q + 8 <= s0 < q + 11]
    assert [s_text[slice(*s_item["offsets"][i])] for i in digits] == ["1", "2", "3"]
    assert [hi[i] - lo[i] for i in digits] == [0, 0, 1]
    assert t_text[slice(*t_item["offsets"][lo[digits[2]]])] == "123"
    assert view.stats["causal_unaligned"] >= 2 * 4  # 123 twice and 4567 (45|67 or 456|7) at least twice
    n, causal = check_alignment(s_item, t_item, ex, lo, hi)
    assert causal == view.stats["causal_unaligned"]


def test_digit_split_mean_and_last(llama3_tokenizer, smollm2_tokenizer, examples):
    """Llama-3 keeps "48" whole, SmolLM2 splits it in single digits: mean averages exactly both, last uses the 2nd."""
    split = tokenize_split(llama3_tokenizer, examples, 512, "plain", source_id="t")
    view = teacher_view(split, smollm2_tokenizer, "plain", 512)
    found = None
    for b, (s_item, v_item) in enumerate(zip(split.items, view.items)):
        for i, (s, e) in enumerate(s_item["offsets"]):
            txt = s_item["text"][s:e]
            if len(txt) == 2 and txt.isdigit():
                found = (b, i, txt)
                break
        if found:
            break
    assert found, "no two-digit Llama-3 token in the synthetic examples"
    b, i, txt = found
    lo, hi = view.items[b]["align_lo"][i], view.items[b]["align_hi"][i]
    t_item = encode_example(smollm2_tokenizer, examples[b], 1 << 30, "plain")
    assert hi - lo == 2 and [t_item["text"][slice(*t_item["offsets"][j])] for j in (lo, hi - 1)] == list(txt)
    T_t = len(view.items[b]["input_ids"])
    x = torch.randn(3, 1, 2, T_t, 8)
    lo_t, hi_t = (torch.tensor([view.items[b][k]]) for k in ("align_lo", "align_hi"))
    mean = apply_alignment(x, lo_t, hi_t, "mean")[..., i, :]
    torch.testing.assert_close(mean, (x[..., lo, :] + x[..., lo + 1, :]) / 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_alignment(x, lo_t, hi_t, "last")[..., i, :], x[..., lo + 1, :])
    torch.testing.assert_close(apply_alignment(x, lo_t, hi_t, "first")[..., i, :], x[..., lo, :])


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_tokenizer_is_identity(smollm2_tokenizer, examples, fmt):
    split = tokenize_split(smollm2_tokenizer, examples, 512, fmt, source_id="t")
    view = teacher_view(split, smollm2_tokenizer, fmt, 512)
    for s_item, v_item in zip(split.items, view.items):
        assert v_item["input_ids"][:len(s_item["input_ids"])] == s_item["input_ids"]
        content = np.array([e > s for s, e in s_item["offsets"]])
        idx = np.arange(len(content))
        np.testing.assert_array_equal(np.array(v_item["align_lo"])[content], idx[content])
        np.testing.assert_array_equal(np.array(v_item["align_hi"])[content], idx[content] + 1)
        assert content.sum() >= len(content) - 1  # plain: only the appended EOS has no span
    assert view.stats["teacher_per_student"] == 1.0


def test_batching_equals_one_at_a_time(smollm2_tokenizer, llama3_tokenizer, examples):
    split = tokenize_split(smollm2_tokenizer, examples, 512, "auto", source_id="t")
    split.views["llama"] = view = teacher_view(split, llama3_tokenizer, "auto", 512)
    assert isinstance(view, TeacherView) and len(view) == len(split)
    stream = BatchStream(split, batch_size=4, seed=0, bucket=False)
    torch.manual_seed(0)
    per_sample_kv = [torch.randn(2, 1, 2, len(it["input_ids"]), 8) for it in view.items]
    for _ in range(3):
        _, _, _, batch = stream.next()
        B, T_s = batch.input_ids.shape
        part = batch.teachers["llama"]
        lo, hi, t_ids, t_mask = part.align_lo, part.align_hi, part.input_ids, part.attention_mask
        assert lo.shape == hi.shape == (B, T_s) and t_ids.shape == t_mask.shape and t_ids.dtype == torch.long
        # which examples are in the batch: match the student rows back to items
        rows = [next(k for k, it in enumerate(split.items) if batch.input_ids[b, :len(it["input_ids"])].tolist()
                     == it["input_ids"] and int(batch.attention_mask[b].sum()) == len(it["input_ids"]))
                for b in range(B)]
        assert len({len(split.items[k]["input_ids"]) for k in rows}) > 1  # really different lengths
        x = torch.zeros(2, B, 2, t_ids.shape[1], 8)
        for b, k in enumerate(rows):
            n, m = len(view.items[k]["input_ids"]), len(split.items[k]["input_ids"])
            assert t_ids[b, :n].tolist() == view.items[k]["input_ids"] and int(t_mask[b].sum()) == n
            assert (t_ids[b, n:] == view.pad_id).all()
            assert lo[b, :m].tolist() == view.items[k]["align_lo"] and (lo[b, m:] == 0).all() and (hi[b, m:] == 0).all()
            x[:, b:b + 1, :, :n] = per_sample_kv[k]
        for mode in MODES:
            out = apply_alignment(x, lo, hi, mode)
            for b, k in enumerate(rows):
                m = len(split.items[k]["input_ids"])
                one = apply_alignment(per_sample_kv[k], torch.tensor([view.items[k]["align_lo"]]),
                                      torch.tensor([view.items[k]["align_hi"]]), mode)
                torch.testing.assert_close(out[:, b:b + 1, :, :m], one, rtol=1e-5, atol=1e-5)
                assert (out[:, b, :, m:] == 0).all()
        same = collate_view(view, rows, T_s)
        assert all(torch.equal(getattr(same, f.name), getattr(part, f.name)) for f in dataclasses.fields(part))


def test_batches_without_views_unchanged(tiny_tokenizer, examples):
    split = tokenize_split(tiny_tokenizer, examples, 512, "plain", source_id="t")
    _, _, _, batch = BatchStream(split, batch_size=4, seed=0).next()
    assert batch.teachers == {}


def reference_apply(x, lo, hi, mode):
    *lead, B, H, T_t, D = x.shape
    out = torch.zeros(*lead, B, H, lo.shape[1], D, dtype=torch.float64)
    for b in range(B):
        for i in range(lo.shape[1]):
            a, z = int(lo[b, i]), int(hi[b, i])
            if z <= a:
                continue
            seg = x[..., b, :, a:z, :].double()
            out[..., b, :, i, :] = (seg.mean(-2) if mode == "mean" else seg[..., -1, :] if mode == "last"
                                    else seg[..., 0, :])
    return out


@pytest.mark.parametrize("mode", MODES)
def test_apply_alignment_vs_loop(mode):
    g = torch.Generator().manual_seed(1)
    L, B, H, T_t, T_s, D = 3, 3, 2, 17, 11, 5
    x = torch.randn(L, B, H, T_t, D, generator=g)
    lo = torch.randint(0, T_t, (B, T_s), generator=g)
    hi = (lo + torch.randint(0, 4, (B, T_s), generator=g)).clamp(max=T_t)
    hi[0, :3] = lo[0, :3]  # some unaligned
    lo[1, 0], hi[1, 0] = 0, T_t  # the whole teacher sequence
    out = apply_alignment(x, lo, hi, mode)
    assert out.shape == (L, B, H, T_s, D) and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), reference_apply(x, lo, hi, mode), rtol=1e-5, atol=1e-5)
    assert (out[:, 0, :, :3] == 0).all()
    xb = x.to(torch.bfloat16)  # low-precision KV keeps its dtype, sums still accumulate in float32
    outb = apply_alignment(xb, lo, hi, mode)
    assert outb.dtype == torch.bfloat16
    torch.testing.assert_close(outb.double(), reference_apply(xb, lo, hi, mode), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="mode"):
        apply_alignment(x, lo, hi, "median")


def test_stats_and_mask():
    lo = torch.tensor([[0, 1, 3, 3], [0, 0, 0, 0]])
    hi = torch.tensor([[1, 3, 3, 4], [2, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert aligned_mask(lo, hi).tolist() == [[True, True, False, True], [True, False, False, False]]
    st = alignment_stats(lo, hi, mask)
    assert st["aligned_fraction"].item() == pytest.approx(4 / 6)
    assert st["teacher_per_student"].item() == pytest.approx((1 + 2 + 1 + 2) / 4)
    assert st["unaligned"].item() == 2 and st["unaligned"].dtype == torch.int64


def test_canonical_spans_rules():
    q, a = "How many?", "2 + 2 = 4.\n#### 4"
    text = "Question: " + q + "\nAnswer: " + a
    same = segment_bounds(text, q, a, True)
    content = segment_bounds(text, q, a, False)
    q1, m = len("Question: " + q), len("Question: " + q + "\nAnswer: ") + a.index("####")
    # a token crossing a boundary: majority wins, clipped; specials / template tokens get no span
    offs = [(0, 0), (0, 9), (q1 - 1, q1 + 3), (q1 - 3, q1 + 1), (m - 2, m + 2), (m - 1, m + 4), (len(text), len(text))]
    s, e, seg = canonical_spans(offs, same)
    assert seg.tolist() == [-1, 0, 1, 0, 1, 2, -1]
    assert list(zip(s.tolist(), e.tolist()))[1:6] == [(0, 9), (q1, q1 + 3), (q1 - 3, q1), (m - 2, m), (m, m + 4)]
    s, e, seg = canonical_spans(offs, content)
    nq = len(q)
    assert seg.tolist() == [-1, -1, 0, 0, 1, 2, -1]  # "Question: " is template in content mode
    assert (s[2], e[2]) == (nq - 1, nq) and (s[5], e[5]) == (nq + a.index("####"), nq + a.index("####") + 4)
    assert segment_bounds(text.upper(), q, a, False) is None  # a rewritten question: all-unaligned
    assert (canonical_spans(offs, None)[2] == -1).all()
    # no-span teacher tokens neither match nor break monotonicity, even between overlapping ones
    spans = (np.array([0, 5, -1]), np.array([5, 9, -1]), np.array([-1, 0, 3, -1, 6, -1]),
             np.array([-1, 3, 6, -1, 9, -1]))
    lo, hi = align_positions(*spans, causal=False)
    assert lo.tolist()[:2] == [1, 2] and hi.tolist()[:2] == [3, 5] and lo[2] == hi[2]
    lo, hi = align_positions(*spans)  # causal: teacher [3, 6) ends after student [0, 5): only [0, 3) is used
    assert lo.tolist()[:2] == [1, 2] and hi.tolist()[:2] == [2, 5] and lo[2] == hi[2]
    lo, hi = align_positions(np.array([0]), np.array([3]), np.array([0, -1]), np.array([3, -1]))
    assert (lo[0], hi[0]) == (0, 1)


def test_rewriting_template_is_unaligned_not_an_error(smollm2_tokenizer, examples):
    shouting = copy.deepcopy(smollm2_tokenizer)
    shouting.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}"
                              "<|im_end|>\n{% endfor %}")
    split = tokenize_split(smollm2_tokenizer, examples[:4], 512, "auto", source_id="t")
    view = teacher_view(split, shouting, "auto", 512)
    assert view.stats["unanchored"] == 4 and view.stats["aligned_fraction"] == 0.0
    assert all(lo == hi for it in view.items for lo, hi in zip(it["align_lo"], it["align_hi"]))


@pytest.mark.filterwarnings("ignore:.*exceed max_length")
def test_truncation_drops_and_caps(llama3_tokenizer, smollm2_tokenizer, examples):
    """Student (Llama-3) cut at 48 tokens; the SmolLM2 teacher needs more tokens for the same text: capped at 48."""
    split = tokenize_split(llama3_tokenizer, examples, 48, "plain", source_id="t")
    view = teacher_view(split, smollm2_tokenizer, "plain", 48)
    assert view.stats["teacher_capped"] > 0 and view.stats["unaligned"] > 0
    for ex, s_item, v_item in zip(examples, split.items, view.items):
        n = len(v_item["input_ids"])
        assert n <= 48 and max(v_item["align_hi"]) <= n
        t_item = encode_example(smollm2_tokenizer, ex, 1 << 30, "plain")
        check_alignment(s_item, t_item, ex, v_item["align_lo"], v_item["align_hi"], n_teacher=n)
        check_pairs(s_item, t_item, ex, v_item["logit_pair"], n_teacher=n)  # never a teacher position cut off
    # a loose student cut: the teacher keeps only what overlaps the student's text
    split = tokenize_split(smollm2_tokenizer, examples, 40, "plain", source_id="t")
    view = teacher_view(split, llama3_tokenizer, "plain", 40)
    for ex, s_item, v_item in zip(examples, split.items, view.items):
        t_item = encode_example(llama3_tokenizer, ex, 1 << 30, "plain")
        n = len(v_item["input_ids"])
        assert n < len(t_item["input_ids"]) and v_item["align_hi"][-1] == n  # last kept token is used
        check_alignment(s_item, t_item, ex, v_item["align_lo"], v_item["align_hi"], n_teacher=n)
        assert check_pairs(s_item, t_item, ex, v_item["logit_pair"], n_teacher=n) > 0


def test_alignment_time_8x512(smollm2_tokenizer, llama3_tokenizer):
    """8 samples x 512 student tokens: spans + align_positions + pair_positions + collate + apply_alignment on
    [4, 8, 2, 512, 64]."""
    pool = synthetic_gsm8k(200, seed=11)
    exs = [Example(pool[8 * k].question, "\n".join(p.answer.split("####")[0] for p in pool[8 * k:8 * k + 8] * 3)
                   + "#### 5") for k in range(8)]
    s_items = [encode_example(smollm2_tokenizer, ex, 512, "auto") for ex in exs]
    t_items = [encode_example(llama3_tokenizer, ex, 1 << 30, "auto") for ex in exs]
    assert all(len(it["input_ids"]) == 512 for it in s_items)
    t0 = time.perf_counter()
    items = []
    for ex, s, t in zip(exs, s_items, t_items):
        lo, hi, s_c, t_c = align_texts(s["offsets"], s["text"], s["segments"], t["offsets"], t["text"], t["segments"])
        n = min(int(hi.max()), 512)
        pair = pair_positions(s_c, t_c)
        items.append({"input_ids": t["input_ids"][:n], "align_lo": np.minimum(lo, n).tolist(),
                      "align_hi": np.minimum(hi, n).tolist(), "logit_pair": np.where(pair < n, pair, -1).tolist()})
    batch = collate_view(TeacherView(items, 0, "fp"), range(8), 512)
    t1 = time.perf_counter()
    x = torch.randn(4, 8, 2, batch.input_ids.shape[1], 64)
    t2 = time.perf_counter()
    out = {m: apply_alignment(x, batch.align_lo, batch.align_hi, m) for m in MODES}
    t3 = time.perf_counter()
    assert out["mean"].shape == (4, 8, 2, 512, 64)
    frac = alignment_stats(batch.align_lo, batch.align_hi, torch.ones(8, 512))["aligned_fraction"].item()
    print(f"\n8x512 alignment (SmolLM2 student, Llama-3 teacher, T_t={x.shape[3]}, aligned {frac:.3f}): "
          f"spans+align_positions+collate {1e3 * (t1 - t0):.1f} ms, apply_alignment "
          f"{1e3 * (t3 - t2) / 3:.1f} ms per mode on {tuple(x.shape)}")


def test_logit_positions_pair_only_where_both_tokenizations_end_at_the_same_character():
    """Hand-checked on real tokenizers: SmolLM2 (the student) cuts numbers into digits, Llama-3 into runs of up to
    three. A student position pairs with the teacher position that has read exactly the same text and is followed,
    as it is, by more of the segment: '2' of '2024' (read '2') has no partner, the second '2' pairs with '202',
    '5' of '3.50' has none, '0' pairs with '50'. The last token (followed by no text) pairs with nothing."""
    from kava_ray.testing.tokenizers import real_tokenizer

    text = "In 2024, Ada paid $3.50 for 12 apples."
    bounds = segment_table([(0, len(text))], len(text), True)

    def side(name):
        enc = real_tokenizer(name)(text, return_offsets_mapping=True, add_special_tokens=False)
        return [text[a:b] for a, b in enc["offset_mapping"]], canonical_spans(enc["offset_mapping"], bounds)

    (s_words, s_canon), (t_words, t_canon) = side("smollm2"), side("llama3")
    pairs = pair_positions(s_canon, t_canon)
    assert [(w, t_words[j] if j >= 0 else None) for w, j in zip(s_words, pairs)] == [
        ("In", "In"), (" ", " "), ("2", None), ("0", None), ("2", "202"), ("4", "4"), (",", ","), (" Ada", " Ada"),
        (" paid", " paid"), (" $", " $"), ("3", "3"), (".", "."), ("5", None), ("0", "50"), (" for", " for"),
        (" ", " "), ("1", None), ("2", "12"), (" apples", " apples"), (".", None)]
    # the teacher never has read past the student: a paired teacher token ends where the student token does
    paired = pairs >= 0
    assert (t_canon[1][pairs[paired]] == s_canon[1][paired]).all()
    # one tokenizer on both sides: every position but the last pairs with itself
    same = pair_positions(s_canon, s_canon)
    assert same.tolist() == list(range(len(s_words) - 1)) + [-1]


def test_logit_positions_do_not_pair_across_a_segment_end():
    """The last token of a segment (a question, before the answer's template text) predicts markup, not the
    segment's text: it is not paired, though both sides end there."""
    # tokens (start, end) in one canonical coordinate; segments [0, 6) and [6, 10)
    s = canonical_spans([(0, 3), (3, 6), (6, 8), (8, 10)], np.array([[0, 6, 0], [6, 10, 6]]))
    t = canonical_spans([(0, 6), (6, 10)], np.array([[0, 6, 0], [6, 10, 6]]))
    assert pair_positions(s, t).tolist() == [-1, -1, -1, -1]  # 6: a segment's end; 10: the text's end
    t2 = canonical_spans([(0, 3), (3, 6), (6, 10)], np.array([[0, 6, 0], [6, 10, 6]]))
    assert pair_positions(s, t2).tolist() == [0, -1, -1, -1]
