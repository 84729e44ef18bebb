"""The error boundary every command group shares (hf CLI style): library exceptions become
one line on stderr and an exit code.

Exit codes:

    0    ok
    1    regression or failed check (CheckFailed)
    2    usage or input error (QstateError: one line, no traceback), and an output that
         cannot be written: a full disk, a quota, a read-only or failing device
         (`error: FILE: cannot write (No space left on device)`; atomic.py names the file),
         or stdout itself (`error: stdout: cannot write (...)`: `> /dev/full`, `>&-`)
    130  interrupted by Ctrl-C (SIGINT): temporary files removed, what was already
         finished kept and said (rows, points: `run --resume` continues)
    141  stdout is a pipe whose reader is gone (`qstate audit | head -1`): what a tool
         killed by SIGPIPE reports; no message, no traceback
    143  terminated (SIGTERM: `kill`, a CI timeout, a scheduler): the same path as Ctrl-C,
         with 128 + 15 as a signalled process reports it

An interrupt while the command line is parsed is the same one line and code as one during
the command. Once the exit is decided as 130 or 143, a second Ctrl-C or SIGTERM is ignored
(in qstate's own process, until it is gone: `QstateGroup.exits_process`), so the finally
blocks and torch's atexit callbacks still run and the code stays. Text that stdout's
encoding cannot hold (a path with `é` under `PYTHONIOENCODING=ascii`, a file name that is
not UTF-8) is written backslash-escaped (`\\xe9`, `\\udce9`), as stderr already is.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import threading

import typer
from typer.core import TyperGroup

from ..errors import CheckFailed, QstateError
from ..runtime import is_oom

SIGPIPE_EXIT = 128 + 13
SIGTERM_EXIT = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so every `except
    KeyboardInterrupt` and `finally` on the way (atomic writes, the progress bar, the
    "finished rows are kept" lines) runs for it too; the boundary exits 143."""


def _on_sigterm(signum, frame):
    raise Terminated()


class StdoutError(Exception):
    """A write or flush of stdout failed (not an OSError, so that no `except OSError` on the
    way mistakes it for a file's, and click does not turn EPIPE into exit 1)."""

    def __init__(self, code: int | None, strerror: str):
        super().__init__(strerror)
        self.errno, self.strerror = code, strerror


class _Closed:
    """stdout when the process started without one (`qstate formats >&-`: sys.stdout is
    None): nothing to flush, and a write is an error."""

    encoding, errors = "utf-8", "strict"

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "it is closed")

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError(errno.EBADF, "it is closed")


class _Stdout:
    """sys.stdout while a command runs: the stream it was, whose failed write or flush is a
    StdoutError (the boundary can then tell stdout from a file)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:  # a character the encoding cannot hold: escaped, as stderr does
                return self._stream.write(_escaped(text, getattr(self._stream, "encoding", None)))
        except OSError as exc:
            raise StdoutError(exc.errno, exc.strerror or str(exc)) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise StdoutError(exc.errno, exc.strerror or str(exc)) from None
        except ValueError:  # closed
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _escaped(text: str, encoding: str | None) -> str:
    """text with what `encoding` cannot encode backslash-escaped (`é` in ASCII: `\\xe9`; a
    lone surrogate, a non-UTF-8 byte of a file name, in UTF-8: `\\udce9`)."""
    try:
        return text.encode(encoding or "utf-8", "backslashreplace").decode(encoding or "utf-8")
    except (LookupError, UnicodeError):
        return text.encode("ascii", "backslashreplace").decode("ascii")


def _silence_stdout() -> None:
    """After stdout failed: later writes go nowhere, and so does what its buffer still holds
    when the interpreter exits (no second traceback then)."""
    out = sys.stdout
    stream = out._stream if isinstance(out, _Stdout) else out
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass
    if isinstance(out, _Stdout):
        out._stream = open(os.devnull, "w")  # noqa: SIM115 - lives until exit


def _stdout_failed(exc: StdoutError) -> typer.Exit:
    _silence_stdout()
    if exc.errno == errno.EPIPE:  # the reader is gone (`| head`): as if killed by SIGPIPE, silently
        return typer.Exit(SIGPIPE_EXIT)
    return _fail("error", f"stdout: cannot write ({exc.strerror})", 2)


def _fail(prefix: str, message: str, code: int):
    typer.echo(f"{prefix}: {message}", err=True)
    return typer.Exit(code)


_held = False  # the exit is decided as 130 or 143: SIGINT and SIGTERM are ignored (_hold_signals)


def ignore_signals() -> None:
    """SIGINT and SIGTERM ignored from here on, in the main thread (elsewhere signal.signal
    raises): the process's exit code is decided (here, and in __main__ whatever the code)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _hold_signals() -> None:
    """The exit is decided (130 or 143): a second Ctrl-C or SIGTERM while it runs (finally
    blocks, torch's atexit callbacks, worker threads joined) is ignored. It printed a
    traceback ("Exception ignored in atexit callback: dump_compile_times"), or the process
    died by the signal (-2, not 130)."""
    global _held
    if threading.current_thread() is threading.main_thread():
        ignore_signals()
        _held = True


