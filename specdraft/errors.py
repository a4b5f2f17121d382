"""One exception type for every user-facing mistake.

The CLI prints these without a traceback, so each message must say what is
wrong *and* what to do about it.
"""


class SpecdraftError(Exception):
    """A problem with the user's input, recipe, data or files (not a bug)."""
