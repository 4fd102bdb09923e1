"""Where examples come from: the synthetic generator, a local .jsonl/.json/.parquet file, or a hub dataset."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from typing import Iterator, Optional

from kava_ray._io import first_line
from kava_ray.data.synthetic import Example, synthetic_split
from kava_ray.errors import KavaError

_FILE_LIKE_EXTS = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip", ".xlsx")
FIELDS = ("question", "answer")  # what every example row must carry
# a hub dataset id: `org/name` (Hub names: letters, digits, - _ .); a bare `name` is no longer a Hub dataset id
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def source_path(source: str, split: str) -> Optional[str]:
    """The local file `source` names for `split` (`{split}` filled in, `~` expanded), or None for a hub id.

    The one rule the loader and `check_source` share: an existing path, a file extension, or a path-like
    prefix (/ ./ ../ ~) makes it local.
    """
    path = os.path.expanduser(source.replace("{split}", split))
    ext = os.path.splitext(path)[1].lower()
    if os.path.exists(path) or ext in _FILE_LIKE_EXTS or source.startswith(("/", "./", "../", "~")):
        return path
    return None


def load_examples(source: str, split: str, n: Optional[int] = None, seed: int = 0,
                  hub_config: Optional[str] = "main") -> list[Example]:
    """Examples of `split` from "synthetic", a local .jsonl/.json/.parquet file, or a hub dataset id.

    Synthetic: `synthetic_split` (train and every other split never overlap).
    A local path may contain `{split}` (e.g. `data/{split}.jsonl`). Real data is capped to its first `n` rows.
    """
    if source == "synthetic":
        if n is None:
            raise KavaError("data.source=synthetic needs a number of examples (data.num_train / data.num_val / data.num_test)")
        return synthetic_split(n, seed, split)
    path = source_path(source, split)
    if path is not None:
        where_rows = list(_read_local(path))
        where = f"data file {path}"
    else:
        where_rows = [(f"row {i}", row) for i, row in enumerate(_read_hub(source, split, hub_config, n))]
        where = f"data source '{source}'"
    if n is not None:
        where_rows = where_rows[:n]
    if not where_rows:
        raise KavaError(f"data source '{source}' (split {split}) has no examples")
    out = []
    for at, row in where_rows:
        _check_row(where, at, row)
        out.append(Example(str(row["question"]), str(row["answer"])))
    return out


def _check_row(where: str, at: str, row) -> None:
    """One line naming the file, the line (or row) and what the loader needs there."""
    if not isinstance(row, dict):
        raise KavaError(f"{where}: {at} is not an object with {' and '.join(FIELDS)} fields "
                        f"(got {type(row).__name__})")
    for key in FIELDS:
        if row.get(key) is None:
            raise KavaError(f"{where}: {at} has no '{key}' field (it has: {', '.join(map(str, row)) or 'none'})")


def check_source(source: str, split: str, records: int = 16) -> None:
    """Fail fast, in the driver, on a data source a worker would fail on after teachers load (`kava_ray.preflight`).

    synthetic: nothing to check. A local file (see `source_path`): exists, is a file, is not empty, and its
    first `records` records parse and carry question/answer (one line naming the file and the line). Else
    the source must look like a hub id `org/name` (a typo such as `synthetc` is refused here); whether the
    hub has it (network, cache) stays the loader's business.
    """
    if source == "synthetic":
        return
    path = source_path(source, split)
    if path is None:
        _check_hub_id(source)
        return
    rows = _read_local(path, limit=records)
    first = next(rows, None)
    if first is None:
        raise KavaError(f"data file {path} has no examples (only blank lines)")
    for at, row in [first, *rows]:
        _check_row(f"data file {path}", at, row)


def _check_hub_id(source: str) -> None:
    if not _HUB_ID.match(source):
        raise KavaError(f"data.source={source!r}: not 'synthetic', not an existing local file and not a hub dataset "
                        f"id (org/name); a local file needs a path or an extension (.jsonl, .json, .parquet)")
    head = source.split("/", 1)[0]
    if os.path.isdir(head):  # `data/trian` next to a local data/ dir: a misspelt file, not the hub
        raise KavaError(f"data.source={source!r}: no such file, and {head}/ is a local directory (a hub dataset "
                        f"id would be org/name); give the file with its extension, e.g. {source}.jsonl")


def _read_local(path: str, limit: Optional[int] = None) -> Iterator[tuple[str, object]]:
    """(where, row) of a local file, where = 'line N (row i)' (JSONL), 'item i' (a JSON array) or 'row i' (parquet);
    only the first `limit` rows are parsed when given (a JSONL file is read line by line)."""
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        raise KavaError(f"data file {path} is a directory, not a .jsonl/.json/.parquet file")
    if not os.path.isfile(path):
        raise KavaError(f"data file not found: {path}")
    if ext not in (".jsonl", ".json", ".parquet"):
        raise KavaError(f"data file {path}: unknown extension '{ext}' (use .jsonl, .json or .parquet)")
    if os.path.getsize(path) == 0:
        raise KavaError(f"data file {path} is empty (no examples)")
    if ext == ".parquet":
        yield from _read_parquet(path, limit)
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
                    raise KavaError(f"data file {path}: line {lineno} is not valid JSON ({e.msg})") from None
                yield f"line {lineno} (row {count})", row
                count += 1
    except UnicodeDecodeError as e:
        raise KavaError(f"data file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_parquet(path: str, limit: Optional[int]) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        missing = [k for k in FIELDS if k not in names]
        if missing:
            raise KavaError(f"data file {path}: no '{missing[0]}' column (columns: {names})")
        if limit is not None:  # the first row groups only
            rows = next(pf.iter_batches(batch_size=limit, columns=list(FIELDS)), None)
            rows = rows.to_pylist() if rows is not None else []
        else:
            rows = pf.read(columns=list(FIELDS)).to_pylist()
    except KavaError:
        raise
    except Exception as e:  # noqa: BLE001 - any pyarrow failure is a bad file
        raise KavaError(f"data file {path}: cannot read parquet ({first_line(e)})") from None
    yield from ((f"row {i}", row) for i, row in enumerate(rows))


@contextlib.contextmanager
def _quiet_hub_retries():
    """huggingface_hub logs one WARNING per retry ('Retrying in 8s [Retry 4/5]') while the network is down: the
    user gets the one KavaError line instead."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _read_hub(source: str, split: str, hub_config: Optional[str], n: Optional[int]) -> list[dict]:
    try:
        import datasets

        with _quiet_hub_retries():
            ds = datasets.load_dataset(source, hub_config, split=split)
        if n is not None:
            ds = ds.select(range(min(n, len(ds))))
        return ds.to_list()
    except Exception as e:  # noqa: BLE001 - wrapped into one user-facing line
        raise KavaError(
            f"cannot load dataset '{source}' (config {hub_config}, split {split}): {first_line(e)}; "
            "offline, use data.source=synthetic or a local .jsonl/.parquet file"
        ) from None
