"""A command's progress on stderr: a rich bar on a terminal, plain lines in a log
(`progress_view`). Both views take begin(total), unit(label, done), advance(), log(line)
and stop(finished), the calls qstate_cli.progress.Progress makes."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

from . import tables

class _Bar:
    """A rich progress bar (a terminal): the label, a bar, n/total, the time elapsed."""

    def __init__(self, console: Console, label: str = "", transient: bool = False):
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        self._bar = Bar(*columns, console=console, transient=transient)
        self._task = self._bar.add_task(label, total=None)

    def begin(self, total: int | None) -> None:
        self._bar.update(self._task, total=total)
        self._bar.start()

    def unit(self, label: str, done: int) -> None:
        self._bar.update(self._task, description=label, completed=done)

    def advance(self) -> None:
        self._bar.update(self._task, advance=1)

    def log(self, line: str) -> None:
        self._bar.console.print(line, highlight=False, markup=False)

    def stop(self, finished: bool = True) -> None:
        if self._bar.live.is_started:  # rich prints an empty line on stop, even unstarted
            self._bar.stop()


class Lines:
    """Progress as plain lines, for a log (CI, `2>err.log`), where rich draws its bar only
    when it stops: `qstate run suites/quick.yaml 2>err.log` wrote nothing for 7 minutes, and
    a CI job with a no-output timeout could kill it. One line per unit begun (a suite point,
    a row, a training run), `[done/total elapsed] label`, and a last `[n/n elapsed] done`.

    Sane for any number of units: a line for a new unit (another label and another count)
    waits until `unit_every_s` after the one before, a line for more of the same unit (a
    replayed step: the same label; a suite point's phases: the same count) `step_every_s`; what
    waits is written when its time comes (a timer), if no newer state replaced it, so a
    long unit after quick ones is still named while it runs. `units=False` (bench: its
    rows have a line each) writes only the log lines and the last line."""

    def __init__(self, label: str = "", units: bool = True, unit_every_s: float = 1.0, step_every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, write: Callable[[str], None] | None = None,
                 arm: Callable[[float, Callable[[], None]], object] | None = None):
        self.label, self.units, self.total, self.done = label, units, None, 0
        self._unit_done = 0  # the count the last unit() brought (advance() moves `done`, not this)
        self._every = (unit_every_s, step_every_s)
        self._clock, self._write = clock, write or plain_lines(Console(stderr=True))
        self._arm = arm or _timer
        self._lock = threading.RLock()
        self._t0: float | None = None     # when begin() came; None: not begun
        self._last_at: float | None = None  # when the last progress line was written
        self._shown: tuple | None = None    # (label, done) of that line
        self._due: float | None = None      # when the waiting state may be written; None: none waits
        self._timer = self._armed = None  # the armed timer, and the token its call must bring
        self._timer_at: float | None = None

    def begin(self, total: int | None) -> None:
        with self._lock:
            self.total, self._t0 = total, self._clock()

    def unit(self, label: str, done: int) -> None:
        with self._lock:
            new = label != self.label and done != self._unit_done  # a suite point's phases keep its count
            self.label, self.done, self._unit_done = label, done, done
            if not self.units or self._t0 is None:
                return
            every = self._every[0] if new or self._shown is None else self._every[1]
            due = self._clock() if self._last_at is None else self._last_at + every
            self._due = due if self._due is None else min(self._due, due)
            self._flush()

    def advance(self) -> None:
        with self._lock:
            self.done += 1

    def log(self, line: str) -> None:
        with self._lock:
            self._write(line)

    def stop(self, finished: bool = True) -> None:
        """The last line, `[n/total elapsed] done`, when the work finished (an error or an
        interrupt says its own line) and that line is not already the last one written."""
        with self._lock:
            self._disarm()
            self._due = None
            if finished and self._t0 is not None and self._shown != ("done", self.done):
                self._line("done")
            self._t0 = None  # a timer that fires now writes nothing

    def _flush(self) -> None:
        """Write the waiting state if its time has come, else have a timer come back then."""
        with self._lock:
            if self._due is None or self._t0 is None:
                return
            now = self._clock()
            if now >= self._due:
                self._disarm()
                self._due = None
                if self._shown != (self.label, self.done):
                    self._line(self.label)
            elif self._timer_at is None or self._due < self._timer_at:
                self._disarm()
                self._timer_at, armed = self._due, object()
                self._timer = self._arm(self._due - now, lambda: self._fire(armed))
                self._armed = armed

    def _fire(self, armed: object) -> None:
        """The timer's call (its own thread): a timer since replaced or cancelled does nothing."""
        with self._lock:
            if armed is self._armed:
                self._timer = self._timer_at = self._armed = None
                self._flush()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = self._armed = None

    def _line(self, label: str) -> None:
        now = self._clock()
        elapsed = timedelta(seconds=int(now - self._t0))
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        self._write(f"[{count} {elapsed}] {tables.visible(label)}".rstrip())  # a name from a checkpoint: text
        self._last_at, self._shown = now, (label, self.done)


def plain_lines(console: Console) -> Callable[[str], None]:
    """A writer of progress lines on `console`, as written (no markup, no wrap: a log keeps
    each whole)."""
    def write(line: str) -> None:
        console.print(line, highlight=False, markup=False, emoji=False, soft_wrap=True)
    return write


def _timer(delay_s: float, fn: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(delay_s, fn)
    timer.daemon = True  # never keeps the process alive
    timer.start()
    return timer


def progress_view(console: Console, label: str = "", transient: bool = False, units: bool = True) -> _Bar | Lines:
    """What shows a command's progress on `console` (stderr): a bar on a terminal, plain
    `Lines` when it is a file, a pipe or a dumb terminal (rich draws a bar there only when it
    stops)."""
    if console.is_terminal and not console.is_dumb_terminal:
        return _Bar(console, label, transient)
    return Lines(label, units=units, write=plain_lines(console))
