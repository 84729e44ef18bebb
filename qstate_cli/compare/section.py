"""The report section of a compare results file (named by the kinds table, kinds.py):
the verdict as `qstate compare` gives it, so `qstate report compare.json` reads as the
comment CI posts."""
from __future__ import annotations

from ..report.model import LONG_TABLE, Section, Table
from . import Verdict
from .markdown import shown_path, timing_rule, verdict_markdown
from .metrics import STATUSES
from .table import verdict_table


def compare(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    """Its heading as the title (regression or not, the counts), its notes, the files
    compared and how timing was judged, then the rows, named `kind: name`, a regression in
    bold; the Markdown is verdict_markdown's own."""
    verdict = Verdict.from_document(doc)
    heading, _, body = verdict_markdown(verdict).partition("\n")
    title = heading.lstrip("#").strip()  # "qstate compare: regression (1 missing, 4 same)"
    sec = Section(title, "compare", source, markdown=body.strip("\n"))
    sec.lead = [*verdict.notes,
                f"Baseline {', '.join(map(shown_path, verdict.baseline)) or 'not recorded'}; "
                f"new {', '.join(map(shown_path, verdict.new)) or 'not recorded'}."]
    rule = timing_rule(verdict)
    if rule:
        sec.lead.append(f"How timing was judged: {rule}")
    rows = sorted(verdict.records, key=lambda r: (STATUSES.index(r["status"]) if r["status"] in STATUSES
                                                  else len(STATUSES), r["kind"], r["name"], str(r.get("metric"))))
    named = [{**r, "name": f"{r['kind']}: {r['name']}"} for r in rows]
    changed = [r for r in named if r["status"] != "same"]
    if len(named) <= LONG_TABLE or len(changed) == len(named):  # as verdict_markdown lays them out
        sec.tables.append(_strong(verdict_table(named), named, fold=False))
    else:
        if changed:
            sec.tables.append(_strong(verdict_table(changed), changed, fold=False, title="Changed"))
        sec.tables.append(_strong(verdict_table(named), named, fold=True, title="All verdicts"))
    return sec, [title.removeprefix("qstate ")]


def _strong(t: Table, rows: list[dict], fold: bool, title: str = "") -> Table:
    t.strong, t.fold = [r.get("regression") is True for r in rows], fold
    t.title = title or t.title
    return t
