"""The verdict table, one row per (row, metric), as the Markdown comment (markdown.py) and
the report of a compare results file (section.py) both draw it; and the counts per status
that head a verdict."""
from __future__ import annotations

from collections import Counter

from ..report.model import Table
from ..results import is_finite_number
from .metrics import STATUSES


def verdict_counts(rows: list[dict]) -> str:
    """"1 regressed, 4 same": how many rows have each status, worst first."""
    counts = Counter(r.get("status") for r in rows)
    return ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s]) or "nothing compared"


def distinct_digits(a, b, least: int = 4, most: int = 17) -> int:
    """The significant digits that print `a` and `b` differently when they differ (at least
    `least`; 17 tells any two doubles apart): a bytes_per_param regressed by 7e-4 read
    `1.118 | 1.118` at 4."""
    if not (is_finite_number(a) and is_finite_number(b)) or a == b:
        return least
    return next((d for d in range(least, most + 1) if format(a, f".{d}g") != format(b, f".{d}g")), most)


def _baseline_new(r: dict) -> dict:
    """The row with baseline and new formatted to the digits that tell them apart."""
    b, n = r.get("baseline"), r.get("new")
    d = distinct_digits(b, n)
    return {**r, **{k: format(v, f".{d}g") for k, v in (("baseline", b), ("new", n)) if is_finite_number(v)}}


def verdict_table(rows: list[dict]) -> Table:
    rows = [_baseline_new(r) for r in rows]
    return Table.of("Verdicts", rows, [("status", "status"), ("name", "row"), ("metric", "metric"),
                                       ("baseline", "baseline", ".4g"), ("new", "new", ".4g"),
                                       ("ratio", "ratio", ".4g"), ("raw_ratio", "raw ratio", ".4g"),
                                       ("noise_floor", "noise floor", ".4g"), ("p_value", "p", ".2g"),
                                       ("threshold", "threshold"), ("why", "why")])
