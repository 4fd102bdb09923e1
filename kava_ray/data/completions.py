"""A batch of sampled completions (on-policy distillation), built from a batch of records and the samples.

`prompts_of` cuts each row before its completion (the last run of loss tokens: a prompt_completion's
completion, a conversation's last assistant turn, a GSM8K answer); `sampled_batch` joins each prompt
with its sampled completion into a `Batch` whose loss tokens are the sampled ones, with the sampling
log-probs, and -- for every teacher of another tokenizer -- that teacher's own rendering of the
record with the sampled completion, aligned by characters exactly as the data's rows are
(`tokenize.align_item`). Pure Python + torch.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from kava_ray.common.errors import KavaError
from kava_ray.data.batching import Batch, collate, collate_view
from kava_ray.data.records import render, with_completion
from kava_ray.data.tokenize import IGNORE_INDEX, TeacherView, TokenizedSplit, align_item, encode_rendered


def prompt_starts(batch: Batch) -> list[int]:
    """Per row, where its completion starts: the first position of its last run of loss tokens (labels set)."""
    out = []
    for b in range(batch.input_ids.shape[0]):
        loss = (batch.labels[b] != IGNORE_INDEX).tolist()
        n = int(batch.attention_mask[b].sum())
        ends = [t for t in range(n) if loss[t]]
        if not ends:
            raise KavaError(f"on-policy: row {b} of the batch has no completion tokens (an empty completion, or "
                            "one cut at train.max_length): no prompt to sample a completion for")
        start = ends[-1]
        while start > 0 and loss[start - 1]:
            start -= 1
        out.append(start)
    return out


def prompts_of(batch: Batch) -> list[list[int]]:
    """Each row's prompt token ids (everything before its completion)."""
    return [batch.input_ids[b, :s].tolist() for b, s in enumerate(prompt_starts(batch))]


def completion_text(tokenizer, prompt: Sequence[int], completion: Sequence[int]) -> tuple[str, np.ndarray]:
    """(the completion's text, each completion token's character span [n, 2] in it): decoded after
    the prompt (a SentencePiece tokenizer drops a leading space when a completion is decoded alone),
    spans by decoding growing prefixes (monotone; a byte split inside a character lands on the token
    that completes it)."""
    base = tokenizer.decode(list(prompt), skip_special_tokens=True)

    def upto(j: int) -> str:
        full = tokenizer.decode(list(prompt) + list(completion[:j]), skip_special_tokens=True)
        return full[len(base):] if full.startswith(base) else tokenizer.decode(list(completion[:j]),
                                                                                 skip_special_tokens=True)

    text = upto(len(completion))
    ends, last = [], 0
    for j in range(1, len(completion) + 1):
        last = min(max(len(upto(j)), last), len(text))
        ends.append(last)
    starts = [0] + ends[:-1]
    return text, np.array(list(zip(starts, ends)), dtype=np.int64).reshape(-1, 2)


def sampled_batch(batch: Batch, rows: Sequence[int], split: TokenizedSplit, completions: Sequence[Sequence[int]],
                  logps: Sequence[Sequence[float]] | None, tokenizer, teacher_tokenizers: Mapping, max_length: int,
                  prompt_format: str = "auto", source: str = "student") -> Batch:
    """The batch with each row's completion replaced by `completions[b]` (the student's token ids;
    `logps[b]` their sampling log-probs, None for a teacher's text re-tokenized), cut at
    `max_length` tokens. rows: the batch's example indices into `split` (the records a teacher of
    another tokenizer renders); teacher_tokenizers: {teacher: tokenizer} of the teachers of another
    tokenizer (`split.views` names them)."""
    starts = prompt_starts(batch)
    items, logp_rows, texts = [], [], []
    for b, (start, comp) in enumerate(zip(starts, completions)):
        prompt = batch.input_ids[b, :start].tolist()
        comp = list(comp)[:max(0, max_length - start)]
        ids = prompt + comp
        items.append({"input_ids": ids, "labels": [IGNORE_INDEX] * start + comp,
                      "answer_mask": [0] * start + [1] * len(comp)})
        lp = list(logps[b])[:len(comp)] if logps is not None else [0.0] * len(comp)
        logp_rows.append((start, lp))
        texts.append((prompt, comp))
    out = collate(items, split.pad_id)
    out.source, out.route, out.group = source, batch.route, batch.group
    sample_logp = torch.zeros(out.input_ids.shape, dtype=torch.float32)
    for b, (start, lp) in enumerate(logp_rows):
        if lp:  # the log-prob of token t + 1 sits at position t (where the logits that predict it are)
            sample_logp[b, start - 1:start - 1 + len(lp)] = torch.tensor(lp, dtype=torch.float32)
    out.sample_logp = sample_logp if logps is not None else None
    if split.views:
        out.teachers = _teacher_inputs(split, rows, starts, texts, tokenizer, teacher_tokenizers, max_length,
                                       prompt_format, out.input_ids.shape[1])
    return out


def _teacher_inputs(split: TokenizedSplit, rows, starts, texts, tokenizer, teacher_tokenizers: Mapping,
                    max_length: int, prompt_format: str, T_s: int) -> dict:
    """{teacher: TeacherInputs} of the sampled rows for every teacher of another tokenizer: the
    record with the sampled completion, rendered and tokenized by that teacher, aligned to the
    student's tokens by characters."""
    if split.records is None or "text" not in split.dataset.column_names:
        raise KavaError("teachers of another tokenizer score a sampled completion by its text: the split needs its "
                        "records and texts")
    s_items = split.items.many(rows)
    student_items, records = [], []
    for i, s_item, start, (prompt, comp) in zip(rows, s_items, starts, texts):
        ctext, spans = completion_text(tokenizer, prompt, comp)
        offs = np.asarray(s_item["offsets"], dtype=np.int64).reshape(-1, 2)
        at = int(offs[start, 0]) if start < len(offs) else len(s_item["text"])  # where the completion starts
        rec = with_completion(split.records[int(i)], split.format, ctext)
        # the record with the sampled completion as the student renders it: the same prompt text,
        # the completion at `at`, and content segments split as the teacher's rendering splits them
        mine = render(rec, split.format, tokenizer, prompt_format)
        if mine.text[:at] != s_item["text"][:at] or mine.text[at:at + len(ctext)] != ctext:
            mine.segments = []  # the template moved the completion: this row stays unaligned
        student_items.append({"offsets": np.concatenate([offs[:start], spans + at]).tolist(), "text": mine.text,
                              "segments": [list(s) for s in mine.segments], "truncated": False})
        records.append(rec)
    out = {}
    for name, view in split.views.items():
        tok = teacher_tokenizers[name]
        items = [align_item(s, encode_rendered(tok, render(rec, split.format, tok, prompt_format, teacher=True),
                                               1 << 30), max_length)[0]
                 for s, rec in zip(student_items, records)]
        out[name] = collate_view(TeacherView(items, view.pad_id, view.tokenizer_fingerprint), range(len(items)), T_s)
    return out
