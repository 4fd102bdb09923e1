"""The driver's progress bar: follows a run's metrics.jsonl while Ray Train runs the workers.

Reading the file rank 0 writes works for any number of workers, on an embedded Ray or a cluster
with shared storage, and needs nothing from the workers but the records they already log.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from tqdm import tqdm

from kava_ray.common.metrics_file import SAMPLING, parse
from kava_ray.runtime.console import console

# "{desc}" carries the step's figures after the bar (tqdm's "{postfix}" would start with ", ")
BAR_FORMAT = "train {n_fmt}/{total_fmt} |{bar}| {desc} [{elapsed}<{remaining}]"


def _follow(path: Path, total: int, stop: threading.Event) -> None:
    # on the terminal even while kava_ray.runtime.console.quiet sends stderr to the run's logs; none when not a tty
    bar = tqdm(total=total, desc="", unit="step", disable=None, dynamic_ncols=True, file=console(),
               bar_format=BAR_FORMAT)
    seen, figures, sampling = 0, "", False
    flag = path.parent / SAMPLING
    while not stop.is_set():
        now = flag.exists()  # on-policy: rank 0 is sampling a batch
        if now != sampling:
            sampling = now
            bar.set_description_str(figures + ("  sampling..." if sampling else ""), refresh=True)
        if path.exists():
            text = path.read_text()
            lines = text.splitlines()[:None if text.endswith("\n") else -1]  # the last line may be mid-write
            for line in lines[seen:]:
                seen += 1
                r = parse(line)
                if r is not None and r["kind"] == "train":
                    bar.update(r["step"] - bar.n)
                    # cos: centred KV cosine (the figure a constant projector cannot game); wait: teacher wait
                    kv = f"  cos {r['cos_sim']:.3f}  gap {r['contrast_gap']:.3f}" if "cos_sim" in r else ""
                    figures = f"loss {r['loss']:.3f}{kv}  wait {r['teacher_wait_s']:.2f}s"
                    bar.set_description_str(figures + ("  sampling..." if sampling else ""), refresh=False)
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
