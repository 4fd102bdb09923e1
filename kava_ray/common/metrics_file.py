"""A run's `metrics.jsonl`: one JSON record per line, `{"step": int, "kind": "train" | "eval" | "test", ...}`.

The one reader and writer of the file: rank 0 appends records (`MetricsLog`, which drops what lies
past a resumed step), the driver follows it for its progress bar and the final `test:` line,
`kava-ray report` and the benches read it. A line may be torn (a worker killed mid-write, or a line
being written while it is read): readers that follow a live run skip it; `read_metrics` names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

from kava_ray.common.errors import KavaError

METRICS = "metrics.jsonl"
SAMPLING = "sampling.now"  # beside metrics.jsonl while rank 0 samples a batch (on-policy): the progress bar says so


def parse(line: str) -> Optional[dict]:
    """The record on `line`, or None for a blank, torn or foreign line."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError:
        return None
    return r if isinstance(r, dict) and isinstance(r.get("step"), int) and isinstance(r.get("kind"), str) else None


def records(path) -> Iterator[dict]:
    """Every well-formed record of `path`, in file order (nothing if the file is not there yet)."""
    path = Path(path)
    if path.is_file():
        for line in path.read_text().splitlines():
            r = parse(line)
            if r is not None:
                yield r


def last(path, kind: str) -> Optional[dict]:
    """The last record of `kind` (e.g. the run's "test" record)."""
    out = None
    for r in records(path):
        if r["kind"] == kind:
            out = r
    return out


def last_values(path, kind: str = "train") -> dict[str, tuple[int, float]]:
    """{metric: (step, value)}: the last value of every number the records of `kind` hold, and the
    step it was measured at (a figure some steps do not measure, e.g. the sampled reverse KL, keeps
    its last measurement)."""
    out: dict[str, tuple[int, float]] = {}
    for r in records(path):
        if r["kind"] == kind:
            out.update({k: (r["step"], v) for k, v in r.items()
                        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def read_metrics(path) -> tuple[list[dict], list[dict]]:
    """(train_records, eval_records), each sorted by step, the last record of a (kind, step) winning
    (a resumed run repeats steps); a line that is not a record is one KavaError naming it."""
    path = Path(path)
    if not path.is_file():
        raise KavaError(f"metrics file not found: {path}")
    latest: dict[tuple[str, int], dict] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = parse(line)
            if rec is None:
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    raise KavaError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from None
                raise KavaError(f"{path}: line {lineno} is not a metrics record (needs an int 'step' and a 'kind')")
            latest[(rec["kind"], rec["step"])] = rec
    ordered = [latest[k] for k in sorted(latest, key=lambda k: k[1])]
    return [r for r in ordered if r["kind"] == "train"], [r for r in ordered if r["kind"] == "eval"]


class MetricsLog:
    """Rank 0's metrics.jsonl. On resume, records past the resumed step are dropped first, and so is
    a torn last line (a worker killed mid-write). trackers (train.loggers,
    `kava_ray.common.trackers`): every record written is also logged there."""

    def __init__(self, path: Path, resume_step: int, trackers=None):
        self.path, self.trackers = Path(path), trackers
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            keep = [json.dumps(r) for r in records(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers is not None and record["kind"] != ERROR:
            self.trackers.log(record)


ERROR = "error"  # {"step", "kind": "error", "message"}: the run stopped itself (its driver raises the message)
WALL = "wall.json"  # {"sessions": [[start, end], ...]}: the driver's wall clock of each `kava-ray train` of a run


def add_session(run_dir, start: float, end: float) -> None:
    """Record one driver session of a run (its start and end, Unix seconds) in RUN_DIR/wall.json."""
    path = Path(run_dir) / WALL
    try:
        sessions = json.loads(path.read_text())["sessions"] if path.exists() else []
    except (ValueError, KeyError, TypeError):
        sessions = []
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"sessions": sessions + [[start, end]]}))
    tmp.replace(path)


def wall_seconds(run_dir) -> Optional[float]:
    """The run's wall time: its driver sessions' durations summed (None when wall.json is missing or unreadable)."""
    try:
        return sum(e - s for s, e in json.loads((Path(run_dir) / WALL).read_text())["sessions"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stopped_by(path) -> Optional[str]:
    """The message of a run that stopped itself (its last record is an error), else None."""
    rs = list(records(path)) if Path(path).exists() else []
    return rs[-1]["message"] if rs and rs[-1]["kind"] == ERROR else None
