"""Record formats: what a row of a dataset is, which of its tokens carry loss, and where its content lies.

Four formats (TRL's conventions), detected from a row's fields after `data.columns` or set by
`data.format`: `text`, `prompt_completion` (strings or message lists), `messages` and `gsm8k`.
`render` turns a row into `Rendered`: text pieces tokenized one by one, the character spans that
carry loss, and the content segments a teacher of another tokenizer aligns within. Pure Python. Each
format's rules: docs/internals/core.md#records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from kava_ray.common.errors import KavaError
from kava_ray.data.alignment import ANSWER_MARKER

FORMATS = ("text", "prompt_completion", "messages", "gsm8k")
FIELDS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "gsm8k": ("question", "answer"),
          "text": ("text",)}  # in detection order: a row with messages and text is a conversation
ROLES = ("system", "user", "assistant", "tool")
PLAIN_PROMPT = "Question: {q}\nAnswer: "


@dataclass
class Piece:
    """Text tokenized on its own; `loss` is True (every token), False, or character spans (within
    the whole rendered text) whose tokens carry loss, each followed by the template's end-of-turn
    token."""

    text: str
    loss: object = False
    specials: bool = False  # tokenized with the tokenizer's own special tokens (BOS) -- the first piece only


@dataclass
class Rendered:
    pieces: list[Piece]
    segments: list[tuple[int, int]] = field(default_factory=list)  # content spans, canonical order
    eos: bool = False  # append the EOS token (with loss) after the last piece

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)


def detect_format(row: Mapping) -> Optional[str]:
    """The format a row's non-empty fields name (`FIELDS`, in order), or None."""
    present = {k for k, v in row.items() if v is not None}
    return next((f for f, keys in FIELDS.items() if all(k in present for k in keys)), None)


def expected() -> str:
    return " | ".join("+".join(keys) for keys in FIELDS.values())


def rename(row: Mapping, columns: Optional[Mapping[str, str]]) -> dict:
    """A row with `data.columns` applied: {canonical field: dataset column} -> the canonical names."""
    if not columns:
        return dict(row)
    out = {k: v for k, v in row.items() if k not in set(columns.values())}
    for canonical, column in columns.items():
        if column in row:
            out[canonical] = row[column]
    return out


def _is_messages(x) -> bool:
    return isinstance(x, list) and all(isinstance(m, Mapping) for m in x)


def _check_messages(msgs, where: str, what: str, need_assistant: bool) -> None:
    if not _is_messages(msgs) or not msgs:
        raise KavaError(f"{where}: '{what}' must be a non-empty list of {{role, content}} messages")
    for i, m in enumerate(msgs):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise KavaError(f"{where}: '{what}' message {i} needs a role ({', '.join(ROLES)}) and a string content "
                            f"(got {dict(m)!r:.80})")
    if need_assistant and not any(m["role"] == "assistant" for m in msgs):
        raise KavaError(f"{where}: '{what}' has no assistant turn (the loss is on assistant turns)")


def check_record(row: Mapping, fmt: str, where: str) -> None:
    """One KavaError line naming `where` (the file and the row) when `row` is not a valid `fmt` record."""
    if not isinstance(row, Mapping):
        raise KavaError(f"{where} is not an object (got {type(row).__name__}); expected {expected()}")
    keys = FIELDS[fmt]
    missing = [k for k in keys if row.get(k) is None]
    if missing:
        have = ", ".join(k for k, v in row.items() if v is not None) or "none"
        raise KavaError(f"{where} has no '{missing[0]}' field for format {fmt} (it has: {have}; rename columns with "
                        f"data.columns)")
    if fmt == "messages":
        _check_messages(row["messages"], where, "messages", need_assistant=True)
    elif fmt == "prompt_completion":
        p, c = row["prompt"], row["completion"]
        if isinstance(p, list) != isinstance(c, list):
            raise KavaError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages")
        if isinstance(p, list):
            _check_messages(p, where, "prompt", need_assistant=False)
            _check_messages(c, where, "completion", need_assistant=True)
        elif not isinstance(p, str) or not isinstance(c, str):
            raise KavaError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages")
    else:
        for k in keys:
            if not isinstance(row[k], str):
                raise KavaError(f"{where}: '{k}' must be a string (got {type(row[k]).__name__})")


def record_format(row: Mapping, fmt: str, where: str) -> str:
    """The row's format: `fmt` when set (not `auto`), else detected; one line if there is none."""
    found = fmt if fmt != "auto" else detect_format(row) if isinstance(row, Mapping) else None
    if found is None:
        have = ", ".join(k for k, v in row.items() if v is not None) if isinstance(row, Mapping) else type(row).__name__
        raise KavaError(f"{where} is of no known format (it has: {have or 'none'}); expected {expected()} "
                        f"(rename columns with data.columns, or set data.format)")
    check_record(row, found, where)
    return found


# ------------------------------------------------------------------------------------------ rendering


def use_chat(tokenizer, prompt_format: str) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat" and not has_template:
        raise KavaError("data.prompt_format=chat but the tokenizer has no chat template (use auto or plain)")
    if prompt_format not in ("auto", "chat", "plain"):
        raise KavaError(f"data.prompt_format must be auto, chat or plain, not '{prompt_format}'")
    return prompt_format == "chat" or (prompt_format == "auto" and has_template)


