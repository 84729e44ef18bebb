"""The output layer: where every command's results go, the same way for every command.

Results go to stdout (a table, or with `--json -` the JSON document) or to the files
named; progress and logs go to stderr.

    --json PATH | -   the results document (docs/results.md); '-': on stdout, no table
    --csv PATH        the records as CSV (list cells as JSON text)
    --html PATH       a self-contained HTML report (qstate_cli/report)
    --markdown PATH   a GitHub Markdown report
    --plot PATH       a figure (commands that draw one)

`run_engine(execute, options, out, show)` runs an engine with its progress on stderr (a
bar on a terminal, plain lines in a log: `progress_view`) and a `Sink`: the JSON and CSV
files are rewritten atomically after every row (so Ctrl-C keeps every finished row), and
at the end `show(doc)` prints the table, or the JSON goes to stdout; HTML and Markdown
are written once the run is complete, before the table (a stdout that fails, `> /dev/full`
or `| true`, still leaves them); `exit_on_failed_rows` then makes a bench run with a
failed row exit 1, as `qstate run` does. Output paths are checked before any work starts:
each must be writable, none may be an input of the command (`Destinations.inputs`,
`check_outputs`) and no two may name the same file.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.console import Console

from ..errors import CheckFailed, QstateError
from ..progress import Progress
from ..results import (Result, check_writable, environment, write_json_atomic, write_text_atomic,
                       writes_in_place)
from . import progress_view as views
from . import tables


MIN_COLUMNS = 20  # a COLUMNS below this (0: rich printed nothing at all, exit 0) is ignored


def _columns() -> int | None:
    """COLUMNS when it is a whole number >= MIN_COLUMNS, else None (unset, `0`, `abc`, `5`)."""
    text = os.environ.get("COLUMNS", "")
    return int(text) if text.isascii() and text.isdigit() and int(text) >= MIN_COLUMNS else None


def _terminal_width() -> int:
    """The terminal's own width, as rich finds it without COLUMNS (80 when none answers)."""
    for fd in (0, 1, 2):
        try:
            return os.get_terminal_size(fd).columns or 80
        except (OSError, ValueError):
            pass
    return 80


def _console(**kw) -> Console:
    """Wide enough for our tables when output is piped (rich assumes 80 columns), and
    COLUMNS used only when it is a usable width: `COLUMNS=0 qstate formats` printed nothing
    and exited 0 (rich took the width 0); an unusable one is ignored, as if unset."""
    con = Console(**kw)
    if _columns() is None:
        if not con.is_terminal:
            con = Console(width=160, **kw)
        elif "COLUMNS" in os.environ:  # rich read it (`0`, `5`) or ignored it (`abc`): the terminal's width
            con = Console(width=_terminal_width(), **kw)
    return con


stdout = _console()
stderr = _console(stderr=True)


table = tables.table  # every command prints its tables as output.table (cli/tables.py)


def print_json(obj) -> None:
    """A JSON document on stdout (what `--json -` prints)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def say(text: str) -> None:
    """A plain line on stderr (no markup)."""
    stderr.print(text, highlight=False, markup=False)


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # a spreadsheet reads a cell starting so as a formula


def csv_text(value: str) -> str:
    """A text cell as a spreadsheet shows it, never runs it (OWASP, CSV injection): one
    starting with = + - @ tab or CR gets a leading single quote. A parameter name or a
    reason from a checkpoint (`=HYPERLINK(...)`) would otherwise be a live formula when the
    CSV is opened; numbers are written as they are (-0.5 stays a number)."""
    return "'" + value if value.startswith(FORMULA_STARTS) else value


def to_csv(rows: list[dict]) -> str:
    """Rows as CSV text; the header is the union of keys in first-seen order; list and
    dict cells are JSON text; text cells and names pass through csv_text."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    buf = io.StringIO()
    out = csv.DictWriter(buf, fieldnames=[_csv_cell(c) for c in columns], lineterminator="\n")
    out.writeheader()
    for row in rows:
        out.writerow({_csv_cell(k): _csv_cell(v) for k, v in row.items()})
    return buf.getvalue()


def _csv_cell(value):
    if isinstance(value, (list, dict)):
        value = json.dumps(value)
    return csv_text(value) if isinstance(value, str) else value


# -- destinations -----------------------------------------------------------------------------

