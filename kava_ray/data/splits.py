"""The job's data splits, read from its config: train, validation and test records (a split's own,
or carved from one source), tokenized with the job's settings into the cached Arrow splits, every
aligned teacher's view attached, and the streams they are batched in.

What the driver prepares before any worker starts (`runtime.preflight.prepare_data`) and what the
train worker, evaluation, `kava-ray data` and the benches read. Config and data only: the student's
and teachers' tokenizers come in loaded (`core.models.load_tokenizer`), so this module imports
nothing of `kava_ray.core` (core and data are independent: a contract in pyproject.toml). Each
function takes the sections it reads: `data`, and `train` for the length, batch size and seed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from kava_ray.common.config import DataConfig, TrainConfig
from kava_ray.common.errors import KavaError
from kava_ray.common.files import default_cache_dir
from kava_ray.data.batching import BatchStream
from kava_ray.data.sources import load_records, source_fingerprint, source_path
from kava_ray.data.tokenize import TokenizedSplit, teacher_view, tokenize_split


def data_cache_dir(data: DataConfig) -> Path:
    """Where tokenized splits are cached (Arrow): `data.cache_dir`, else $KAVA_RAY_CACHE or ~/.cache/kava-ray, /data."""
    return Path(data.cache_dir) if data.cache_dir else default_cache_dir() / "data"


def split_records(data: DataConfig, split: str, n: Optional[int]):
    """The records of one split (`data.source`, `data.columns` applied): a `datasets.Dataset`."""
    return load_records(data.source, split, n, data.seed, data.hub_config, data.columns)


def tokenize_records(data: DataConfig, train: TrainConfig, tokenizer, records, source_id: str, with_text: bool,
                     what: str) -> TokenizedSplit:
    """`tokenize_split` with the job's data settings; cached on disk unless the records live in memory."""
    on_disk = bool(getattr(records, "cache_files", None))
    return tokenize_split(tokenizer, records, train.max_length, data.prompt_format, data.overlength, source_id,
                          fmt=data.format, packing=data.packing, with_text=with_text,
                          cache_dir=data_cache_dir(data) if on_disk else None,
                          where=f"data source '{data.source}' {what}")


def one_source(data: DataConfig) -> bool:
    """True when the test split would read the training split's rows: one local file or directory
    with no `{split}` in its path (every split names it), or a hub dataset whose `test_split` is its
    `train_split`."""
    if data.source == "synthetic":
        return False  # synthetic_split keeps train apart from the others by construction
    path = source_path(data.source, data.train_split)
    if path is None:
        return data.train_split == data.test_split
    return path == source_path(data.source, data.test_split)


CARVED_SHARE = 0.05  # a carved split whose data.num_val / num_test is null: this share of the source's records


def carved(data: DataConfig) -> bool:
    """Validation and test are cut from the training records: one source (`one_source`) without
    `data.allow_overlap`. Rows: the first `num_train` + `num_val` + `num_test` records (all of them
    when `num_train` is null); test = the last `num_test`, validation = the `num_val` before them,
    train = the rest. A null `num_val` / `num_test` (every record of a split's own file) is
    `CARVED_SHARE` here (`carved_counts`): "every record" of one file would leave nothing to train
    on."""
    return one_source(data) and not data.allow_overlap


def carved_counts(data: DataConfig, total: int) -> tuple[int, int]:
    """(validation, test) records carved from training records, `total` of them in the source:
    `data.num_val` / `data.num_test`, or where null `CARVED_SHARE` (at least one) of the records the
    job trains on: `num_train` when set (100 of a million-record file: 5 and 5, not 50,000 each),
    else `total`."""
    base = total if data.num_train is None else min(data.num_train, total)
    share = max(1, int(base * CARVED_SHARE))
    return tuple(share if n is None else n for n in (data.num_val, data.num_test))


def _carved_records(data: DataConfig):
    """(train, val, test) records of a carved source (`carved`); a source too small for the three is one line."""
    # only the records the carve uses (a synthetic source needs a number; a short file gives what it has)
    want = None if data.num_train is None else data.num_train + sum(carved_counts(data, data.num_train))
    records = split_records(data, data.train_split, want)
    n_val, n_test = carved_counts(data, len(records))
    n = len(records) - n_val - n_test
    if n < 1:
        raise KavaError(f"data.source {data.source} has {len(records)} records: too few to carve {n_val} validation "
                        f"(data.num_val) and {n_test} test records (data.num_test) from one file and keep any for "
                        f"training (lower them, or give each split its own file with {{split}} in the path)")
    return (records.select(range(n)), records.select(range(n, n + n_val)),
            records.select(range(n + n_val, len(records))))