def _find(text: str, content: str, pos: int) -> Optional[tuple[int, int]]:
    """Where `content` lies in `text` at or after `pos` (a template may strip surrounding
    whitespace); None if the template rewrote it."""
    at = text.find(content, pos)
    if at < 0 and content.strip() != content:
        content = content.strip()
        at = text.find(content, pos)
    return None if at < 0 else (at, at + len(content))


def _gsm8k_segments(start: int, answer: str) -> list[tuple[int, int]]:
    """The answer's reasoning and final-answer segments (split at the last `####`), from `start`."""
    m = answer.rfind(ANSWER_MARKER)
    m = len(answer) if m < 0 else m
    return [(start, start + m), (start + m, start + len(answer))]


PLAIN_TURN = "{role}: {content}\n"  # how a teacher without a chat template reads a conversation


def _chat(tokenizer, messages: list, loss_from: int, plain_fallback: bool = False) -> Rendered:
    """One chat-template piece; loss on assistant messages at index >= loss_from; a segment per
    message. plain_fallback: a tokenizer without a chat template (a teacher's) reads "role: content"
    lines instead."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    elif plain_fallback:
        text = "".join(PLAIN_TURN.format(**m) for m in messages)
    else:
        raise KavaError("conversation records need the student's chat template, and its tokenizer has none "
                        "(use prompt/completion strings, or a student with a template)")
    spans, loss, pos = [], [], 0
    for i, m in enumerate(messages):
        found = _find(text, m["content"], pos)
        if found is None:
            if plain_fallback:  # a teacher's template rewrote the text: nothing of this record aligns
                return Rendered([Piece(text, False)], [])
            raise KavaError(f"the chat template rewrites a message's content ({m['content'][:40]!r}...): its loss "
                            f"spans cannot be found in the rendered text")
        s, e = found
        spans.append((s, e))
        pos = e
        if m["role"] == "assistant" and i >= loss_from:
            loss.append((s, e))
    return Rendered([Piece(text, loss)], spans)


def render(row: Mapping, fmt: str, tokenizer, prompt_format: str = "auto", teacher: bool = False) -> Rendered:
    """A checked record of format `fmt` as `tokenizer` sees it (docs/internals/core.md#records).
    teacher: a teacher of another tokenizer renders it (a conversation without a chat template is
    read as plain turns)."""
    if fmt == "text":
        return Rendered([Piece(row["text"], True, specials=True)], [(0, len(row["text"]))], eos=True)
    if fmt == "messages":
        return _chat(tokenizer, list(row["messages"]), 0, teacher)
    if fmt == "prompt_completion":
        p, c = row["prompt"], row["completion"]
        if isinstance(p, list):
            return _chat(tokenizer, list(p) + list(c), len(p), teacher)
        return Rendered([Piece(p, False, specials=True), Piece(c, True)], [(0, len(p)), (len(p), len(p) + len(c))],
                        eos=True)
    q, a = row["question"], row["answer"]
    if use_chat(tokenizer, prompt_format):
        r = _chat(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}], 0, teacher)
        if r.segments:
            r.segments = [r.segments[0], *_gsm8k_segments(r.segments[1][0], a)]
        return r
    prompt = PLAIN_PROMPT.format(q=q)
    q0 = prompt.index(q)
    return Rendered([Piece(prompt, False, specials=True), Piece(a, True)],
                    [(q0, q0 + len(q)), *_gsm8k_segments(len(prompt), a)], eos=True)


def generation_prompt(row: Mapping, fmt: str, tokenizer, prompt_format: str = "auto") -> str:
    """The text a model continues to answer the row: everything before the completion (GSM8K evaluation)."""
    if fmt != "gsm8k":
        raise KavaError(f"generation prompts are for gsm8k rows, not {fmt}")
    if use_chat(tokenizer, prompt_format):
        return tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], tokenize=False,
                                             add_generation_prompt=True)
    return PLAIN_PROMPT.format(q=row["question"])


def with_completion(row: Mapping, fmt: str, text: str) -> dict:
    """The record with its completion (the last assistant turn, a GSM8K answer) replaced by `text`:
    what a teacher of another tokenizer renders of a sampled completion (on-policy distillation).
    Text records have none (on-policy refuses them before anything starts:
    `runtime.preflight.check_prompts`)."""
    out = dict(row)
    turn = {"role": "assistant", "content": text}
    if fmt == "prompt_completion":
        out["completion"] = [turn] if isinstance(row["completion"], list) else text
    elif fmt == "messages":
        msgs = list(row["messages"])
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        out["messages"] = msgs[:last] + [turn]
    elif fmt == "gsm8k":
        out["answer"] = text
    else:
        raise ValueError(f"with_completion: a {fmt} record has no completion")
    return out


def formats_of(rows: Iterable[tuple[str, Mapping]], fmt: str, columns: Optional[Mapping] = None) -> Optional[str]:
    """Check `(where, row)` pairs (the first records of a source): each is a valid record, all of
    one format. Returns that format (None for no rows)."""
    first = None
    for where, row in rows:
        row = rename(row, columns) if isinstance(row, Mapping) else row
        f = record_format(row, fmt, where)
        if first is None:
            first = (f, where)
        elif f != first[0]:
            raise KavaError(f"{where} is a {f} record, but {first[1]} is {first[0]}: one source holds one format "
                            f"(set data.format to choose, or split the file)")
    return None if first is None else first[0]
