"""`python -m qstate_cli` and the `qstate` command (pyproject's script).

The CLI imports torch (~2 s). A Ctrl-C or SIGTERM while it loads exits at once, 130 or 143,
with one line and nothing else: no exception is raised into the import, which broke it half
way (numpy's C module cut short, then "cannot load module more than once per process"; a
C++ abort) and nothing has been written yet. While typer then builds the command, one is
raised (KeyboardInterrupt; SIGTERM as _Terminated) and exits the same way, until the command
line's boundary (cli/group.py) takes both over: the same lines and codes.

Once the command line is over, whatever its code, the process ignores SIGINT and SIGTERM
while it exits (finally blocks, torch's atexit callbacks and finalizers: a second Ctrl-C
there printed "Exception ignored in atexit callback" or killed it, -2 instead of 130;
group.ignore_signals). About 1 Ctrl-C in 30 landing as a command starts still ends the
process by SIGINT, -2, where CPython kept a mark of the interrupt qstate caught: a shell
reports that as 130 too."""
import os
import signal
import sys
import threading

_LINE = {signal.SIGINT: ("qstate: interrupted\n", 130), signal.SIGTERM: ("qstate: terminated\n", 143)}


def _while_loading(signum, frame):
    line, code = _LINE[signal.Signals(signum)]
    try:
        os.write(2, line.encode())
    except OSError:
        pass
    os._exit(code)


class _Terminated(KeyboardInterrupt):
    """SIGTERM after the CLI loaded, before cli/group.py's boundary raises its own (group.Terminated)."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main() -> None:
    main_thread = threading.current_thread() is threading.main_thread()
    ours = {sig: default for sig, default in ((signal.SIGINT, signal.default_int_handler),
                                              (signal.SIGTERM, signal.SIG_DFL))
            if main_thread and signal.getsignal(sig) == default}  # one ignored or set by a caller is kept
    for sig in ours:
        signal.signal(sig, _while_loading)
    boundary = None
    try:
        try:
            from .cli import group
            from .cli import main as cli
        finally:
            for sig, default in ours.items():
                signal.signal(sig, _on_sigterm if sig == signal.SIGTERM else default)
        boundary = group
        group.QstateGroup.exits_process = True
        cli()
    except KeyboardInterrupt as exc:  # while typer builds the command, or outside its boundary
        if boundary is not None:
            boundary.ignore_signals()
        terminated = isinstance(exc, (_Terminated, boundary.Terminated) if boundary else _Terminated)
        line, code = _LINE[signal.SIGTERM if terminated else signal.SIGINT]
        sys.stderr.write(line)
        raise SystemExit(code) from None
    finally:
        if boundary is not None:
            boundary.QstateGroup.exits_process = False
            boundary.ignore_signals()
        elif signal.SIGTERM in ours and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    main()
