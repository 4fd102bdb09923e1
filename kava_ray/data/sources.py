"""Where examples come from: the synthetic generator, a local .jsonl/.json/.parquet file, or a hub dataset."""

from __future__ import annotations

import json
import os
from typing import Optional

from kava_ray._io import first_line
from kava_ray.data.synthetic import Example, synthetic_split
from kava_ray.errors import KavaError

_FILE_LIKE_EXTS = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip", ".xlsx")


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
    path = os.path.expanduser(source.replace("{split}", split))
    ext = os.path.splitext(path)[1].lower()
    if os.path.exists(path) or ext in _FILE_LIKE_EXTS or source.startswith(("/", "./", "../", "~")):
        rows = _read_local(path, ext)
    else:
        rows = _read_hub(source, split, hub_config, n)
    if n is not None:
        rows = rows[:n]
    if not rows:
        raise KavaError(f"data source '{source}' (split {split}) has no examples")
    out = []
    for i, row in enumerate(rows):
        for key in ("question", "answer"):
            if not isinstance(row, dict) or row.get(key) is None:
                raise KavaError(f"data source '{source}': row {i} has no '{key}' field")
        out.append(Example(str(row["question"]), str(row["answer"])))
    return out


def _read_local(path: str, ext: str) -> list[dict]:
    if not os.path.isfile(path):
        raise KavaError(f"data file not found: {path}")
    if ext in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text.lstrip().startswith("["):  # a .json array is accepted too
            try:
                return list(json.loads(text))
            except json.JSONDecodeError as e:
                raise KavaError(f"data file {path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise KavaError(f"data file {path}: line {lineno} is not valid JSON ({e.msg})") from None
        return rows
    if ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - any pyarrow failure is a bad file
            raise KavaError(f"data file {path}: cannot read parquet ({first_line(e)})") from None
        for key in ("question", "answer"):
            if key not in table.column_names:
                raise KavaError(f"data file {path}: row 0 has no '{key}' field (columns: {table.column_names})")
        return table.select(["question", "answer"]).to_pylist()
    raise KavaError(f"data file {path}: unknown extension '{ext}' (use .jsonl, .json or .parquet)")


def _read_hub(source: str, split: str, hub_config: Optional[str], n: Optional[int]) -> list[dict]:
    try:
        import datasets

        ds = datasets.load_dataset(source, hub_config, split=split)
        if n is not None:
            ds = ds.select(range(min(n, len(ds))))
        return ds.to_list()
    except Exception as e:  # noqa: BLE001 - wrapped into one user-facing line
        raise KavaError(
            f"cannot load dataset '{source}' (config {hub_config}, split {split}): {first_line(e)}; "
            "offline, use data.source=synthetic or a local .jsonl/.parquet file"
        ) from None

