"""The vocabulary map between two tokenizers: teacher token id -> the student token id of the same
string, for the hybrid cross-vocabulary logit loss (`losses.hybrid_logit_loss`, as TRL's GOLD
trainer). Pure numpy.

A token is keyed by the text it decodes to (byte-level BPE and SentencePiece entries decoded; added
and special tokens by their content, matching only each other); the map is one to one. Built once
per tokenizer pair and cached (`.npz`, named by both fingerprints). Keys and the comparison with
GOLD: docs/internals/core.md#align-vocab.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

UNMATCHED = -1
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_kinds(tokenizer) -> set[str]:
    """The types of the fast tokenizer's decoder (a Sequence's parts included): {'ByteLevel'}, {'Metaspace', ...}."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    dec = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    if not dec:
        return set()
    return {dec.get("type")} | {d.get("type") for d in dec.get("decoders") or []}


def token_keys(tokenizer) -> dict[int, tuple]:
    """{token id: key}: ("text", the bytes it decodes to) for vocabulary tokens, ("added", content)
    for added and special tokens; a token whose entry cannot be decoded is keyed by its raw
    string."""
    kinds = _decoder_kinds(tokenizer)
    byte_level = "ByteLevel" in kinds
    table = _byte_decoder()
    added = {tid for tid in getattr(tokenizer, "added_tokens_decoder", {}) or {}}
    keys = {}
    for tok, tid in tokenizer.get_vocab().items():
        if tid in added:
            keys[tid] = ("added", tok)
        elif byte_level and all(c in table for c in tok):
            keys[tid] = ("text", bytes(table[c] for c in tok))
        elif (m := _BYTE_PIECE.match(tok)) is not None:
            keys[tid] = ("text", bytes([int(m.group(1), 16)]))
        elif not byte_level:
            keys[tid] = ("text", tok.replace("\u2581", " ").encode("utf-8"))
        else:
            keys[tid] = ("raw", tok)
    return keys


def map_file_name(teacher_fp: str, student_fp: str) -> str:
    """The cache file of one (teacher, student) tokenizer pair's map."""
    return f"vocab_map-{teacher_fp[:16]}-{student_fp[:16]}.npz"


@dataclass
class VocabMap:
    """t2s [teacher vocab] int64: the student id of each teacher id's string, UNMATCHED (-1) for none.

    coverage: the share of the teacher's vocabulary that maps (GOLD's weight of the matched part);
    student_coverage: the share of the student's vocabulary some teacher id maps to."""

    t2s: np.ndarray
    student_vocab: int
    teacher_fp: str = ""  # the two tokenizers' fingerprints (`common.fingerprints`): what the file is named by
    student_fp: str = ""

    @property
    def file_name(self) -> str:
        return map_file_name(self.teacher_fp, self.student_fp)

    @property
    def matched(self) -> int:
        return int((self.t2s >= 0).sum())

    @property
    def coverage(self) -> float:
        return self.matched / max(len(self.t2s), 1)

    @property
    def student_coverage(self) -> float:
        return self.matched / max(self.student_vocab, 1)

    def student_unmatched(self) -> np.ndarray:
        """int64: the student ids no teacher id maps to (the student's side of the sorted remainder)."""
        hit = np.zeros(self.student_vocab, dtype=bool)
        hit[self.t2s[self.t2s >= 0]] = True
        return np.flatnonzero(~hit).astype(np.int64)

    def summary(self) -> str:
        return (f"{self.matched:,} of the teacher's {len(self.t2s):,} tokens ({self.coverage:.1%}) have a student "
                f"token of the same string ({self.student_coverage:.1%} of the student's {self.student_vocab:,})")


def build_vocab_map(student_tok, teacher_tok, teacher_vocab: Optional[int] = None,
                    student_vocab: Optional[int] = None) -> VocabMap:
    """The map from `teacher_tok`'s ids to `student_tok`'s (see the module docstring). `*_vocab`:
    the models' vocabulary sizes (the LM head's rows; may exceed the tokenizer's length, e.g.
    Qwen2.5's padding rows, which map to nothing); default the tokenizers' lengths."""
    s_keys, t_keys = token_keys(student_tok), token_keys(teacher_tok)
    by_key: dict[tuple, int] = {}
    for sid in sorted(s_keys):
        by_key.setdefault(s_keys[sid], sid)
    n_t = max(teacher_vocab or 0, len(teacher_tok), max(t_keys, default=-1) + 1)
    n_s = max(student_vocab or 0, len(student_tok), max(s_keys, default=-1) + 1)
    t2s = np.full(n_t, UNMATCHED, dtype=np.int64)
    used: set[int] = set()
    for tid in sorted(t_keys):
        sid = by_key.get(t_keys[tid])
        if sid is not None and sid not in used:
            t2s[tid] = sid
            used.add(sid)
    return VocabMap(t2s, n_s)


def save_vocab_map(vmap: VocabMap, path: Path) -> None:
    """Write atomically (a temp file, then rename): a reader never sees half a map."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, t2s=vmap.t2s, student_vocab=np.int64(vmap.student_vocab))
    tmp.replace(path)


def load_vocab_map(path: Path, teacher_fp: str = "", student_fp: str = "") -> Optional[VocabMap]:
    try:
        with np.load(path) as z:
            return VocabMap(z["t2s"].astype(np.int64), int(z["student_vocab"]), teacher_fp, student_fp)
    except (OSError, KeyError, ValueError):
        return None


def cached_vocab_map(student_tok, teacher_tok, teacher_fp: str, student_fp: str, save_to: Path,
                     also_in: tuple = (), teacher_vocab: Optional[int] = None,
                     student_vocab: Optional[int] = None) -> VocabMap:
    """The pair's map from the first of `also_in` + `save_to` that holds it, else built and saved in
    `save_to` (a read-only `save_to` only loses the cache)."""
    name = map_file_name(teacher_fp, student_fp)
    for d in (*also_in, save_to):
        vmap = load_vocab_map(Path(d) / name, teacher_fp, student_fp)
        if vmap is not None and len(vmap.t2s) >= (teacher_vocab or 0):
            return vmap
    vmap = build_vocab_map(student_tok, teacher_tok, teacher_vocab, student_vocab)
    vmap.teacher_fp, vmap.student_fp = teacher_fp, student_fp
    try:
        save_vocab_map(vmap, Path(save_to) / name)
    except OSError:
        pass
    return vmap