OUTPUT_FLAGS = {
    "json": (("--json",), "Write the results JSON here (rewritten after every row); '-' prints it to stdout "
                          "instead of the table."),
    "csv": (("--csv",), "Write the records as CSV here (rewritten after every row)."),
    "html": (("--html",), "Write a self-contained HTML report here."),
    "markdown": (("--markdown",), "Write a GitHub Markdown report here."),
    "plot": (("--plot",), "Write a plot (PNG, SVG or PDF) here."),
}
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _same_file(a: Path, b: Path) -> bool:
    """The same file: equal real paths (./x, x and a symlink to x), or one file under two
    names (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def check_outputs(outputs, inputs=()) -> None:
    """Refuse, before any work (QstateError, exit 2), an output that is also an input file
    (it would be overwritten) or that another output writes too (one of them would be lost).
    `outputs`: (flag, path) pairs; `inputs`: (label, path) pairs, e.g. ("TRACE", "t.pt");
    None paths are skipped, and so are inputs that name no file or folder (`demo`). Inside an
    input folder (a trace's shards, a DCP checkpoint) a new file is fine, an existing one is
    part of the input (`--json shards/rank0.pt` replaced a shard with JSON)."""
    files = [(label, Path(p)) for label, p in inputs if p is not None and os.path.isfile(p)]
    folders = [(label, os.path.realpath(p)) for label, p in inputs if p is not None and os.path.isdir(p)]
    written: list[tuple[str, Path]] = []
    for flag, p in outputs:
        if p is None:
            continue
        path = Path(p)
        for label, source in files:
            if _same_file(path, source):
                raise QstateError(f"{flag} {path}: is also an input ({label}); name another file")
        if path.is_file() and not writes_in_place(path):
            real = os.path.realpath(path)
            for label, folder in folders:
                if real.startswith(folder.rstrip(os.sep) + os.sep):
                    raise QstateError(f"{flag} {path}: is a file of the input folder {label}; name a file "
                                      "outside it, or a new one")
        for other, earlier in written:
            if not writes_in_place(path) and _same_file(path, earlier):  # /dev/null twice: fine
                raise QstateError(f"{flag} {path}: {other} writes it too; name another file")
        written.append((flag, path))


@dataclass(frozen=True)
class Destinations:
    """Where a command's results go (None: not asked for); `check()` before the work.
    `inputs`: the (label, path) pairs the command reads, which no output may overwrite."""

    json: Path | None = None
    csv: Path | None = None
    html: Path | None = None
    markdown: Path | None = None
    plot: Path | None = None
    inputs: tuple = ()

    @property
    def json_to_stdout(self) -> bool:
        return self.json is not None and str(self.json) == "-"

    @property
    def json_file(self) -> Path | None:
        return None if self.json is None or self.json_to_stdout else Path(self.json)

    def files(self) -> dict[str, Path]:
        out = {name: Path(getattr(self, name)) for name in OUTPUT_FLAGS if getattr(self, name) is not None}
        if self.json_to_stdout:
            out.pop("json")
        return out

    def check(self) -> "Destinations":
        """Refuse, before any work, a path that cannot be written, that is also an input, or
        that two outputs name (QstateError, exit 2)."""
        files = self.files()
        for name, path in files.items():
            check_writable(path, f"--{name}")
        if self.plot is not None and self.plot.suffix.lower() not in PLOT_SUFFIXES:
            raise QstateError(f"--plot {self.plot}: name a .png, .svg or .pdf file")
        check_outputs([(f"--{name}", path) for name, path in files.items()], self.inputs)
        return self


# -- a command's results on their way out ------------------------------------------------------

class Sink:
    """The document of one command, rewritten to --json/--csv as it grows."""

    def __init__(self, out: Destinations):
        self.out = out.check()
        self.doc: dict | None = None
        self._env: tuple[str | None, dict] | None = None  # (device, environment(device))

    @property
    def records(self) -> list[dict]:
        return self.doc["records"] if self.doc else []

    def _environment(self, device: str | None) -> dict:
        if self._env is None or self._env[0] != device:
            self._env = (device, environment(device))
        return self._env[1]

    def begin(self, result: Result) -> None:
        """The document so far (nothing is written until a record or a result arrives)."""
        self.doc = result.document(self._environment(result.device))

    def add(self, record: dict) -> None:
        self.doc["records"].append(record)
        self.flush()

    def update(self, result: Result, final: bool = False) -> None:
        """The whole result so far, or at the end (`final`)."""
        self.doc = result.document(self._environment(result.device))
        self.flush(final)

    def flush(self, final: bool = False) -> None:
        """Rewrite the files; a device or a pipe (written in place, where every rewrite would
        add a copy or wait for a new reader) only once, when `final`."""
        if self.doc is None:
            return
        if self.out.json_file is not None and (final or not writes_in_place(self.out.json_file)):
            write_json_atomic(self.out.json_file, self.doc)
        if self.out.csv is not None and (final or not writes_in_place(self.out.csv)):
            write_text_atomic(self.out.csv, to_csv(self.doc["records"]))

    def show(self, show: Callable[[dict], None]) -> None:
        """The JSON on stdout (--json -) or the table; nothing when there is nothing."""
        if self.doc is None:
            return
        if self.out.json_to_stdout:
            print_json(self.doc)
        elif self.doc["records"] or any(isinstance(v, list) and v for k, v in self.doc.items() if k != "records"):
            show(self.doc)

    def reports(self) -> list[Path]:
        """HTML and Markdown reports of the finished document (qstate_cli/report)."""
        if self.doc is None or (self.out.html is None and self.out.markdown is None):
            return []
        try:
            from ..report import write_report
        except ImportError:
            raise QstateError("HTML/Markdown reports need qstate_cli.report") from None
        return write_report([self.doc], self.out.html, self.out.markdown)


def progress_view(label: str = "", transient: bool = False, units: bool = True):
    """Progress on stderr: a bar on a terminal, plain lines in a log (progress_view.py)."""
    return views.progress_view(stderr, label, transient, units)


def run_engine(execute: Callable, options, out: Destinations, show: Callable[[dict], None],
               row_line: Callable[[dict], str] | None = None, transient: bool = False,
               header: Callable[[int, dict], str] | None = None) -> dict:
    """Run `execute(options, progress)` with its progress on stderr (`progress_view`; one
    line per row when `row_line` is given), the files rewritten as it goes; then write the
    reports and show the result (also after Ctrl-C: the rows measured so far). Returns the
    document.

    The progress appears when the engine begins its work (`progress.begin`), so a usage
    error found while the engine checks its options is one line on stderr, nothing else."""
    sink = Sink(out)
    view = progress_view(transient=transient, units=row_line is None)

    def begin(total: int, result: Result) -> None:
        sink.begin(result)
        view.begin(total or None)
        if header:
            view.log(header(total, sink.doc))

    def row(record: dict) -> None:
        sink.add(record)
        view.advance()
        if row_line:
            view.log(row_line(record))

    completed = False
    try:
        result = execute(options, Progress(on_begin=begin, on_start=view.unit, on_row=row,
                                           on_snapshot=sink.update, on_log=view.log))
        sink.update(result, final=True)
        completed = True
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (group.Terminated): say what was kept (exit 130 or 143)
        if sink.records:
            sink.flush(final=True)  # a device or pipe gets the rows kept, once
        n, files = len(sink.records), ", ".join(str(p) for p in (out.json_file, out.csv) if p is not None)
        if n and files:
            say(f"interrupted: {n} finished row(s) kept in {files}")
        elif n:
            say(f"interrupted: {n} finished row(s) shown; no file was asked for")
        else:
            say("interrupted before any row finished: nothing was written")
        raise
    finally:  # also on Ctrl-C or SIGTERM: show what was measured, then the boundary exits 130 or 143
        view.stop(completed)
        if not completed:
            sink.show(show)
    reports = sink.reports()  # before the table: a stdout that fails (`> /dev/full`, `| true`) keeps them
    sink.show(show)
    for path in (out.json_file, out.csv, *reports):
        if path is not None:
            say(f"wrote {path}")
    return sink.doc


def exit_on_failed_rows(doc: dict, command: str) -> None:
    """Exit 1 (CheckFailed), once the files are written and the table shown, when a row of
    ours says `status: failed` (its step raised, or ran out of memory at one size): the
    sweep goes on past it, but a CI step must be able to tell. A baseline's failed row (torch's
    fp32 AdamW out of memory where a 4-bit state fits: what the sweep may be showing) and a
    row "unavailable" or "skipped" (a peer library not installed here) are no failure."""
    failed = [r for r in doc["records"] if r.get("status") == "failed" and r.get("role") != "baseline"]
    if not failed:
        return
    names = [str(r.get("name") or r.get("config") or "?") for r in failed]
    shown = ", ".join(dict.fromkeys(names[:3])) + (f" (+{len(names) - 3})" if len(names) > 3 else "")
    raise CheckFailed(f"{command}: {len(failed)} of {len(doc['records'])} rows failed ({shown}); each row's "
                      "reason says why, and the rows that ran are kept")
