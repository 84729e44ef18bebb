"""What a report holds, independent of HTML or Markdown: tables of formatted cells and
plots (made on demand, so a Markdown report without images draws nothing)."""
from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Callable

LONG_TABLE = 12  # rows; longer tables fold into <details>
MISSING = "–"


def cell(value, fmt=None) -> str:
    """One formatted cell: None as a dash, NaN/inf spelled out, bools as yes/no."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return f"[{len(value)} values]"
    if callable(fmt):
        return fmt(value)
    if fmt and isinstance(value, (int, float)):
        return format(value, fmt)
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def pct(fraction) -> str:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        return str(fraction)  # a row that did not run may hold text here
    return f"{100 * fraction:.1f}%"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str = ""
    fold: bool | None = None  # None: fold when longer than LONG_TABLE rows
    strong: list[bool] = field(default_factory=list)  # per row: shown in bold (a verdict that is a regression)

    @property
    def long(self) -> bool:
        return len(self.rows) > LONG_TABLE if self.fold is None else self.fold

    @classmethod
    def of(cls, title: str, records: list[dict], columns: list[tuple], note: str = "") -> "Table":
        """columns: (key, header[, fmt]); cells formatted by `cell`."""
        cols = [(c[0], c[1], c[2] if len(c) > 2 else None) for c in columns]
        present = [c for c in cols if any(r.get(c[0]) is not None for r in records)] or cols
        return cls(title, [h for _, h, _ in present], [[cell(r.get(k), f) for k, _, f in present] for r in records],
                   note)


@dataclass
class Plot:
    name: str  # file stem when saved
    title: str
    caption: str
    draw: Callable[[], bytes]
    link: str | None = None  # where the PNG was saved, for Markdown
    _png: bytes | None = field(default=None, repr=False)

    def png(self) -> bytes:
        if self._png is None:
            self._png = self.draw()
        return self._png

    def data_uri(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png()).decode("ascii")


@dataclass
class Section:
    title: str
    kind: str
    source: str
    notes: list[str] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    lead: list[str] = field(default_factory=list)  # what decides, after the notes: a list (compare's verdict notes)
    markdown: str | None = None  # the kind's own Markdown, written after the notes in place of lead, plots, tables


@dataclass
class Report:
    title: str
    created: str
    env: Table
    banners: list[str]
    summary: list[str]
    sections: list[Section]
