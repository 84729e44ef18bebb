"""The gate fails closed: evidence that is missing or does not add up is never a pass.

Checked before anything is compared (QstateError, exit 2, one line naming the file):

- every kind the baseline has, NEW has too, with at least one row, and the other way
  round (an empty NEW, or a NEW of another kind, would otherwise compare as "all
  missing" and pass; an empty baseline would pass anything);
- a timing row's `time_ms` is the median of its own `samples_ms` (within 1%; the
  engine writes exactly that, samples rounded to 6 digits), the samples are finite
  and positive: a doubled `time_ms` with the samples left alone is an edited file.

And in the verdicts (compare/__init__.py, noise.py): a timing ratio beyond the threshold
with no samples to test it is a regression (the evidence cannot clear it); a row the
baseline ran that NEW lacks, or says is "unavailable", is a regression (status
"missing"), as is one NEW ran but failed; a row NEW ran that the baseline's row did not
(skipped, failed, unavailable) is "unjudged", a regression: the baseline cannot judge it;
and a metric that either side of two rows that ran has no finite value for (`unreadable`)
is a regression: "unjudged" when the baseline lacks it (also where NEW does), "failed"
when only NEW does. A `role: copy` outside a kernels copy row is an input error
(`check_roles`); a kind of which no row was compared on both sides fails the gate
(compare_docs).
"""
from __future__ import annotations

from statistics import median

from ..errors import QstateError
from ..results import is_finite_number

MEDIAN_TOLERANCE = 0.01  # relative: time_ms against the median of samples_ms


def _sources(docs: list[dict], sources: list[str], kind: str) -> str:
    names = [src for doc, src in zip(docs, sources) if doc.get("kind") == kind] or sources
    return ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")


def check_sides(kinds: list[str], base_docs: list[dict], new_docs: list[dict],
                base_sources: list[str], new_sources: list[str]) -> None:
    """Each compared kind has rows on both sides (module docstring)."""
    for kind in kinds:
        n_base = sum(len(d["records"]) for d in base_docs if d.get("kind") == kind)
        n_new = sum(len(d["records"]) for d in new_docs if d.get("kind") == kind)
        if n_base and not n_new:
            held = sorted({str(d.get("kind")) for d in new_docs if d["records"]})
            what = f"it holds {', '.join(held)} rows" if held else "it holds no rows at all"
            raise QstateError(f"NEW {_sources(new_docs, new_sources, kind)}: no {kind} rows, but the baseline has "
                              f"{n_base} ({what}); an empty or mismatched result cannot pass the gate")
        if n_new and not n_base:
            raise QstateError(f"baseline {_sources(base_docs, base_sources, kind)}: no {kind} rows to compare NEW's "
                              f"{n_new} against; a gate needs a baseline")



def row_problem(row: dict) -> str | None:
    """Why a timing row's numbers do not add up (None: they do)."""
    samples = row.get("samples_ms")
    if samples is None or row.get("status", "ok") != "ok":
        return None
    if not isinstance(samples, list) or not all(is_finite_number(s) and s > 0 for s in samples):
        return "samples_ms must be a list of positive finite numbers"
    time_ms = row.get("time_ms")
    if not samples or time_ms is None:
        return None
    if not is_finite_number(time_ms) or time_ms <= 0:
        return f"time_ms {time_ms!r} is not a positive finite number"
    mid = median(samples)
    if abs(time_ms - mid) > MEDIAN_TOLERANCE * mid:
        return (f"time_ms {time_ms:.6g} is not the median of its samples_ms ({mid:.6g}); "
                "the file was edited or corrupted")
    return None


def check_rows(docs: list[dict], sources: list[str], side: str, timing_kinds: set[str]) -> None:
    """Every timing row of one side adds up (QstateError naming the file and the row)."""
    for doc, src in zip(docs, sources):
        if doc.get("kind") not in timing_kinds:
            continue
        for i, row in enumerate(doc["records"]):
            if isinstance(row, dict):
                problem = row_problem(row)
                if problem:
                    name = row.get("name") or f"records[{i}]"
                    raise QstateError(f"{side} {src}: row {i} ({name}): {problem}")


def unreadable(field: str, bv, nv) -> dict | None:
    """The verdict of a metric that a side of two rows that ran (status ok) does not have
    as a finite number (null, NaN, missing): unjudged where the baseline lacks it, whatever
    NEW has (nothing to judge NEW against: a null baseline beside a NaN NEW was skipped as
    "nothing compared" and passed a 3x regression), failed where only NEW lacks it; both a
    regression, since the gate cannot clear them. None when both sides have a value."""
    if bv is None and nv is None:
        why = (f"{field} is missing or not finite in the baseline and in NEW: nothing to judge (undefined "
               "for this row on both sides, or NaN written as null); regenerating the baseline cannot clear it: "
               "gate on a row that has the metric")
        return {"baseline": None, "new": None, "status": "unjudged", "regression": True, "reason": why, "why": why}
    if bv is None:
        why = f"{field} is missing or not finite in the baseline: nothing to judge NEW against; regenerate the baseline"
        return {"baseline": None, "new": nv, "status": "unjudged", "regression": True, "reason": why, "why": why}
    if nv is None:
        why = f"{field} is missing or not finite in NEW"
        return {"baseline": bv, "new": None, "status": "failed", "regression": True, "reason": why, "why": why}
    return None


def check_roles(docs: list[dict], sources: list[str], side: str) -> None:
    """`role: copy` marks a kernels run's copy reference (name and path "copy"), which is
    never judged: on any other row it would take that row out of the comparison (a baseline
    whose rows all said copy passed a 3x regression), so it is an input error there, in any
    kind (QstateError naming the file and the row)."""
    for doc, src in zip(docs, sources):
        for i, row in enumerate(doc["records"]):
            if not isinstance(row, dict) or row.get("role") != "copy":
                continue
            if doc.get("kind") != "kernels":
                where = "only kernels results have copy rows"
            elif row.get("path") != "copy":
                where = f"a copy row is the copy reference, path 'copy', not {row.get('path')!r}"
            else:
                continue
            label = row.get("name") or row.get("config") or f"records[{i}]"
            raise QstateError(f"{side} {src}: records[{i}] ({label}): role 'copy' on a {doc.get('kind')} row: "
                              f"{where}; a copy row is never compared")
