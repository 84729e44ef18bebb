"""The error boundary every command group shares (hf CLI style): library exceptions become
one line on stderr and an exit code.

Exit codes: 0 ok, 1 regression or failed check (CheckFailed), 2 usage or input error
(QstateError: one line, no traceback), 130 interrupted (rows already measured are kept).
"""
from __future__ import annotations

import typer
from typer.core import TyperGroup

from ..errors import CheckFailed, QstateError


def _fail(prefix: str, message: str, code: int):
    typer.echo(f"{prefix}: {message}", err=True)
    return typer.Exit(code)


class QstateGroup(TyperGroup):
    """The error boundary: library exceptions become one-line messages and exit codes."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QstateError as exc:
            raise _fail("error", str(exc), 2) from None
        except CheckFailed as exc:
            raise _fail("check failed", str(exc), 1) from None
        except KeyboardInterrupt:
            raise _fail("qstate", "interrupted", 130) from None


def new_group(name: str, help: str) -> typer.Typer:
    return typer.Typer(name=name, help=help, cls=QstateGroup, no_args_is_help=True,
                       add_completion=False, pretty_exceptions_enable=False,
                       context_settings={"help_option_names": ["-h", "--help"]})
