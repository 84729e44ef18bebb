"""The `qstate` command line: the root wires command groups; one error boundary (group.py).

Exit codes: 0 ok, 1 regression or failed check, 2 usage or input error (one line on
stderr, no traceback; an output or stdout that cannot be written too), 130 interrupted
(Ctrl-C), 141 stdout's reader is gone (`| head`), 143 terminated (SIGTERM); group.py.
"""
from __future__ import annotations

import typer

from .. import __version__
from .group import QstateGroup, new_group

__all__ = ["QstateGroup", "app", "main", "new_group"]


app = new_group("qstate", "Benchmark and diagnose low-bit optimizer states (4/8-bit AdamW, Lion, SGD, Muon).",
                completion=True)


def _version(value: bool):
    if value:
        typer.echo(f"qstate {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")):
    """qstate: how fast, how small, and what low-bit optimizer states do to training."""
    from .. import runtime
    from .output import say

    runtime.COMPILES.notice = say  # a first use compiles the CPU kernels for minutes: say so on stderr


def _register_commands() -> None:
    from . import audit_cmd, bench_cmd, diagnose_cmd, doctor_cmd, formats_cmd, report_cmd, suite_cmd, trace_cmd

    formats_cmd.register(app)
    bench_cmd.register(app)
    suite_cmd.register(app)
    report_cmd.register(app)
    trace_cmd.register(app)
    diagnose_cmd.register(app)
    audit_cmd.register(app)
    doctor_cmd.register(app)


_register_commands()


def main() -> None:
    """Console-script entry point."""
    app()
