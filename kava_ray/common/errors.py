"""The one error type users see: its message is a single line naming what is wrong."""


class KavaError(Exception):
    """Bad input (config, path, resource request). The CLI prints `error: <msg>` and exits 2."""


class NothingToDo(Exception):
    """The command's goal is already reached (`train --resume` of a finished run): the CLI prints
    the one line and exits 0, so a script that resumes after a preemption (Slurm's requeue, a retry
    loop) succeeds on a finished run."""


def root_cause(e: BaseException) -> str:
    """The innermost error message of a remote failure (a Ray task's or worker's), one line: a
    KavaError raised there keeps its text; otherwise the last line of the remote traceback."""
    text = str(e)
    for line in reversed(text.splitlines()):
        if "KavaError:" in line:
            return line.split("KavaError:", 1)[1].strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(e).__name__
