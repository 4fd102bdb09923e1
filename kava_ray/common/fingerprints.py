"""Short stable hashes: of JSON-able parts (`digest`: the cache keys of tokenized splits and
batches) and of a tokenizer (`tokenizer_fingerprint`: what decides its token ids).

Below core and data because both compare tokenizers by it: data keys its tokenized splits and
teacher views by the fingerprint, core's plans tell a teacher of the student's tokenizer from one
aligned by characters, and a teacher actor reports its own.
"""

from __future__ import annotations

import hashlib
import json


def digest(*parts) -> str:
    """16 hex digits of sha256 over `parts` (bytes as they are, anything else as sorted-key JSON), each ended by NUL."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """Stable short hash of what decides token ids: vocab, bos/eos/pad, and the ids of a probe text
    (it catches pre-tokenizer/normaliser differences); not the tokenizer class (transformers may
    load one tokenizer file as different classes) nor an unused unk token."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token")}
    probe = tokenizer("Tom buys 12 apples at $3.50 each; naïve 東京 costs\n  1,000 -> 3*4=12", add_special_tokens=True)
    return digest(vocab, specials, list(probe["input_ids"]))

