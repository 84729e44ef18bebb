"""What an engine reports while it works, as callbacks; the edge decides what to show.

    progress = Progress(on_row=sink.add, on_log=print)   # the CLI: a bar, lines, files
    result = engine.execute(options, progress)            # a suite or a test: Progress()

    begin(total, result)   once, before the work: how many units, and the result so far
                           (kind, meta, device; no records yet; None when there is none)
    start(label, done)     before each unit (a row, a replayed step, a training run)
    row(record)            a finished record (the CLI rewrites its files after each one,
                           so Ctrl-C keeps every finished row)
    snapshot(result)       the whole result so far, when more than records grew (train:
                           series and summary)
    log(line)              a line for the user (stderr in the CLI)

Engines never print, write or draw a progress bar; every callback is optional.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .results import Result


@dataclass
class Progress:
    on_begin: Callable[[int, Result | None], None] | None = None
    on_start: Callable[[str, int], None] | None = None
    on_row: Callable[[dict], None] | None = None
    on_snapshot: Callable[[Result], None] | None = None
    on_log: Callable[[str], None] | None = None

    def begin(self, total: int, result: Result | None) -> None:
        if self.on_begin:
            self.on_begin(total, result)

    def start(self, label: str, done: int) -> None:
        if self.on_start:
            self.on_start(label, done)

    def row(self, record: dict) -> None:
        if self.on_row:
            self.on_row(record)

    def snapshot(self, result: Result) -> None:
        if self.on_snapshot:
            self.on_snapshot(result)

    def log(self, line: str) -> None:
        if self.on_log:
            self.on_log(line)


QUIET = Progress()
