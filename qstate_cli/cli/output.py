"""Where output goes: results to stdout (or the file named), progress and logs to stderr."""
from __future__ import annotations

import json
import os
import sys

from rich.console import Console
from rich.table import Table

def _console(**kw) -> Console:
    """Wide enough for our tables when output is piped (rich assumes 80 columns)."""
    con = Console(**kw)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con = Console(width=160, **kw)
    return con


stdout = _console()
stderr = _console(stderr=True)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def table(title: str | None, rows: list[dict], columns: list[str] | None = None,
          formats: dict | None = None, headers: dict | None = None) -> Table:
    """A rich table from flat records (columns default to the first row's keys)."""
    columns = columns or (list(rows[0]) if rows else [])
    formats = formats or {}
    headers = headers or {}
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in columns:
        sample = next((r.get(col) for r in rows if r.get(col) is not None), None)
        numeric = isinstance(sample, (int, float)) and not isinstance(sample, bool)
        t.add_column(headers.get(col, col), justify="right" if numeric else "left", overflow="fold")
    for row in rows:
        cells = []
        for col in columns:
            val = row.get(col)
            fmt = formats.get(col)
            if val is None:
                cells.append("-")
            elif fmt:
                cells.append(fmt(val) if callable(fmt) else format(val, fmt))
            else:
                cells.append(str(val))
        t.add_row(*cells)
    return t
