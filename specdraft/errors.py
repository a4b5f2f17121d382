"""One exception type for every user-facing mistake, and one for a stop the user asked for.

The CLI prints these without a traceback, so each message must say what is
wrong *and* what to do about it.
"""

import signal


class SpecdraftError(Exception):
    """A problem with the user's input, recipe, data or files (not a bug)."""


class StoppedBySignal(SystemExit):
    """SIGINT or SIGTERM stopped training after its checkpoint: the whole command ends, with the shell's exit code
    for that signal (130, 143). A SystemExit, so no ``except Exception`` on the way (a self-test's per-check
    guard, a benchmark's loop) swallows it, and an uncaught one exits without a traceback."""

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.signum, self.message = signum, message

    def __str__(self) -> str:
        return f"{signal.Signals(self.signum).name}: {self.message}"
