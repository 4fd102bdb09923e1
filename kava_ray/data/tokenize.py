"""Tokenization with loss masks, on Hugging Face `datasets`: records -> token rows (-> packed blocks).

`encode_record` renders one record (`records.render`: its pieces, loss spans and content segments)
and tokenizes it with character offsets; a token carries loss when it overlaps a loss span (and the
template's end-of-turn token after an assistant turn does too). `tokenize_split` runs it over a
whole split with `Dataset.map` -- Arrow on disk, memory-mapped, cached under the split's fingerprint
-- and, for `text` with `data.packing`, joins the documents (each ending with EOS) and cuts them
into `max_length` blocks, so no position is padding. A `TokenizedSplit` reads rows on demand:
nothing holds the split as Python objects.

Labels follow the HF convention: unshifted, -100 where no loss.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from kava_ray.common.errors import KavaError
from kava_ray.common.fingerprints import digest, tokenizer_fingerprint
from kava_ray.data.alignment import align_positions, align_texts, pair_positions
from kava_ray.data.mmap_advice import cache_paths, release_mapped_pages
from kava_ray.data.records import (
    PLAIN_PROMPT,
    Piece,
    Rendered,
    detect_format,
    generation_prompt,
    record_format,
    rename,
    render,
    use_chat,
)
from kava_ray.data.synthetic import Example

IGNORE_INDEX = -100
CODE_VERSION = 2  # bump when the encoding changes: it is part of every split's fingerprint (and cache file)
MAP_BATCH = 256  # records per Dataset.map batch (and documents per packing group)

__all__ = ["IGNORE_INDEX", "PLAIN_PROMPT", "TeacherView", "TokenizedSplit", "encode_example", "encode_prompt",
           "encode_record", "teacher_view", "tokenize_split"]


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pad if pad is not None else 0


# ------------------------------------------------------------------------------------------ one record


def _loss_of(ids: list[int], offs: np.ndarray, spans, specials: set) -> np.ndarray:
    """Per token: overlaps one of `spans`, or is the special token right after a span's last token."""
    loss = np.zeros(len(ids), dtype=np.int8)
    for s, e in spans:
        hit = np.flatnonzero((offs[:, 0] < e) & (offs[:, 1] > s))
        if len(hit):
            loss[hit] = 1
            nxt = hit[-1] + 1
            if nxt < len(ids) and ids[nxt] in specials:
                loss[nxt] = 1  # the end-of-turn token: the student learns to stop
    return loss


def _require_fast(tokenizer) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise KavaError("kava-ray needs a fast (Rust) tokenizer: its character offsets place the loss and the "
                        "alignment (AutoTokenizer.from_pretrained(..., use_fast=True))")


def encode_rendered(tokenizer, r: Rendered, max_length: int, overlength: str = "truncate",
                    where: str = "example") -> dict:
    """input_ids, loss_mask (1 = carries loss), offsets [(start, end)] into `text`, text, segments, truncated."""
    _require_fast(tokenizer)
    specials = set(tokenizer.all_special_ids)
    eos = tokenizer.eos_token_id
    ids, offs, loss, pos = [], [], [], 0
    for i, p in enumerate(r.pieces):
        enc = tokenizer(p.text, add_special_tokens=p.specials, return_offsets_mapping=True)
        pid, poff = list(enc["input_ids"]), np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        if i < len(r.pieces) - 1 and pid and eos is not None and pid[-1] == eos:
            pid, poff = pid[:-1], poff[:-1]  # some tokenizers append EOS: a prompt must stay open
        poff = poff + pos
        if isinstance(p.loss, bool):
            pl = np.full(len(pid), int(p.loss), dtype=np.int8)
        else:
            pl = _loss_of(pid, poff, p.loss, specials)
        ids += pid
        offs.append(poff)
        loss.append(pl)
        pos += len(p.text)
    if r.eos and eos is not None:
        ids.append(eos)
        offs.append(np.array([[pos, pos]], dtype=np.int64))
        loss.append(np.ones(1, dtype=np.int8))
    offsets = np.concatenate(offs) if offs else np.zeros((0, 2), np.int64)
    mask = np.concatenate(loss) if loss else np.zeros(0, np.int8)
    truncated = len(ids) > max_length
    if truncated and overlength == "error":
        raise KavaError(f"{where} has {len(ids)} tokens > train.max_length={max_length} "
                        "(raise max_length or set data.overlength=truncate)")
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length].tolist(),
            "offsets": offsets[:max_length].tolist(), "text": r.text, "segments": [list(s) for s in r.segments],
            "truncated": truncated}