def load_splits(data: DataConfig, train_cfg: TrainConfig, tokenizer, teacher_toks: Optional[dict] = None
                ) -> tuple[TokenizedSplit, TokenizedSplit]:
    """(train, val): validation is `data.val_split` when set, else the last `data.num_val` training
    records (`carved`: the records before the test rows).

    Validation drives evaluation, `train.checkpoint_score` and Tune (the test split is read only
    after training). `teacher_toks` (`teacher_tokenizers`): each split also carries those teachers'
    views (`TokenizedSplit.views`).
    """
    base = _fingerprint(data, data.train_split, data.num_train)
    if carved(data):
        train, val, test = _carved_records(data)
        val_id = f"{base}|carved-val|n={len(val)}|test={len(test)}"
    elif data.val_split is not None:
        train = split_records(data, data.train_split, data.num_train)
        val = split_records(data, data.val_split, data.num_val)
        val_id = _fingerprint(data, data.val_split, data.num_val)
    else:  # validation: the last training records (a null num_val: `carved_counts`' share of them)
        if data.num_train is None:
            records = split_records(data, data.train_split, None)
            n_val = carved_counts(data, len(records))[0]
        else:
            n_val = carved_counts(data, data.num_train)[0]
            records = split_records(data, data.train_split, data.num_train + n_val)
        if len(records) <= n_val:
            raise KavaError(f"data '{data.source}' split {data.train_split!r} has {len(records)} examples: too few "
                            f"to carve {n_val} for validation (data.num_val) and keep any for training")
        n = len(records) - n_val
        train, val = records.select(range(n)), records.select(range(n, len(records)))
        val_id = f"{base}|val|n={n_val}"

    def split(records, source_id, what):
        out = tokenize_records(data, train_cfg, tokenizer, records, source_id, bool(teacher_toks), what)
        return with_views(out, data, train_cfg, teacher_toks)

    return (split(train, f"{base}|train|n={len(train)}", f"split {data.train_split!r}"),
            split(val, val_id, "(validation)"))


def with_views(split: TokenizedSplit, data: DataConfig, train: TrainConfig, teacher_toks: Optional[dict]
               ) -> TokenizedSplit:
    """Attach every character-aligned teacher's view of `split` (its token ids + the alignment)."""
    for name, tok in (teacher_toks or {}).items():
        split.views[name] = teacher_view(split, tok, data.prompt_format, train.max_length)
    return split


def test_records(data: DataConfig):
    """The test split's records (`data.test_split`, `data.num_test`; `carved`: the last rows of the one source)."""
    return _carved_records(data)[2] if carved(data) else split_records(data, data.test_split, data.num_test)


def load_test_split(data: DataConfig, train: TrainConfig, tokenizer, teacher_toks: Optional[dict] = None
                    ) -> TokenizedSplit:
    """The test split (`test_records`): for the end of a run and `kava-ray eval`."""
    if carved(data):
        _, val, records = _carved_records(data)
        source_id = f"{_fingerprint(data, data.train_split, data.num_train)}" \
                    f"|carved-test|val={len(val)}|n={len(records)}"
        where = "(test)"
    else:
        records = test_records(data)
        source_id = _fingerprint(data, data.test_split, data.num_test)
        where = f"split {data.test_split!r}"
    split = tokenize_records(data, train, tokenizer, records, source_id, bool(teacher_toks), where)
    return with_views(split, data, train, teacher_toks)


def check_overlap(data: DataConfig) -> Optional[str]:
    """Refuse held-out splits that share records with the training split: the same rows read twice
    make the test CE a training figure. With `data.allow_overlap` the warning line instead; None
    when they share none. Records are compared whole (every field as loaded, `data.columns`
    applied): a carved source's repeated rows count too."""
    if data.source == "synthetic":
        return None
    if carved(data):
        train, val, test = _carved_records(data)
        held = {"validation": val, "test": test}
    else:
        train = split_records(data, data.train_split, data.num_train)
        held = {"test": test_records(data)}
        if data.val_split is not None:
            held["validation"] = split_records(data, data.val_split, data.num_val)
    seen = {_row_hash(r) for r in train}
    shared = {k: (sum(_row_hash(r) in seen for r in rows), len(rows)) for k, rows in held.items()}
    what = " and ".join(f"{v} of {n} {k} records" for k, (v, n) in shared.items() if v)
    if not what:
        return None
    same = " (every split reads the same file)" if one_source(data) and not carved(data) else ""
    if data.allow_overlap:
        return f"warning: data.allow_overlap: {what} are also training records{same}: they are not held out"
    raise KavaError(f"data.source {data.source}: {what} are also training records{same}, so the held-out figures "
                    f"would be measured on training rows; remove them from the held-out split, or set "
                    f"data.allow_overlap: true to measure them anyway")


def _fingerprint(data: DataConfig, split: str, n: Optional[int]) -> str:
    return source_fingerprint(data.source, split, n, data.seed, data.hub_config, data.columns)


def _row_hash(row) -> str:
    return hashlib.sha1(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()


def data_seed(train: TrainConfig) -> int:
    """The seed every data stream is batched with: `train.data_seed`, else `train.seed`."""
    return train.seed if train.data_seed is None else train.data_seed


def eval_stream(split: TokenizedSplit, train: TrainConfig, drop_last: bool = True):
    """The batches a held-out split is evaluated in (no bucketing: every run and the KV cache
    agree); drop_last=False: every row, the last batch short (`evaluate_heldout`: a figure over the
    whole split)."""
    return BatchStream(split, train.batch_size, data_seed(train), bucket=False, drop_last=drop_last)
