"""The driver's progress bar: follows a run's metrics.jsonl while Ray Train runs the workers.

Reading the file rank 0 writes works for any number of workers, on an embedded Ray or a cluster
with shared storage, and needs nothing from the workers but the records they already log.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path


def _follow(path: Path, total: int, stop: threading.Event) -> None:
    from tqdm import tqdm

    bar = tqdm(total=total, desc="train", unit="step", disable=None, dynamic_ncols=True)
    seen = 0
    while not stop.is_set():
        if path.exists():
            for line in path.read_text().splitlines()[seen:]:
                seen += 1
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line being written: read it again next time
                    seen -= 1
                    break
                if r.get("kind") == "train":
                    bar.n = r["step"]
                    bar.set_postfix(loss=f"{r['loss']:.3f}", cos=f"{r['cos_sim']:.3f}",
                                    gap=f"{r['contrast_gap']:.3f}", wait=f"{r['teacher_wait_s']:.2f}s",
                                    phase=r["phase"], refresh=False)
                    bar.refresh()
        stop.wait(0.5)
    bar.close()


@contextlib.contextmanager
def follow_metrics(path: Path, total_steps: int, enabled: bool = True):
    """`with follow_metrics(run_dir / "metrics.jsonl", steps): trainer.fit()` shows a live bar."""
    if not enabled:
        yield
        return
    stop = threading.Event()
    thread = threading.Thread(target=_follow, args=(Path(path), total_steps, stop), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