def encode_texts(tokenizer, texts: list, max_length: int, overlength: str = "truncate",
                 wheres: Optional[list] = None) -> list[dict]:
    """`text` records without offsets, in one batched call of the Rust tokenizer (3x the per-row
    rate on this box): the same input_ids, loss_mask, truncated and length as `encode_record` gives
    a text row (a test holds them equal)."""
    if not texts:
        return []
    _require_fast(tokenizer)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    out = []
    for j, ids in enumerate(tokenizer(texts, add_special_tokens=True)["input_ids"]):
        ids = list(ids) + eos
        if len(ids) > max_length and overlength == "error":
            raise KavaError(f"{wheres[j] if wheres else f'text {j}'} has {len(ids)} tokens "
                            f"> train.max_length={max_length} "
                            "(raise max_length or set data.overlength=truncate)")
        kept = ids[:max_length]
        out.append({"input_ids": kept, "loss_mask": [1] * len(kept), "truncated": len(ids) > max_length,
                    "length": len(kept)})
    return out


def encode_record(tokenizer, row: Mapping, fmt: str, max_length: int, prompt_format: str = "auto",
                  overlength: str = "truncate", where: str = "example") -> dict:
    """One record (a checked row of format `fmt`) -> `encode_rendered`'s dict."""
    try:
        r = render(row, fmt, tokenizer, prompt_format)
    except KavaError as e:
        raise KavaError(f"{where}: {e}") from None
    return encode_rendered(tokenizer, r, max_length, overlength, where)


def encode_example(tokenizer, ex: Example, max_length: int, prompt_format: str = "auto",
                   overlength: str = "truncate", index: Optional[int] = None) -> dict:
    """A GSM8K example: `encode_record` plus `labels` and `answer_mask` (the row form `TokenizedSplit.items` has)."""
    where = f"example {index}" if index is not None else "example"
    out = encode_record(tokenizer, {"question": ex.question, "answer": ex.answer}, "gsm8k", max_length,
                        prompt_format, overlength, where)
    return _with_labels(out)


def encode_prompt(tokenizer, question: str, prompt_format: str = "auto") -> list[int]:
    """Token ids of a GSM8K prompt alone (what generation starts from): the first piece of its rendering."""
    text = generation_prompt({"question": question}, "gsm8k", tokenizer, prompt_format)
    chat = use_chat(tokenizer, prompt_format)
    ids = list(tokenizer(text, add_special_tokens=not chat)["input_ids"])
    if not chat and ids and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return ids


def _with_labels(row: dict) -> dict:
    mask = row["loss_mask"]
    return {**row, "labels": [t if m else IGNORE_INDEX for t, m in zip(row["input_ids"], mask)],
            "answer_mask": list(mask)}


# ------------------------------------------------------------------------------------------ a split


