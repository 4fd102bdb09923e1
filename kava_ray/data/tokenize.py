"""Tokenization with label masking: prompts (chat template or plain), examples, whole splits.

Labels follow the HF convention: unshifted, -100 where no loss.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from kava_ray.align.tokens import align_positions, align_texts
from kava_ray.data.sources import load_examples
from kava_ray.data.synthetic import Example
from kava_ray.errors import KavaError

IGNORE_INDEX = -100
PLAIN_PROMPT = "Question: {q}\nAnswer: "


def _sha(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """Stable short hash of what decides token ids: vocab, bos/eos/pad, and the ids of a probe text.

    The probe catches pre-tokenizer/normaliser differences; the tokenizer class and an unused unk
    token do not count (transformers may load one tokenizer file as different classes).
    """
    vocab = sorted(tokenizer.get_vocab().items())
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token")}
    probe = tokenizer("Tom buys 12 apples at $3.50 each; naïve 東京 costs\n  1,000 -> 3*4=12", add_special_tokens=True)
    return _sha(vocab, specials, list(probe["input_ids"]))


def _use_chat(tokenizer, prompt_format: str) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat" and not has_template:
        raise KavaError("data.prompt_format=chat but the tokenizer has no chat template (use auto or plain)")
    if prompt_format not in ("auto", "chat", "plain"):
        raise KavaError(f"data.prompt_format must be auto, chat or plain, not '{prompt_format}'")
    return prompt_format == "chat" or (prompt_format == "auto" and has_template)


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _ids_offsets(tokenizer, text: str, special: bool = False) -> tuple[list[int], Optional[list[tuple[int, int]]]]:
    """Token ids and (start, end) char offsets into `text` (offsets None for slow tokenizers)."""
    if not getattr(tokenizer, "is_fast", False):
        return _ids(tokenizer, text, special), None
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]


def _prompt_text(tokenizer, question: str, chat: bool) -> str:
    if chat:
        msgs = [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return PLAIN_PROMPT.format(q=question)


def _encode_prompt(tokenizer, question: str, chat: bool) -> tuple[list[int], Optional[list], str]:
    """(ids, offsets into the prompt text, prompt text)."""
    text = _prompt_text(tokenizer, question, chat)
    if chat:
        ids, offs = _ids_offsets(tokenizer, text)
        return ids, offs, text
    ids, offs = _ids_offsets(tokenizer, text, special=True)  # BOS if the tokenizer adds one
    if ids and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]  # some tokenizers append EOS; the prompt must stay open
        offs = offs[:-1] if offs is not None else None
    return ids, offs, text


def encode_prompt(tokenizer, question: str, prompt_format: str = "auto") -> list[int]:
    """Token ids of the prompt alone (what generation starts from in GSM8K evaluation)."""
    return _encode_prompt(tokenizer, question, _use_chat(tokenizer, prompt_format))[0]


def encode_example(tokenizer, ex: Example, max_length: int, prompt_format: str = "auto",
                   overlength: str = "truncate", index: Optional[int] = None) -> dict:
    """Token ids + labels (-100 on the prompt) + answer_mask for one example; truncates or raises.

    Also `text`, the exact string the example was tokenized as (chat template applied, or the plain
    prompt + answer), and `offsets`, each token's (start, end) char offsets into it (empty spans for
    specials not in the text, e.g. BOS/EOS; None for a slow tokenizer). The plain format tokenizes prompt
    and answer separately (ids unchanged); its offsets index their concatenation.
    """
    chat = _use_chat(tokenizer, prompt_format)
    prompt, prompt_offs, prompt_text = _encode_prompt(tokenizer, ex.question, chat)
    if chat:
        msgs = [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.answer}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        ids, offsets = _ids_offsets(tokenizer, text)
        n_prompt = 0  # the prompt is a token prefix of the full text; stop at the first difference
        while n_prompt < min(len(prompt), len(ids)) and prompt[n_prompt] == ids[n_prompt]:
            n_prompt += 1
    else:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        answer_ids, answer_offs = _ids_offsets(tokenizer, ex.answer)
        ids, n_prompt = prompt + answer_ids + eos, len(prompt)
        text, k = prompt_text + ex.answer, len(prompt_text)
        offsets = None if prompt_offs is None else (
            prompt_offs + [(a + k, b + k) for a, b in answer_offs] + [(len(text), len(text))] * len(eos))
    truncated = len(ids) > max_length
    if truncated and overlength == "error":
        where = f"example {index}" if index is not None else "example"
        raise KavaError(f"{where} has {len(ids)} tokens > train.max_length={max_length} "
                        "(raise max_length or set data.overlength=truncate)")
    ids = ids[:max_length]
    labels = [IGNORE_INDEX] * min(n_prompt, len(ids)) + ids[n_prompt:]
    return {"input_ids": ids, "labels": labels, "answer_mask": [int(lab != IGNORE_INDEX) for lab in labels],
            "truncated": truncated, "offsets": offsets[:max_length] if offsets is not None else None,
            "text": text}


@dataclass
class TokenizedSplit:
    """The encoded examples of one split, identified by `fingerprint` (content + settings hash)."""

    items: list[dict]  # encode_example outputs, in example order
    examples: list[Example]  # the source texts (teachers with other tokenizers, evaluation)
    fingerprint: str
    num_truncated: int
    pad_id: int
    lengths: list[int] = field(default_factory=list)
    views: dict[str, "TeacherView"] = field(default_factory=dict)  # teacher name -> its own tokenization

    def __post_init__(self):
        self.lengths = [len(it["input_ids"]) for it in self.items]

    def __len__(self) -> int:
        return len(self.items)


def tokenize_split(tokenizer, examples: Sequence[Example], max_length: int, prompt_format: str = "auto",
                   overlength: str = "truncate", source_id: str = "") -> TokenizedSplit:
    """Encode every example; `source_id` names the data (e.g. "synthetic/train/n=512/seed=0")."""
    items = [encode_example(tokenizer, ex, max_length, prompt_format, overlength, index=i)
             for i, ex in enumerate(examples)]
    n_trunc = sum(it["truncated"] for it in items)
    if n_trunc:
        warnings.warn(f"{n_trunc} of {len(items)} examples ({source_id}) exceed max_length={max_length} "
                      "tokens and were truncated", stacklevel=2)
    content = b"".join(np.asarray(it["input_ids"] + [-1, it["answer_mask"].count(0)], np.int64).tobytes()
                       for it in items)
    fp = _sha(source_id, tokenizer_fingerprint(tokenizer), max_length, prompt_format, content)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TokenizedSplit(items, list(examples), fp, n_trunc, pad if pad is not None else 0)


@dataclass
class TeacherView:
    """A split as a teacher with its own tokenizer sees it, aligned to the split's student tokens.

    items[i]: `input_ids` (the teacher's tokens of example i, cut as described in `teacher_view`),
    `align_lo` / `align_hi` (one per student token: student token j uses teacher tokens
    align_lo[j]:align_hi[j]; equal = unaligned). stats: over the whole split (`teacher_view`).
    """

    items: list[dict]
    pad_id: int
    tokenizer_fingerprint: str
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)


def teacher_view(split: TokenizedSplit, tokenizer, prompt_format: str, max_length: int,
                 mode_unused=None) -> TeacherView:
    """Encode every example of `split` with a teacher's `tokenizer` and align it to the student's tokens.

    The teacher uses the same `prompt_format` setting (with `auto` it applies its own chat template if it
    has one). Alignment per example: `kava_ray.align.tokens.align_texts` (character offsets, segment-aware).
    Truncation: the student items are already cut to max_length; for a truncated student item, teacher
    tokens that end past the student's last covered character (unusable by the causal alignment) are dropped (a
    teacher token without a span stays only if a kept one follows it; an untruncated item keeps the whole
    teacher sequence, so a teacher sharing the student's tokenizer gets exactly the student's ids), then
    the teacher sequence is capped at max_length tokens; student positions the cap cuts off entirely
    become unaligned (counted). At least one teacher token is kept.

    stats (python numbers): aligned_fraction (aligned student tokens / student tokens), teacher_per_student
    (mean range width over aligned tokens), unaligned (student tokens), causal_unaligned (student tokens that
    some teacher token overlaps but every one ends after them: left out by the causal rule, within
    `unaligned`), student_tokens, teacher_tokens,
    unanchored (examples whose question/answer is missing from either text: all-unaligned), teacher_capped
    (examples the max_length cap cut), same_text (examples where teacher and student texts are identical).
    `mode_unused` is accepted for call-site symmetry; the reduction mode is applied at training time.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    items, n_tok, n_ok, width, n_t, unanchored, capped, same, causal = [], 0, 0, 0, 0, 0, 0, 0, 0
    for i, (ex, s_item) in enumerate(zip(split.examples, split.items)):
        if s_item.get("offsets") is None or "text" not in s_item:
            raise KavaError("cross-tokenizer alignment needs fast (Rust) tokenizers with offset mappings; "
                            f"example {i} of the student split has no offsets")
        t_item = encode_example(tokenizer, ex, 1 << 30, prompt_format, "truncate", index=i)
        if t_item["offsets"] is None:
            raise KavaError("cross-tokenizer alignment needs a fast (Rust) teacher tokenizer with offset mappings")
        lo, hi, s_canon, t_canon = align_texts(s_item["offsets"], s_item["text"], t_item["offsets"],
                                               t_item["text"], ex.question, ex.answer)
        same += s_item["text"] == t_item["text"]
        if (s_canon[2] < 0).all() or (t_canon[2] < 0).all():
            unanchored += 1
        ids = t_item["input_ids"]
        n_keep = len(ids)
        if s_item.get("truncated"):  # drop what the causal alignment cannot use: tokens ending past the student's text
            covered = int(s_canon[1].max()) if len(s_canon[1]) else -1
            keep = np.flatnonzero((t_canon[0] >= 0) & (t_canon[1] <= covered))
            n_keep = int(keep[-1]) + 1 if len(keep) else 0
        capped += n_keep > max_length
        n_keep = max(1, min(n_keep, max_length)) if ids else 0
        hi = np.minimum(hi, n_keep)
        lo = np.minimum(lo, hi)
        ok = hi > lo
        lo_o, hi_o = align_positions(s_canon[0], s_canon[1], t_canon[0], t_canon[1], causal=False)
        causal += int(((np.minimum(hi_o, n_keep) > np.minimum(lo_o, n_keep)) & ~ok).sum())
        n_tok, n_ok, width, n_t = n_tok + len(lo), n_ok + int(ok.sum()), width + int((hi - lo).sum()), n_t + n_keep
        items.append({"input_ids": list(ids[:n_keep]), "align_lo": lo.tolist(), "align_hi": hi.tolist()})
    stats = {"aligned_fraction": n_ok / max(n_tok, 1), "teacher_per_student": width / max(n_ok, 1),
             "unaligned": n_tok - n_ok, "causal_unaligned": causal, "student_tokens": n_tok, "teacher_tokens": n_t,
             "unanchored": unanchored, "teacher_capped": capped, "same_text": same}
    return TeacherView(items, pad if pad is not None else 0, tokenizer_fingerprint(tokenizer), stats)


def load_split(data_cfg, tokenizer, split: str, n: int, max_length: int) -> TokenizedSplit:
    """load_examples + tokenize_split from a `DataConfig` (the glue train/eval use)."""
    c = data_cfg
    examples = load_examples(c.source, split, n, c.seed, c.hub_config)
    source_id = f"{c.source}|{c.hub_config}|{split}|n={n}|seed={c.seed}"
    return tokenize_split(tokenizer, examples, max_length, c.prompt_format, c.overlength, source_id)
