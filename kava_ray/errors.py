"""The one error type users see: its message is a single line naming what is wrong."""


class KavaError(Exception):
    """Bad input (config, path, resource request). The CLI prints `error: <msg>` and exits 2."""