class Rows(Sequence):
    """Rows of a tokenized Dataset as dicts with `labels` and `answer_mask` (= the loss mask), read on demand."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return _with_labels(self.dataset[int(i)])

    def many(self, indices: Sequence[int]) -> list[dict]:
        """Rows `indices`, one Arrow read."""
        cols = self.dataset[list(map(int, indices))]
        return [_with_labels({k: cols[k][j] for k in cols}) for j in range(len(indices))]


def column(ds, name: str) -> np.ndarray:
    """One column of a `datasets.Dataset` as numpy in one vectorised Arrow read (iterating
    `ds[name]` formats it row by row: 9 s of a 36 s preparation of a 10 MB corpus; the numpy
    formatter held ~70 MiB of temporaries for the 1.9 M rows of a 1 GB corpus, `kava-ray bench
    data`); the pages the read mapped are released."""
    out = ds.select_columns([name]).with_format("arrow")[:][name].to_numpy()
    release_mapped_pages(cache_paths([ds]))
    return out


@dataclass
class TokenizedSplit:
    """One split's token rows (a `datasets.Dataset`, read on demand), identified by `fingerprint`.

    records: the source rows (a Dataset, canonical column names) when rows are records one to one
    (not packed), for teachers of another tokenizer and GSM8K evaluation. lengths: tokens per row
    (numpy).
    """

    dataset: object
    fingerprint: str
    pad_id: int
    format: str
    records: object = None
    num_truncated: int = 0
    packed: bool = False
    views: dict = field(default_factory=dict)  # teacher name -> TeacherView

    def __post_init__(self):
        self.items = Rows(self.dataset)
        self.lengths = column(self.dataset, "length").astype(np.int64)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def examples(self) -> list[Example]:
        """The GSM8K examples (question, answer) of a gsm8k split, for greedy exact match."""
        if self.format != "gsm8k" or self.records is None:
            raise KavaError(f"exact match needs gsm8k records; this split holds {self.format} rows")
        return [Example(q, a) for q, a in zip(self.records["question"], self.records["answer"])]

    def head(self, n: int) -> "TokenizedSplit":
        """Its first n rows. Row i is the parent's row i, so the fingerprint (and an example-indexed
        KV cache's keys) stay the parent's."""
        n = min(int(n), len(self))
        sub = TokenizedSplit(self.dataset.select(range(n)), self.fingerprint, self.pad_id, self.format,
                             None if self.records is None else self.records.select(range(n)), 0, self.packed)
        sub.views = {t: TeacherView(v.items[:n], v.pad_id, v.tokenizer_fingerprint, v.stats)
                     for t, v in self.views.items()}
        return sub

    def padded_share(self, batch_size: int, batches: Sequence[Sequence[int]]) -> float:
        """Share of positions that are padding over `batches` (lists of row indices) padded to their longest."""
        total = real = 0
        for b in batches:
            n = self.lengths[list(b)]
            total += int(n.max()) * len(b)
            real += int(n.sum())
        return 1.0 - real / max(total, 1)


def _cache_file(cache_dir, name: str) -> Optional[str]:
    if cache_dir is None:
        return None
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    return str(Path(cache_dir) / f"{name}.arrow")


def _as_dataset(records):
    import datasets  # heavy (pyarrow): loaded where a split is built, never by `bench gpu`

    if isinstance(records, datasets.Dataset):
        return records
    rows = [({"question": r.question, "answer": r.answer} if isinstance(r, Example) else dict(r)) for r in records]
    return datasets.Dataset.from_list(rows)


def _map(ds, fn, fingerprint: str, cache_dir, **kw):
    """`Dataset.map` with our fingerprint (and its Arrow cache file under `cache_dir`), quiet."""
    import datasets  # heavy: see `_as_dataset`

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        release_mapped_pages(cache_paths([ds]))  # what reading the input mapped so far (loading, selecting it)
        out = ds.map(fn, batched=True, batch_size=MAP_BATCH, new_fingerprint=fingerprint,
                     cache_file_name=_cache_file(cache_dir, fingerprint), load_from_cache_file=True, **kw)
        release_mapped_pages(cache_paths([ds, out]))  # and what reading (or opening) the two Arrow files mapped
        return out
    finally:
        if was:
            datasets.enable_progress_bars()


def tokenize_split(tokenizer, records, max_length: int, prompt_format: str = "auto", overlength: str = "truncate",
                   source_id: str = "", fmt: str = "auto", packing: Optional[bool] = None,
                   columns: Optional[Mapping] = None, with_text: bool = True, cache_dir=None,
                   where: str = "data") -> TokenizedSplit:
    """Encode every record (a list of Examples / dicts, or a `datasets.Dataset`) of one split.

    fmt: a format or auto (detected from the first row; every row must share it); columns:
    `data.columns`; packing: pack `text` records into max_length blocks (None = True for text, never
    for other formats); with_text: keep each row's rendered text, offsets and segments (what
    teachers of another tokenizer align with; off for plain runs of large corpora); cache_dir: where
    the Arrow cache files go (None: in memory). `source_id` names the data; with the tokenizer and
    the settings it makes the split's fingerprint.
    """
    ds = _as_dataset(records)
    if columns:
        ds = ds.rename_columns({v: k for k, v in columns.items() if v in ds.column_names and v != k})
    if len(ds) == 0:
        raise KavaError(f"{where}: no records")
    first = record_format(rename(ds[0], None), fmt, f"{where}: row 0")
    packing = (first == "text") if packing is None else bool(packing and first == "text")
    fp = digest(source_id, CODE_VERSION, tokenizer_fingerprint(tokenizer), max_length, prompt_format, overlength, first,
              packing, with_text, len(ds))
    keep = ("input_ids", "loss_mask", "truncated", "length") + (("offsets", "text", "segments") if with_text else ())

    fast_text = first == "text" and not with_text  # no offsets kept: one batched tokenizer call per map batch

    def encode(batch, indices):
        out = {k: [] for k in keep}
        texts, wheres = [], []
        for j, i in enumerate(indices):
            row = {k: batch[k][j] for k in batch}
            found = detect_format(row)
            if fmt == "auto" and found not in (None, first):
                raise KavaError(f"{where}: row {i} is a {found} record, but row 0 is {first}: one source holds one "
                                f"format (set data.format, or split the file)")
            f = record_format(row, first, f"{where}: row {i}")
            if fast_text:
                texts.append(row["text"])
                wheres.append(f"{where}: row {i}")
                continue
            enc = encode_record(tokenizer, row, f, max_length if not packing else 1 << 40, prompt_format,
                                overlength, f"{where}: row {i}")
            enc["length"] = len(enc["input_ids"])
            for k in keep:
                out[k].append(enc[k])
        for enc in encode_texts(tokenizer, texts, max_length if not packing else 1 << 40, overlength, wheres):
            for k in keep:
                out[k].append(enc[k])
        return out

    tok = _map(ds, encode, f"tok-{fp}", cache_dir, remove_columns=ds.column_names, with_indices=True)
    check_loss_tokens(tok, max_length, where)
    n_trunc = int(column(tok, "truncated").sum()) if not packing else 0
    if n_trunc:
        warnings.warn(f"{n_trunc} of {len(tok)} records ({source_id}) exceed max_length={max_length} "
                      "tokens and were truncated", stacklevel=2)
    if packing:
        tok = _map(tok, _packer(max_length, with_text), f"pack-{fp}", cache_dir, remove_columns=tok.column_names,
                   with_indices=True)
        if len(tok) == 0:
            raise KavaError(f"{where}: fewer than train.max_length={max_length} tokens: nothing to pack")
    return TokenizedSplit(tok, fp, _pad_id(tokenizer), first, None if packing else ds, n_trunc, packing)


def check_loss_tokens(tok, max_length: int, where: str) -> None:
    """A split with no token that carries loss trains and evaluates nothing (CE 0.00): one line
    naming why -- prompts longer than train.max_length (`overlength: truncate` cut every completion)
    or empty completions -- and how many records each; a split where only some records carry none
    gets the same counts as a warning."""
    import pyarrow.compute as pc

    masks = tok.data.column("loss_mask")
    per_row = np.bincount(np.asarray(pc.list_parent_indices(masks)), weights=np.asarray(pc.list_flatten(masks)),
                          minlength=len(tok))
    empty = per_row == 0
    if not empty.any():
        return
    cut = empty & column(tok, "truncated").astype(bool)
    causes = [f"{int(cut.sum())} with a prompt of train.max_length={max_length} tokens or more (truncation cut "
              f"the whole completion: raise train.max_length or shorten the prompts)" if cut.any() else "",
              f"{int((empty & ~cut).sum())} with an empty completion / assistant turn" if (empty & ~cut).any() else ""]
    why = "; ".join(c for c in causes if c)
    if empty.all():
        raise KavaError(f"{where}: no token carries loss in any of its {len(tok)} records: {why}")
    warnings.warn(f"{where}: {int(empty.sum())} of {len(tok)} records carry no loss token: {why}", stacklevel=3)


def _packer(block: int, with_text: bool):
    """A batched map: documents (each already ending with EOS) joined and cut into `block`-token
    rows; the remainder of each group of MAP_BATCH documents is dropped (as Hugging Face's run_clm
    does). Each block records its pieces [document row, first token, end token] and, with text, the
    pieces' characters."""

    def pack(batch, indices):
        ids = [t for doc in batch["input_ids"] for t in doc]
        owner = np.repeat(np.asarray(indices, dtype=np.int64), [len(d) for d in batch["input_ids"]])
        local = np.concatenate([np.arange(len(d)) for d in batch["input_ids"]]) if ids else np.zeros(0, np.int64)
        out = {"input_ids": [], "loss_mask": [], "pieces": [], "length": []}
        if with_text:
            out.update(offsets=[], text=[], segments=[])
            offs = [np.asarray(o, dtype=np.int64).reshape(-1, 2) for o in batch["offsets"]]
        first_row = indices[0] if indices else 0
        for s in range(0, len(ids) - block + 1, block):
            e = s + block
            out["input_ids"].append(ids[s:e])
            out["loss_mask"].append([1] * block)
            out["length"].append(block)
            docs = owner[s:e]
            cuts = np.flatnonzero(np.diff(docs)) + 1
            starts, ends = np.r_[0, cuts], np.r_[cuts, block]
            pieces = [[int(docs[a]), int(local[s + a]), int(local[s + b - 1]) + 1] for a, b in zip(starts, ends)]
            out["pieces"].append(pieces)
            if with_text:
                text, o, segs = "", [], []
                for d, t0, t1 in pieces:
                    doc_offs, doc_text = offs[d - first_row], batch["text"][d - first_row]
                    c0, c1 = int(doc_offs[t0:t1, 0].min()), int(doc_offs[t0:t1, 1].max())
                    o.append(np.clip(doc_offs[t0:t1], c0, c1) - c0 + len(text))
                    segs.append([len(text), len(text) + c1 - c0])
                    text += doc_text[c0:c1]
                out["offsets"].append(np.concatenate(o).tolist())
                out["text"].append(text)
                out["segments"].append(segs)
        return out

    return pack


