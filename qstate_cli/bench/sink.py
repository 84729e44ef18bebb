"""Where benchmark rows go as they are measured: JSON (atomic, after every row) and CSV.

Each `add` rewrites both files atomically, so Ctrl-C or a crash keeps every finished row
and never leaves a truncated file. In CSV, list cells (samples_ms) are JSON text.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from ..results import ResultWriter, write_text_atomic


class RowSink:
    def __init__(self, kind: str, json_path=None, csv_path=None, meta: dict | None = None,
                 env: dict | None = None):
        self.writer = ResultWriter(json_path, kind, meta, env)
        self.csv_path = Path(csv_path) if csv_path else None

    @property
    def doc(self) -> dict:
        return self.writer.doc

    @property
    def records(self) -> list[dict]:
        return self.writer.records

    def add(self, row: dict) -> None:
        self.writer.add(row)
        if self.csv_path is not None:
            write_text_atomic(self.csv_path, to_csv(self.records))


def to_csv(rows: list[dict]) -> str:
    """Rows as CSV text; the header is the union of keys in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    buf = io.StringIO()
    out = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    out.writeheader()
    for row in rows:
        out.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})
    return buf.getvalue()