def _interrupted(exc: KeyboardInterrupt) -> typer.Exit:
    _hold_signals()
    if isinstance(exc, Terminated):
        return _fail("qstate", "terminated", SIGTERM_EXIT)
    return _fail("qstate", "interrupted", 130)


class QstateGroup(TyperGroup):
    """The error boundary: library exceptions become one-line messages and exit codes."""

    #: qstate's own process (__main__ sets it): an exit decided as 130 or 143 leaves SIGINT
    #: and SIGTERM ignored until the process is gone; a caller that goes on (CliRunner, a
    #: test) gets its handlers back.
    exits_process = False

    def main(self, *args, **kwargs):
        """The whole command line (the root group; CliRunner too): stdout guarded, SIGTERM
        raised as Terminated while it runs, and stdout flushed before exit, so a failure to
        write it is the boundary's one line, not a traceback at interpreter exit."""
        global _held
        saved = sys.stdout
        sys.stdout = _Stdout(_Closed() if saved is None else saved)
        main_thread = threading.current_thread() is threading.main_thread()
        handlers = {}
        if main_thread:
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            signal.signal(signal.SIGTERM, _on_sigterm)
            _held = False
        try:
            try:
                try:
                    return super().main(*args, **kwargs)
                finally:
                    sys.stdout.flush()
            except StdoutError as exc:  # raised outside invoke (--help, --version) or by the last flush
                raise SystemExit(_stdout_failed(exc).exit_code) from None
        except SystemExit as exc:
            if exc.code == 130 and not _held:  # typer's own, silent: an interrupt after invoke (ctx.exit)
                _hold_signals()
                terminated = isinstance(getattr(exc.__context__, "__cause__", None), Terminated)
                typer.echo(f"qstate: {'terminated' if terminated else 'interrupted'}", err=True)
                if terminated:
                    raise SystemExit(SIGTERM_EXIT) from None
            raise
        finally:
            if not (_held and self.exits_process):
                for sig, handler in handlers.items():
                    signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
            if isinstance(sys.stdout, _Stdout):
                sys.stdout = saved

    def make_context(self, *args, **kwargs):
        """The command line parsed (--help and --version printed here): an interrupt is the
        boundary's line and code, not typer's silent 130 (which a SIGTERM got too)."""
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise _interrupted(exc) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QstateError as exc:
            raise _fail("error", str(exc), 2) from None
        except CheckFailed as exc:
            raise _fail("check failed", str(exc), 1) from None
        except StdoutError as exc:
            raise _stdout_failed(exc) from None
        except KeyboardInterrupt as exc:  # Terminated too
            raise _interrupted(exc) from None
        except (RuntimeError, MemoryError) as exc:
            if not is_oom(exc):
                raise
            raise _fail("error", _out_of_memory(ctx, exc), 1) from None


def _out_of_memory(ctx, exc: BaseException) -> str:
    """The one line of a command that ran out of memory (a traceback of 60 lines before):
    what was said, and what makes the work smaller."""
    said = " ".join(str(exc).split()) or type(exc).__name__  # whole: CUDA's names what is in use, and what helps
    command = ctx.invoked_subcommand or ""  # (ctx.command_path is "python -m qstate_cli" under -m)
    return f"out of memory ({said}): qstate {command} needs less: {SMALLER.get(command, 'a smaller input')}".replace(
        "qstate  ", "qstate ")


# what makes each command's work smaller, for the out-of-memory line
SMALLER = {"diagnose": "--steps-limit N, fewer --config, or more ranks under torchrun (docs/distributed.md)",
           "trace": "a trace with fewer steps or elements",
           "bench": "a smaller --numel or --model, or fewer --config",
           "run": "smaller sizes in the suite",
           "report": "fewer results files at once",
           "compare": "fewer results files at once",
           "doctor": "a machine with more memory for this checkpoint"}


def new_group(name: str, help: str, completion: bool = False) -> typer.Typer:
    return typer.Typer(name=name, help=help, cls=QstateGroup, no_args_is_help=True,
                       add_completion=completion, pretty_exceptions_enable=False,
                       context_settings={"help_option_names": ["-h", "--help"]})
