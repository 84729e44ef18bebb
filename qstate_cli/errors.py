"""Errors that the CLI maps to exit codes (one error boundary in cli/__init__.py).

QstateError: the user's input is wrong (a file, a name, a flag): exit 2 with one line.
CheckFailed: the input was fine but a check failed (a regression): exit 1.
"""


class QstateError(Exception):
    """A usage or input error; the message is one line a user can act on."""


class CheckFailed(Exception):
    """A regression or failed check (exit code 1)."""


def clip(text: str, limit: int = 40) -> str:
    """`text` for a one-line message: at most `limit` characters, cut with "..."."""
    return text if len(text) <= limit else text[:limit - 3] + "..."