# ------------------------------------------------------------------------------------------ teacher views


def portable(split: TokenizedSplit) -> TokenizedSplit:
    """A copy of `split` whose Datasets hold their rows in memory: a Dataset backed by Arrow cache
    files is pickled as their paths, which another node (`actors.kv_cache.CacheWriter`) does not
    have."""
    def mem(ds):
        return None if ds is None else ds.flatten_indices(keep_in_memory=True)

    return dataclasses.replace(split, dataset=mem(split.dataset), records=mem(split.records))


@dataclass
class TeacherView:
    """A split as a teacher with its own tokenizer sees it, aligned to the split's student tokens.

    items[i]: `input_ids` (the teacher's tokens of row i), `align_lo` / `align_hi` (one per student
    token: student token j uses teacher tokens align_lo[j]:align_hi[j]; equal = unaligned; for KV),
    `logit_pair` (one per student token: the teacher position whose next-token distribution predicts
    the same text, `alignment.pair_positions`, -1 for none; for logits). stats: over the split.
    """

    items: object
    pad_id: int
    tokenizer_fingerprint: str
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)


def _teacher_rendering(split: TokenizedSplit, i: int, s_item: dict, tokenizer, prompt_format: str) -> Rendered:
    """The same content as student row i, as the teacher renders it: the record with its own
    template, or a packed block's pieces (tokenized one by one, each a segment)."""
    if split.packed:
        segs = s_item["segments"]
        pieces = [Piece(s_item["text"][a:b], False) for a, b in segs]
        return Rendered(pieces, [tuple(s) for s in segs])
    row = split.records[int(i)]
    return render(row, split.format, tokenizer, prompt_format, teacher=True)


