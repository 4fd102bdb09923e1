"""Where records come from, as Hugging Face `datasets`: the synthetic generator, local files
(.jsonl, .json, .parquet, .csv, or a directory of such shards, `{split}` in the path), or a hub
dataset id. `load_records` loads a split; `check_source` checks a source's first records in the
driver, before anything starts. See docs/internals/core.md#data-sources.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import hashlib
import json
import logging
import os
import re
from typing import Iterator, Mapping, Optional

from kava_ray.common.errors import KavaError
from kava_ray.common.files import first_line
from kava_ray.data.records import formats_of, record_format
from kava_ray.data.synthetic import Example, synthetic_split

_FILE_LIKE_EXTS = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip", ".xlsx")
READABLE = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # extension -> datasets builder
# a hub dataset id: `org/name` (Hub names: letters, digits, - _ .); a bare `name` is no longer a Hub dataset id
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def source_path(source: str, split: str) -> Optional[str]:
    """The local file `source` names for `split` (`{split}` filled in, `~` expanded), or None for a
    hub id: local when it exists, has a file extension or a path-like prefix (the rule the loader
    and `check_source` share)."""
    path = os.path.expanduser(source.replace("{split}", split))
    ext = os.path.splitext(path)[1].lower()
    if os.path.exists(path) or ext in _FILE_LIKE_EXTS or source.startswith(("/", "./", "../", "~")):
        return path
    return None


def data_files(path: str) -> list[str]:
    """The files of a local source: the file itself, or a directory's shards (every readable file in
    it, sorted; one file type)."""
    if not os.path.isdir(path):
        return [path]
    files = sorted(f for f in glob.glob(os.path.join(path, "*")) if os.path.splitext(f)[1].lower() in READABLE)
    if not files:
        raise KavaError(f"data directory {path} holds no .jsonl/.json/.parquet/.csv shards")
    if len({READABLE[os.path.splitext(f)[1].lower()] for f in files}) > 1:
        raise KavaError(f"data directory {path} mixes file types: one type per source")
    return files


def source_fingerprint(source: str, split: str, n: Optional[int], seed: int = 0, hub_config: Optional[str] = None,
                       columns: Optional[Mapping] = None) -> str:
    """What identifies a split's records without reading them: local files by path, size and mtime;
    the hub by id, config and split; synthetic by size and seed."""
    path = source_path(source, split) if source != "synthetic" else None
    files = []
    if path is not None and os.path.exists(path):
        files = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in data_files(path)]
    blob = json.dumps([source, split, n, seed, hub_config, dict(columns or {}), files], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_records(source: str, split: str, n: Optional[int] = None, seed: int = 0,
                 hub_config: Optional[str] = "main", columns: Optional[Mapping] = None):
    """The records of `split` as a `datasets.Dataset`, `data.columns` applied, capped to the first `n` rows.

    synthetic: `synthetic_split` (train never overlaps the others). Files and hub datasets stay
    Arrow tables, memory-mapped from the datasets cache (nothing is read into Python lists).
    """
    import datasets  # heavy (pyarrow), here and below: loaded where records are read, never by `bench gpu`

    if source == "synthetic":
        if n is None:
            raise KavaError("data.source=synthetic needs a number of examples (data.num_train / data.num_val / "
                            "data.num_test)")
        ds = datasets.Dataset.from_list([{"question": e.question, "answer": e.answer}
                                         for e in synthetic_split(n, seed, split)])
    else:
        path = source_path(source, split)
        ds = _load_local(path) if path is not None else _load_hub(source, split, hub_config)
    if columns:
        missing = [v for v in columns.values() if v not in ds.column_names]
        if missing:
            raise KavaError(f"data.columns: column {missing[0]!r} is not in data source '{source}' (split {split}; "
                            f"it has {', '.join(ds.column_names)})")
        ds = ds.rename_columns({v: k for k, v in columns.items() if v != k})
    if n is not None and n < len(ds):
        ds = ds.select(range(n))
    if len(ds) == 0:
        raise KavaError(f"data source '{source}' (split {split}) has no examples")
    return ds


def _load_local(path: str):
    import datasets

    files = data_files(path)
    for f in files:
        if not os.path.isfile(f):
            raise KavaError(f"data file not found: {f}")
        if os.path.getsize(f) == 0:
            raise KavaError(f"data file {f} is empty (no examples)")
    ext = os.path.splitext(files[0])[1].lower()
    if ext not in READABLE:
        raise KavaError(f"data file {files[0]}: unknown extension '{ext}' (use .jsonl, .json, .parquet or .csv)")
    try:
        with _quiet_hub_retries():
            return datasets.load_dataset(READABLE[ext], data_files=files, split="train")
    except Exception as e:  # noqa: BLE001 - a file the Arrow readers cannot read (mixed types, bad JSON...)
        error = first_line(e)
    for f in files:  # the cause where a reader can name it: a broken line (a file cut mid-line) and its number
        for _ in _read_local(f):
            pass
    raise KavaError(f"data file {path}: cannot read it as a table ({error}); every row must have the same fields "
                    f"and types")


def load_examples(source: str, split: str, n: Optional[int] = None, seed: int = 0,
                  hub_config: Optional[str] = "main") -> list[Example]:
    """GSM8K examples (question, answer) of a split: `load_records` as Examples (for small splits)."""
    ds = load_records(source, split, n, seed, hub_config)
    where = (f"data source '{source}'" if source_path(source, split) is None
             else f"data file {source_path(source, split)}")
    out = []
    for i, row in enumerate(ds):
        record_format(row, "gsm8k", f"{where}: row {i}")
        out.append(Example(row["question"], row["answer"]))
    return out


def check_source(source: str, split: str, records: int = 16, fmt: str = "auto",
                 columns: Optional[Mapping] = None) -> Optional[str]:
    """Fail fast, in the driver, on a data source a worker would fail on after teachers load (`runtime.preflight`).

    A local source: exists, is not empty, and its first `records` records are valid records of one
    format (one KavaError line naming the file and row). Else it must look like a hub id `org/name`
    (refuses typos such as `synthetc`); whether the hub has it is the loader's business. Returns the
    records' format where it read them (gsm8k for synthetic; None for a hub id).
    """
    if source == "synthetic":
        return "gsm8k"
    path = source_path(source, split)
    if path is None:
        _check_hub_id(source)
        return None
    first_file = data_files(path)[0] if os.path.isdir(path) else path
    rows = _read_local(first_file, limit=records)
    first = next(rows, None)
    if first is None:
        raise KavaError(f"data file {first_file} has no examples (only blank lines)")
    if columns and isinstance(first[1], Mapping):
        missing = [v for v in columns.values() if v not in first[1]]
        if missing:
            raise KavaError(f"data.columns: column {missing[0]!r} is not in data file {first_file} (its first record "
                            f"has: {', '.join(first[1]) or 'nothing'})")
    return formats_of(((f"data file {first_file}: {at}", row) for at, row in [first, *rows]), fmt, columns)


def _check_hub_id(source: str) -> None:
    if not _HUB_ID.match(source):
        raise KavaError(f"data.source={source!r}: not 'synthetic', not an existing local file and not a hub dataset "
                        f"id (org/name); a local file needs a path or an extension (.jsonl, .json, .parquet)")
    head = source.split("/", 1)[0]
    if os.path.isdir(head):  # `data/trian` next to a local data/ dir: a misspelt file, not the hub
        raise KavaError(f"data.source={source!r}: no such file, and {head}/ is a local directory (a hub dataset "
                        f"id would be org/name); give the file with its extension, e.g. {source}.jsonl")


def _read_local(path: str, limit: Optional[int] = None) -> Iterator[tuple[str, object]]:
    """(where, row) of a local file, where = 'line N (row i)' (JSONL, CSV), 'item i' (a JSON array)
    or 'row i' (parquet); only the first `limit` rows are parsed when given (JSONL and CSV are read
    line by line)."""
    ext = os.path.splitext(path)[1].lower()
    if not os.path.isfile(path):
        raise KavaError(f"data file not found: {path}")
    if ext not in READABLE:
        raise KavaError(f"data file {path}: unknown extension '{ext}' (use .jsonl, .json, .parquet or .csv)")
    if os.path.getsize(path) == 0:
        raise KavaError(f"data file {path} is empty (no examples)")
    if ext == ".parquet":
        yield from _read_parquet(path, limit)
        return
    if ext == ".csv":
        yield from _read_csv(path, limit)
        return
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096)
            if head.lstrip().startswith("["):  # a .json array is accepted too (parsed whole)
                try:
                    items = json.loads(head + f.read())
                except json.JSONDecodeError as e:
                    raise KavaError(f"data file {path}: invalid JSON ({e.msg} at line {e.lineno})") from None
                if not isinstance(items, list):
                    raise KavaError(f"data file {path}: expected a JSON array of objects")
                yield from ((f"item {i}", row) for i, row in enumerate(items[:limit]))
                return
            f.seek(0)
            count = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if limit is not None and count >= limit:
                    return
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise KavaError(f"data file {path}: line {lineno} is broken, not valid JSON "
                                    f"({e.msg.removesuffix(' at')} at column {e.pos + 1})") from None
                yield f"line {lineno} (row {count})", row
                count += 1
    except UnicodeDecodeError as e:
        raise KavaError(f"data file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_csv(path: str, limit: Optional[int]) -> Iterator[tuple[str, object]]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for i, row in enumerate(csv.DictReader(f)):
                if limit is not None and i >= limit:
                    return
                yield f"line {i + 2} (row {i})", {k: (v if v != "" else None) for k, v in row.items()}
    except (UnicodeDecodeError, csv.Error) as e:
        raise KavaError(f"data file {path}: not a readable CSV ({first_line(e)})") from None


def _read_parquet(path: str, limit: Optional[int]) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        if limit is not None:  # the first row groups only
            rows = next(pf.iter_batches(batch_size=limit), None)
            rows = rows.to_pylist() if rows is not None else []
        else:
            rows = pf.read().to_pylist()
    except Exception as e:  # noqa: BLE001 - any pyarrow failure is a bad file
        raise KavaError(f"data file {path}: cannot read parquet ({first_line(e)})") from None
    yield from ((f"row {i}", row) for i, row in enumerate(rows))


@contextlib.contextmanager
def _quiet_hub_retries():
    """huggingface_hub logs one WARNING per retry ('Retrying in 8s [Retry 4/5]') while the network
    is down: the user gets the one KavaError line instead."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _load_hub(source: str, split: str, hub_config: Optional[str]):
    try:
        import datasets

        with _quiet_hub_retries():
            return datasets.load_dataset(source, hub_config, split=split)
    except Exception as e:  # noqa: BLE001 - wrapped into one user-facing line
        raise KavaError(
            f"cannot load dataset '{source}' (config {hub_config}, split {split}): {first_line(e)}; "
            "offline, use data.source=synthetic or a local .jsonl/.parquet file"
        ) from None
