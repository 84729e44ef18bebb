"""The terminal tables of every command: cells never fold; columns that do not fit go on below.

rich fits a table to the console by folding cells, and a wide one (diagnose's 19 columns
with seven configurations, bench kernels' 12) came out at 80 or 100 columns as digits
stacked one or two to a line: `0.` above `00` above `41`. `table()` instead measures each
column's natural width (its header or longest cell) and packs the
columns into as many tables as the console needs, one below the other, each repeating the
key columns (the leading columns up to the first text one: rank and config, a name), the
way pandas prints a wide frame. A column of free text wider than TEXT_WIDTH (a purpose, a
note, a path) may still wrap at its spaces, within its table.

Every cell, header and title passes through `visible`: the text comes from files a stranger
may have made (a parameter name in a checkpoint, a run name in a suite), and a control
character in it reached the terminal as it was, so `\\x1b]0;...` retitled the window and
`\\x1b[2J` cleared it to print a fake `0 errors - healthy`. Each C0 and C1 control
character (tab and newline too: a cell is one line) and DEL is shown as its escape, `\\x1b`.
"""
from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

TEXT_WIDTH = 32  # characters: a column whose longest cell is wider may wrap (and packs as this wide)
BORDER = 3  # characters a column adds to a table: a rule and a space either side
MAX_KEYS = 2  # leading key columns repeated in every part
CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}  # C0, DEL, C1


def visible(text: str) -> str:
    """`text` with every control character shown as its escape (module docstring)."""
    return text.translate(CONTROL_ESCAPES)


class SplitTable:
    """A table of text cells that renders as one rich Table where it fits the console and as
    several, each with the key columns, where it does not (module docstring)."""

    def __init__(self, title: str | None, headers: list[str], numeric: list[bool], rows: list[list[str]]):
        self.title = None if title is None else visible(title)
        self.headers, self.numeric = [visible(h) for h in headers], numeric
        self.rows = [[visible(cell) for cell in row] for row in rows]
        self.natural = [max([len(h)] + [len(r[i]) for r in self.rows]) for i, h in enumerate(self.headers)]
        keys = 0
        while keys < min(MAX_KEYS, len(headers) - 1) and self.natural[keys] <= TEXT_WIDTH:
            keys += 1
            if not numeric[keys - 1]:
                break
        self.keys = list(range(keys)) if keys < len(headers) and not all(numeric[:keys]) else []

    def _width(self, i: int) -> int:
        return min(self.natural[i], TEXT_WIDTH) + BORDER

    def parts(self, width: int) -> list[list[int]]:
        """The columns of each table, key columns first, packed into `width` characters."""
        rest = [i for i in range(len(self.headers)) if i not in self.keys]
        base = 1 + sum(self._width(i) for i in self.keys)
        parts, cur, used = [], [], base
        for i in rest:
            if cur and used + self._width(i) > width:
                parts.append(cur)
                cur, used = [], base
            cur.append(i)
            used += self._width(i)
        parts.append(cur)
        return [self.keys + p for p in parts]

    def render(self, columns: list[int], title: str | None) -> Table:
        t = Table(title=None if title is None else Text(title), title_justify="left", header_style="bold")
        for i in columns:
            long = self.natural[i] > TEXT_WIDTH
            t.add_column(Text(self.headers[i]), justify="right" if self.numeric[i] else "left",
                         no_wrap=not long, min_width=None if long else self.natural[i],
                         overflow="fold" if long else "ellipsis")
        for row in self.rows:
            t.add_row(*(Text(row[i]) for i in columns))  # text, not markup: "qstate-cli[peers]" stays whole
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        parts = self.parts(options.max_width)
        for k, columns in enumerate(parts):
            if len(parts) == 1:
                title = self.title
            elif k == 0:
                title = f"{self.title} (1/{len(parts)})" if self.title else f"(1/{len(parts)})"
            else:
                title = f"(continued, {k + 1}/{len(parts)})"
            yield self.render(columns, title)


def table(title: str | None, rows: list[dict], columns: list[str] | None = None,
          formats: dict | None = None, headers: dict | None = None) -> SplitTable:
    """A terminal table from flat records (columns default to the first row's keys; a None
    cell shows as '-'; formats: a format spec or a function per column)."""
    columns = columns or (list(rows[0]) if rows else [])
    formats, headers = formats or {}, headers or {}
    numeric = []
    for col in columns:
        sample = next((r.get(col) for r in rows if r.get(col) is not None), None)
        numeric.append(isinstance(sample, (int, float)) and not isinstance(sample, bool))
    cells = []
    for row in rows:
        line = []
        for col in columns:
            val, fmt = row.get(col), formats.get(col)
            line.append("-" if val is None else (fmt(val) if callable(fmt) else format(val, fmt)) if fmt else str(val))
        cells.append(line)
    return SplitTable(title, [str(headers.get(c, c)) for c in columns], numeric, cells)
