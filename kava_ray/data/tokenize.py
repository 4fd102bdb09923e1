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


def encode_prompt(tokenizer, question: str, prompt_format: str = "auto") -> list[int]:
    """Token ids of the prompt alone (what generation starts from in GSM8K evaluation)."""
    if _use_chat(tokenizer, prompt_format):
        msgs = [{"role": "user", "content": question}]
        return _ids(tokenizer, tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    ids = _ids(tokenizer, PLAIN_PROMPT.format(q=question), special=True)  # BOS if the tokenizer adds one
    if ids and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]  # some tokenizers append EOS; the prompt must stay open
    return ids


def encode_example(tokenizer, ex: Example, max_length: int, prompt_format: str = "auto",
                   overlength: str = "truncate", index: Optional[int] = None) -> dict:
    """Token ids + labels (-100 on the prompt) + answer_mask for one example; truncates or raises."""
    prompt = encode_prompt(tokenizer, ex.question, prompt_format)
    if _use_chat(tokenizer, prompt_format):
        msgs = [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.answer}]
        ids = _ids(tokenizer, tokenizer.apply_chat_template(msgs, tokenize=False))
        n_prompt = 0  # the prompt is a token prefix of the full text; stop at the first difference
        while n_prompt < min(len(prompt), len(ids)) and prompt[n_prompt] == ids[n_prompt]:
            n_prompt += 1
    else:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids, n_prompt = prompt + _ids(tokenizer, ex.answer) + eos, len(prompt)
    truncated = len(ids) > max_length
    if truncated and overlength == "error":
        where = f"example {index}" if index is not None else "example"
        raise KavaError(f"{where} has {len(ids)} tokens > train.max_length={max_length} "
                        "(raise max_length or set data.overlength=truncate)")
    ids = ids[:max_length]
    labels = [IGNORE_INDEX] * min(n_prompt, len(ids)) + ids[n_prompt:]
    return {"input_ids": ids, "labels": labels, "answer_mask": [int(lab != IGNORE_INDEX) for lab in labels],
            "truncated": truncated}


@dataclass
class TokenizedSplit:
    """The encoded examples of one split, identified by `fingerprint` (content + settings hash)."""

    items: list[dict]  # encode_example outputs, in example order
    examples: list[Example]  # the source texts (teachers with other tokenizers, evaluation)
    fingerprint: str
    num_truncated: int
    pad_id: int
    lengths: list[int] = field(default_factory=list)

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


def load_split(data_cfg, tokenizer, split: str, n: int, max_length: int) -> TokenizedSplit:
    """load_examples + tokenize_split from a `DataConfig` (the glue train/eval use)."""
    c = data_cfg
    examples = load_examples(c.source, split, n, c.seed, c.hub_config)
    source_id = f"{c.source}|{c.hub_config}|{split}|n={n}|seed={c.seed}"
    return tokenize_split(tokenizer, examples, max_length, c.prompt_format, c.overlength, source_id)