ROW_COUNTS = ("student_tokens", "aligned", "width", "teacher_tokens", "unanchored", "teacher_capped", "same_text",
              "causal_unaligned", "paired")


def align_item(s_item: dict, t_item: dict, max_length: int) -> tuple[dict, dict]:
    """One row as a teacher of another tokenizer sees it: (its item {input_ids, align_lo, align_hi,
    logit_pair}, the row's counts `ROW_COUNTS`), from the student's item and the teacher's encoding
    of the same content (each with offsets, text and segments). The rules: `teacher_view`."""
    lo, hi, s_canon, t_canon = align_texts(s_item["offsets"], s_item["text"], s_item["segments"],
                                           t_item["offsets"], t_item["text"], t_item["segments"])
    ids = t_item["input_ids"]
    n_keep = len(ids)
    if s_item.get("truncated"):
        covered = int(s_canon[1].max()) if len(s_canon[1]) else -1
        keep = np.flatnonzero((t_canon[0] >= 0) & (t_canon[1] <= covered))
        n_keep = int(keep[-1]) + 1 if len(keep) else 0
    capped = n_keep > max_length
    n_keep = max(1, min(n_keep, max_length)) if ids else 0
    hi = np.minimum(hi, n_keep)
    lo = np.minimum(lo, hi)
    ok = hi > lo
    lo_o, hi_o = align_positions(s_canon[0], s_canon[1], t_canon[0], t_canon[1], causal=False)
    causal = int(((np.minimum(hi_o, n_keep) > np.minimum(lo_o, n_keep)) & ~ok).sum())
    pair = pair_positions(s_canon, t_canon)  # for logits: the teacher position that predicts the same text
    pair = np.where(pair < n_keep, pair, -1)
    row = {"student_tokens": len(lo), "aligned": int(ok.sum()), "width": int((hi - lo).sum()), "teacher_tokens": n_keep,
           "unanchored": int((s_canon[2] < 0).all() or (t_canon[2] < 0).all()), "teacher_capped": int(capped),
           "same_text": int(s_item["text"] == t_item["text"]), "causal_unaligned": causal,
           "paired": int((pair >= 0).sum())}
    return {"input_ids": list(ids[:n_keep]), "align_lo": lo.tolist(), "align_hi": hi.tolist(),
            "logit_pair": pair.tolist()}, row


