"""SIGTERM (`kill`, Slurm, Kubernetes) ends a command as Ctrl-C does: one line, the last checkpoint intact.

`sigterm_as_interrupt()` turns SIGTERM into SIGINT, so every command's own Ctrl-C handling runs (Ray
Train's run stops, a Tune sweep saves its state), also where SIGINT is ignored (a script's `cmd &`);
`terminated()` then says it was a SIGTERM (the CLI exits 143, as a shell reports a process SIGTERM
ended). `ray.init` installs a SIGTERM handler of its own (exit 1, or a C++ dump as the core worker
dies mid-call), so `kava_ray.runtime.connect` installs this one again once Ray is up. A SIGTERM to
the whole process group also ends an embedded Ray: the way out asks it nothing
(`runtime.job.job_teachers`).
"""

from __future__ import annotations

import signal
import threading

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
_received: list[int] = []


def sigterm_as_interrupt() -> None:
    """Handle SIGTERM as SIGINT from now on (main thread only: Python signal handlers live there)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum, frame):
        _received.append(signum)
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):  # the SIGINT handler in force: Ctrl-C's path
            return handler(signal.SIGINT, frame)
        # SIGINT ignored (a shell script's background job, `nohup cmd &`: POSIX ignores SIGINT
        # there, and Python then installs no handler) or default: a SIGTERM still ends the command
        # as Ctrl-C would
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)


def terminated() -> bool:
    """Whether a SIGTERM arrived (an interrupt is then a termination)."""
    return bool(_received)
