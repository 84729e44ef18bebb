"""The `qstate` command line: the root wires command groups; one error boundary.

Exit codes: 0 ok, 1 regression or failed check, 2 usage or input error (one line on
stderr, no traceback), 130 interrupted.
"""
from __future__ import annotations

import typer
from typer.core import TyperGroup

from .. import __version__
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
            raise _fail("qstate", "interrupted; rows already measured were kept", 130) from None


def new_group(name: str, help: str) -> typer.Typer:
    return typer.Typer(name=name, help=help, cls=QstateGroup, no_args_is_help=True,
                       add_completion=False, pretty_exceptions_enable=False,
                       context_settings={"help_option_names": ["-h", "--help"]})


app = new_group("qstate", "Benchmark and diagnose low-bit optimizer states (4/8-bit AdamW, Lion, SGD, Muon).")


def _version(value: bool):
    if value:
        typer.echo(f"qstate {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")):
    """qstate: how fast, how small, and what low-bit optimizer states do to training."""


def _register_commands() -> None:
    from . import bench_cmd, formats_cmd

    formats_cmd.register(app)
    bench_cmd.register(app)


_register_commands()


def main() -> None:
    """Console-script entry point."""
    app()