def teacher_view(split: TokenizedSplit, tokenizer, prompt_format: str, max_length: int,
                 mode_unused=None) -> TeacherView:
    """Encode every row of `split` with a teacher's `tokenizer` and align it to the student's tokens.

    The teacher renders the same record (with `auto` it applies its own chat template if it has one;
    a packed block: the same document pieces). Alignment per row:
    `kava_ray.data.alignment.align_texts` (character offsets within the record's content segments,
    causal). Truncation: for a truncated student row, teacher tokens that end past the student's
    last covered character (unusable by the causal alignment) are dropped, then the teacher row is
    capped at max_length tokens; student positions the cap cuts off become unaligned.

    stats (python numbers): aligned_fraction, teacher_per_student (mean range width over aligned
    tokens), unaligned, causal_unaligned (student tokens some teacher token overlaps but every one
    ends after them), student_tokens, teacher_tokens, unanchored (rows whose content was not found
    in either text), teacher_capped, same_text, paired_fraction (student tokens with a
    `logit_pair`).
    """
    if "text" not in split.dataset.column_names:
        raise KavaError("teachers of another tokenizer need the split's texts and offsets (tokenize with_text)")
    items, counts = [], dict.fromkeys(ROW_COUNTS, 0)
    for i in range(len(split)):
        s_item = split.items[i]
        r = _teacher_rendering(split, i, s_item, tokenizer, prompt_format)
        item, row = align_item(s_item, encode_rendered(tokenizer, r, 1 << 30), max_length)
        items.append(item)
        counts = {k: counts[k] + row[k] for k in ROW_COUNTS}
    n_tok = counts["student_tokens"]
    stats = {"aligned_fraction": counts["aligned"] / max(n_tok, 1),
             "teacher_per_student": counts["width"] / max(counts["aligned"], 1),
             "unaligned": n_tok - counts["aligned"], "causal_unaligned": counts["causal_unaligned"],
             "student_tokens": n_tok, "teacher_tokens": counts["teacher_tokens"], "unanchored": counts["unanchored"],
             "teacher_capped": counts["teacher_capped"], "same_text": counts["same_text"],
             "paired_fraction": counts["paired"] / max(n_tok, 1)}
    return TeacherView(items, _pad_id(tokenizer), tokenizer_fingerprint(tokenizer), stats)

