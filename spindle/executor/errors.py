"""Errors an executor raises when it can no longer serve."""

from __future__ import annotations

import signal


class ExecutorFailedError(RuntimeError):
    """A worker died or hit a fatal error: every pending and later call fails with this.

    rank and exitcode name the worker that failed first (exitcode is None when the
    worker reported an error and had not exited yet; negative: killed by that signal).
    """

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode

    def copy(self) -> "ExecutorFailedError":
        """A fresh instance for a later caller (re-raising one object grows its traceback)."""
        return ExecutorFailedError(str(self), self.rank, self.exitcode)


def describe_exitcode(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"exit code {exitcode} (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            return f"exit code {exitcode} (killed by signal {-exitcode})"
    return f"exit code {exitcode}"
