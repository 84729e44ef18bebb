"""The verdict as Markdown: what `qstate compare` prints, writes with --markdown and appends
to $GITHUB_STEP_SUMMARY, and what CI posts as a PR comment.

Its opening is what decides: the heading (regression or not, the counts), then the notes
(timing not judged, rows the baseline cannot judge, machines that differ, ...), then the
files compared, as paths relative to the current folder where they lie under it (a CI log
read elsewhere gains nothing from `/home/runner/work/...`), then how timing was judged,
folded in <details>: a ~750-character rule read once, not on every PR.

Then the tables: up to LONG_TABLE (12) rows, or when every row changed, one table; longer,
what changed first, then every row folded under "All verdicts" (so no row is printed twice
in sight). A comment GitHub refuses is worse than a short one: past 65,536 characters the
API rejects it, and a 680-row corpus verdict was 69,314. So the text stays under LIMIT
(60,000, room for a bot's own header): first the `same` rows are left out (the table of
what changed lists every other row), then, where that is still too long, every row that is
not a regression, then the regressions past what fits; a line says how many rows were left
out and that `--results FILE` writes every verdict. Row names are code spans: greppable,
and never a mention or a link.
"""
from __future__ import annotations

import os

from ..report.markdown import code_span, escape, escape_in_html, folded, table_body
from ..report.model import LONG_TABLE
from .metrics import STATUSES
from .noise import NOISY_CPU_SHARE, REFERENCE_MOVED
from .notes import is_timing, timing_unjudged
from .table import verdict_counts, verdict_table

LIMIT = 60_000  # characters; GitHub's comment limit is 65,536
BOLD = {f"**{s}**" for s in STATUSES}  # a status that is a regression, in bold
RESULTS_HINT = "`qstate compare ... --results FILE` writes every verdict (kind compare, for `qstate report`)"


def table_md(t, title: str = "") -> str:
    """The verdict table, its `row` column as code spans (report.markdown.code_span): a row
    name such as `nearest-4bit [cpu] fp32 n=65536 @cpu` reads and greps as it is, and never
    mentions anyone, where escaping put a WORD JOINER after its `@`; folded under a title."""
    name = t.headers.index("row") if "row" in t.headers else -1
    body = table_body(t, lambda j, c: code_span(c) if j == name else c if c in BOLD else escape(c))
    return folded(title, len(t.rows), body) if title else body


def shown_path(path: str) -> str:
    """`path` relative to the current folder when it lies under it, else as given."""
    if not os.path.isabs(path):
        return path
    cwd = os.getcwd()
    try:
        inside = os.path.commonpath([os.path.abspath(path), cwd]) == cwd
    except ValueError:  # another drive (Windows)
        return path
    return os.path.relpath(path, cwd) if inside else path


def timing_rule(verdict) -> str:
    """How timing was judged (the files' rule, or the A/B rule the verdict carries); empty
    when no timing row was compared."""
    strict = " With --strict-timing a noisy row is a regression." if verdict.strict_timing else ""
    if verdict.rule:
        return verdict.rule + strict
    if not any(is_timing(r) for r in verdict.records):
        return ""
    mw = f" (rows without rounds: Mann-Whitney p < {verdict.alpha:g})" if verdict.alpha is not None else ""
    return (f"Timing regresses when the ratio (of the time relative to a same-run copy, where both runs have it) "
            f"exceeds {verdict.threshold:g} and the noise floor, every round apart (an exact one-sided rank test: "
            f"p = 1/C(Rb + Rn, Rb), 0.05 for 3 vs 3 rounds) and the raw time moved the same way{mw}; a row within "
            f"the threshold whose rounds spread wider than it is insignificant; a row timed on a shared CPU (cpu "
            f"share below {NOISY_CPU_SHARE:g}), or whose same-run copy reference moved more than "
            f"{REFERENCE_MOVED:g}x, is noisy, unless its step ran on one thread and NEW's raw time slowed, every "
            f"round apart, beyond what its CPU share s can explain (max(threshold, noise floor) x its copy's slowdown x (2/s - 1)): then it "
            f"regresses.{strict}")


def opening(verdict) -> list[str]:
    """The lines before the tables (module docstring: deciding notes first)."""
    head = "regression" if verdict.regressions else "no regression"
    unjudged = "; timing not judged" if timing_unjudged(verdict.records) else ""
    out = [f"### qstate compare: {head} ({verdict_counts(verdict.records)}){unjudged}", ""]
    out += [f"- {escape(n)}" for n in verdict.notes] + ([""] if verdict.notes else [])  # a list ends before a table
    files = (f"Baseline {escape(', '.join(map(shown_path, verdict.baseline)))}; "
             f"new {escape(', '.join(map(shown_path, verdict.new)))}.")
    if not verdict.rule and any(not is_timing(r) for r in verdict.records):
        files += " Quality metrics have their own tolerances (threshold column)."
    out += [files, ""]
    rule = timing_rule(verdict)
    if rule:
        out += [f"<details><summary>{escape_in_html('How timing was judged')}</summary>\n\n{escape(rule)}\n\n"
                "</details>", ""]
    return out


def verdict_markdown(verdict, limit: int = LIMIT) -> str:
    """The verdict for a PR comment or $GITHUB_STEP_SUMMARY, under `limit` characters
    (module docstring)."""
    records = verdict.records
    rows = [{**r, "name": f"{r['kind']}: {r['name']}",
             "status": f"**{r['status']}**" if r.get("regression") else r["status"]} for r in records]
    changed = [r for r, orig in zip(rows, records) if orig["status"] != "same"]
    head = opening(verdict)
    if len(rows) <= LONG_TABLE or len(changed) == len(rows):
        tables = [table_md(verdict_table(rows))]
    else:
        tables = ([table_md(verdict_table(changed)), ""] if changed else []) + [
            table_md(verdict_table(rows), "All verdicts")]
    text = "\n".join(head + tables) + "\n"
    if len(text) <= limit:
        return text
    same = len(rows) - len(changed)
    if changed and same:
        fitted = _within(head, verdict_table(changed), f"{same} `same` row{'s' * (same != 1)} left out", limit)
        if fitted:
            return fitted
    bad = [r for r, orig in zip(rows, records) if orig.get("regression")]
    others = len(rows) - len(bad)
    left = f"{others} row{'s' * (others != 1)} that are no regression ({same} of them `same`) left out"
    return _within(head, verdict_table(bad), left, limit, cut=True)


def _say(left: str) -> str:
    return f"_{left} to stay under GitHub's 65,536-character comment limit; {RESULTS_HINT}._"


def _joined(head: list[str], lines: list[str], note: str) -> str:
    return "\n".join(head + lines + ["", note]) + "\n"


def _within(head: list[str], table, left: str, limit: int, cut: bool = False) -> str | None:
    """The opening, `table` and a line saying what was `left` out, if under `limit` (else
    None); with `cut`, the table's first rows that fit, the line counting the rest."""
    lines = table_md(table).split("\n")
    text = _joined(head, lines, _say(left))
    if len(text) <= limit or not cut:
        return text if len(text) <= limit else None
    rows = lines[2:]

    def cut_note(kept: int) -> str:
        return _say(f"{left}; {len(rows) - kept} of {len(rows)} regressions left out too (the first {kept} shown)")

    room = limit - len(_joined(head, lines[:2], cut_note(len(rows))))  # the longest the line can be
    kept = []
    for line in rows:
        if len(line) + 1 > room:
            break
        room -= len(line) + 1
        kept.append(line)
    return _joined(head, lines[:2] + kept, cut_note(len(kept)))
