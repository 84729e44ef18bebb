"""`qstate compare BASELINE NEW`: verdicts per row and metric, and the exit code CI needs.

Statuses (docs/results.md, kind "compare"):
- improved / regressed / same: compared as metrics.py says (timing: noise.py, on the
  time relative to a same-run copy, rounds apart and beyond the noise floor; quality
  metrics: a tolerance per metric, direction-aware);
- noisy: a timing row measured while the machine was shared (cpu_share < 0.75), or whose
  same-run copy reference itself moved more than 4x between the runs (noise.py): never
  improved or regressed, and no regression either, unless --strict-timing (for a
  dedicated runner, where a shared CPU is itself a fault) makes it one; the verdict's notes
  say how many timing rows could not be judged and why, and when none could, that the
  verdict says nothing about timing;
- insignificant: a timing ratio beyond the threshold that the evidence does not support
  (rounds overlap, within the noise floor, slower relative to the copy but not in time;
  rows without rounds: p >= alpha), or within it on a row whose noise floor exceeds it
  (noise.py); with no samples and no rounds to test, a slower ratio beyond the threshold
  regresses (fail closed);
- new: a row only NEW has (or the baseline's row had not run); missing: a row only the
  baseline has (or NEW could not run it: status "unavailable");
- failed: NEW's row failed, or has no finite value of the metric;
- unjudged: both rows ran, but the baseline's value of the metric is missing or not finite
  (NaN) while NEW has one: nothing to judge NEW against.
The `copy` rows of kernels results (each run's reference: the machine's copy speed) are
not subjects and get no verdict: a slower memory bus is no regression of ours.
`regression` is true for regressed rows, and for failed, unjudged and missing rows where
the baseline's row ran (status ok): a row the gate cannot judge is not a pass, unless it
is missing and named by an `allow_missing` pattern (--allow-missing: a peer the CI machine
does not install; fnmatch on the row's name or config, or its whole name). A noisy row is
the exception by default (a shared runner is the normal case, and its timing is no
evidence either way); with `strict_timing` it is a regression too. Any
regression makes `qstate compare` exit 1. The notes (notes.py) add what the table cannot
say: the false regressions to expect between identical code over the judged timing rows,
rows judged without rounds, and differences between the runs' machines, versions or bench
settings. The Markdown shows row names as code spans (greppable, never a mention). The gate fails closed (evidence.py): empty,
mismatched or inconsistent inputs, and malformed fields (results.load), are an input error
(exit 2), never a pass; so are rows of one side that nothing tells apart (identity.py: rows
are matched on their kind's identity, extended where rows share it by the suite parameters
or fields that tell them apart, never by their order in the files).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

from ..errors import QstateError
from ..report.markdown import code_span
from . import evidence
from .evidence import unreadable
from .identity import keyed_rows, name as row_identity_name
from .metrics import Metric, compared_kinds, metrics
from .noise import NOISY_CPU_SHARE, REFERENCE_MOVED, judge_rows
from .notes import chance_notes, is_timing, missing_device, run_notes, timing_notes, timing_unjudged

STATUSES = ("regressed", "failed", "unjudged", "missing", "new", "noisy", "insignificant", "improved", "same")


def _num(v):
    if isinstance(v, bool):
        return float(v)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _run_share(doc: dict, row: dict) -> dict:
    """A timing row judged with its run's lowest cpu_share (meta.cpu_share, kernels) when
    that is lower: a run whose probes saw a shared CPU is noisy in every row."""
    run = _num((doc.get("meta") or {}).get("cpu_share"))
    own = _num(row.get("cpu_share"))
    if run is None or own is None or run >= own:
        return row
    return {**row, "cpu_share": run}


def _timing(metric: Metric, b: dict, n: dict, threshold: float, alpha: float) -> dict:
    return judge_rows(b, n, metric.field, threshold, alpha)  # noise.py: rounds, references, noise floor


def _quality(metric: Metric, b: dict, n: dict) -> dict:
    bv, nv = _num(b.get(metric.field)), _num(n.get(metric.field))
    if bv is None and nv is None:  # e.g. no final loss on either side (both diverged): nothing to compare
        return {}
    if bv is None or nv is None:
        return unreadable(metric.field, bv, nv)
    tol = metric.tolerance(bv)
    worse = (nv - bv) if metric.better == "lower" else (bv - nv)
    status = "regressed" if worse > tol else "improved" if -worse > tol else "same"
    return {"baseline": bv, "new": nv, "ratio": nv / bv if bv else None, "p_value": None, "threshold": tol,
            "status": status, "regression": status == "regressed"}


STRICT_WHY = "--strict-timing: a timing row that could not be judged fails the gate"


def apply_strict_timing(records: list[dict]) -> None:
    """--strict-timing: every noisy row is a regression (its status stays noisy)."""
    for r in records:
        if r["status"] == "noisy":
            r["regression"] = True
            r["why"] = f"{r['why']}; {STRICT_WHY}" if r.get("why") else STRICT_WHY


def _ok(row: dict | None) -> bool:
    return row is not None and row.get("status", "ok") == "ok"


def allowed_by(patterns, kind: str, row: dict, name: str) -> str | None:
    """The first --allow-missing pattern naming this row: fnmatch on its subject (`name`,
    else `config`) or its whole compare name, e.g. `bnb-*` or `'torchao-4bit [torchao]*'`."""
    subject = str(row.get("name") or row.get("config") or "")
    return next((p for p in patterns if fnmatch.fnmatchcase(subject, p) or fnmatch.fnmatchcase(name, p)), None)


def compare_kind(kind: str, base_docs: list[dict], new_docs: list[dict], threshold: float, alpha: float,
                 allow_missing=(), used: set | None = None, base_sources=(), new_sources=()) -> list[dict]:
    """Verdicts of the rows of one kind, matched on their identity (identity.py: the kind's
    fields, and what tells apart rows that share them; the copy rows are never judged)."""
    sides, extras = keyed_rows(kind, {
        "baseline": list(zip(base_docs, list(base_sources) or [f"#{i + 1}" for i in range(len(base_docs))])),
        "NEW": list(zip(new_docs, list(new_sources) or [f"#{i + 1}" for i in range(len(new_docs))]))})
    base = {k: _run_share(r.doc, r.row) for k, r in sides["baseline"].items()}
    new = {k: _run_share(r.doc, r.row) for k, r in sides["NEW"].items()}
    new_devices = {str(r.get("device")) for r in new.values() if r.get("device") is not None}
    records = []
    for key in list(base) + [k for k in new if k not in base]:
        b, n = base.get(key), new.get(key)
        name = row_identity_name(kind, sides["NEW"].get(key) or sides["baseline"][key], extras)
        for metric in metrics(kind):
            rec = {"name": name, "kind": kind, "metric": metric.field, "unit": metric.unit, "better": metric.better,
                   "baseline": None, "new": None, "ratio": None, "p_value": None, "threshold": None,
                   "raw_ratio": None, "noise_floor": None, "why": None}
            if n is None or n.get("status") == "unavailable":  # a row that ran and vanished is not a pass
                reason = "not in NEW" if n is None else f"unavailable in NEW: {n.get('reason') or 'no reason given'}"
                elsewhere = missing_device(b, new_devices) if n is None else None
                reason += f"; {elsewhere}" if elsewhere else ""
                allowed = allowed_by(allow_missing, kind, b, name)
                if allowed:
                    reason += f"; allowed by --allow-missing {allowed}"
                    if used is not None:
                        used.add(allowed)
                rec.update(baseline=_num((b or {}).get(metric.field)), status="missing",
                           regression=_ok(b) and not allowed, reason=reason, why=reason)
            elif n.get("status", "ok") != "ok":
                reason = f"{n.get('status')} in NEW: {n.get('reason') or 'no reason given'}"
                rec.update(baseline=_num((b or {}).get(metric.field)), status="failed", regression=_ok(b),
                           reason=reason, why=reason)
            elif not _ok(b):
                reason = "not in the baseline" if b is None else f"baseline row {b.get('status')}"
                rec.update(new=_num(n.get(metric.field)), status="new", regression=False, reason=reason, why=reason)
            else:
                verdict = (_timing(metric, b, n, threshold, alpha) if metric.timing else _quality(metric, b, n))
                if not verdict:
                    continue
                rec.update(verdict)
            records.append(rec)
    return records


@dataclass
class Verdict:
    records: list[dict]
    threshold: float
    alpha: float | None  # rows without rounds only; None where no row is judged by it (A/B)
    baseline: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rule: str | None = None  # how timing was judged, when not the default (A/B)
    strict_timing: bool = False  # noisy timing rows are regressions (--strict-timing)
    timing_test: str | None = None  # the tests that judged timing rows (meta.timing_test)

    @property
    def regressions(self) -> list[dict]:
        return [r for r in self.records if r.get("regression")]

    def counts(self) -> dict[str, int]:
        return {s: sum(r["status"] == s for r in self.records) for s in STATUSES if any(r["status"] == s
                                                                                        for r in self.records)}

    def document(self) -> dict:
        from ..results import document

        meta = {"baseline": self.baseline, "new": self.new, "threshold": self.threshold}
        if self.alpha is not None:
            meta["alpha"] = self.alpha
        if self.timing_test:
            meta["timing_test"] = self.timing_test
        return document("compare", self.records, {**meta, "strict_timing": self.strict_timing, "notes": self.notes})

    def benchmark(self) -> list[dict]:
        """github-action-benchmark input (tool: customSmallerIsBetter): NEW's values;
        a higher-is-better metric is sent as its gap to 1 (1 - cosine). Noisy rows are left
        out: a time taken on a shared CPU (or beside a copy reference that stalled) measures
        the machine, not the code, and the action's own alert would fire on it."""
        out = []
        for r in self.records:
            value = r.get("new")
            if value is None or r["metric"] == "diverged" or r["status"] == "noisy":
                continue
            name, unit = f"{r['kind']}: {r['name']} {r['metric']}", r["unit"]
            if r["better"] == "higher":
                value, name, unit = 1.0 - value, f"{name} gap (1 - value)", f"1 - {unit}"
            extra = f"status: {r['status']}" + (f"; baseline {r['baseline']:.6g}" if r.get("baseline") is not None
                                                else "")
            out.append({"name": name, "unit": unit, "value": value, "extra": extra})
        return out


FILES_TEST = ("rows with rounds: full separation of the rounds (an exact one-sided rank test, p = 1/C(Rb + Rn, Rb) "
              "for Rb vs Rn rounds: 0.05 for 3 vs 3, 1/252 for 5 vs 5; p_value the exact rank-sum p), beyond the "
              "threshold and the noise floor, the raw time moving the same way; rows without rounds: two-sided "
              "Mann-Whitney U on samples_ms, p < alpha {alpha:g}")


def check_threshold(threshold: float) -> None:
    """--threshold is a finite ratio above 1 (inf would turn every timing regression off)."""
    if not (math.isfinite(threshold) and threshold > 1):
        raise QstateError(f"--threshold {threshold}: use a finite ratio above 1 (e.g. 1.10 = 10% slower)")


def compare_docs(base_docs: list[dict], new_docs: list[dict], threshold: float = 1.10, alpha: float = 0.01,
                 baseline_sources=(), new_sources=(), allow_missing=(), strict_timing: bool = False) -> Verdict:
    check_threshold(threshold)
    allow_missing = [str(p).strip() for p in allow_missing]
    if any(not p for p in allow_missing):
        raise QstateError("--allow-missing '': name the rows NEW may lack (a name or glob, e.g. bnb-*)")
    if not 0 < alpha < 1:
        raise QstateError(f"--alpha {alpha}: use a significance level between 0 and 1 (e.g. 0.01)")
    kinds = sorted({d.get("kind") for d in base_docs + new_docs} - {"compare"})
    notes = [f"kind {k!r} is not compared" for k in kinds if k not in compared_kinds()]
    kinds = [k for k in kinds if k in compared_kinds()]
    if not kinds:
        raise QstateError("nothing to compare: no kernels, memory, diagnose or train results in either input")
    base_src = list(baseline_sources) or [f"#{i + 1}" for i in range(len(base_docs))]
    new_src = list(new_sources) or [f"#{i + 1}" for i in range(len(new_docs))]
    evidence.check_sides(kinds, base_docs, new_docs, base_src, new_src)
    timing_kinds = {k for k in kinds if any(m.timing for m in metrics(k))}
    evidence.check_rows(base_docs, base_src, "baseline", timing_kinds)
    evidence.check_rows(new_docs, new_src, "NEW", timing_kinds)
    records, used = [], set()
    for kind in kinds:
        base_kind = [(d, s) for d, s in zip(base_docs, base_src) if d.get("kind") == kind]
        new_kind = [(d, s) for d, s in zip(new_docs, new_src) if d.get("kind") == kind]
        records += compare_kind(kind, [d for d, _ in base_kind], [d for d, _ in new_kind], threshold, alpha,
                                allow_missing, used, [s for _, s in base_kind], [s for _, s in new_kind])
    notes += [f"--allow-missing {p} named no missing row" for p in allow_missing if p not in used]
    if strict_timing:
        apply_strict_timing(records)
    notes = timing_notes(records, strict_timing) + chance_notes(records) + run_notes(
        base_docs, new_docs, timing_kinds) + notes
    records.sort(key=lambda r: (STATUSES.index(r["status"]), r["kind"], r["name"], r["metric"]))
    test = FILES_TEST.format(alpha=alpha) if any(is_timing(r) for r in records) else None
    return Verdict(records, threshold, alpha, list(baseline_sources), list(new_sources), notes,
                   strict_timing=strict_timing, timing_test=test)


def compare_paths(baseline, new, threshold: float = 1.10, alpha: float = 0.01, allow_missing=(),
                  strict_timing: bool = False) -> Verdict:
    """Compare result files or folders of them (every *.json in a folder)."""
    from ..report import load_documents

    base_docs, base_src = load_documents([baseline])
    new_docs, new_src = load_documents([new])
    return compare_docs(base_docs, new_docs, threshold, alpha, base_src, new_src, allow_missing, strict_timing)


def _table_md(t, title: str = "") -> str:
    """The verdict table, its `row` column as code spans (report.markdown.code_span): a row
    name such as `nearest-4bit [cpu] fp32 n=65536 @cpu` reads and greps as it is, and never
    mentions anyone, where escaping put a WORD JOINER after its `@`; folded under a title."""
    from ..report.markdown import escape, folded, table_body

    name = t.headers.index("row") if "row" in t.headers else -1
    body = table_body(t, lambda j, c: code_span(c) if j == name else c if c in BOLD else escape(c))
    return folded(title, len(t.rows), body) if title else body


BOLD = {f"**{s}**" for s in STATUSES}  # a status that is a regression, in bold


def verdict_markdown(verdict: Verdict) -> str:
    """The verdict table for a PR comment or $GITHUB_STEP_SUMMARY. Up to LONG_TABLE (12)
    rows, or when every row changed: one table. Longer: what changed first, then every row
    folded in <details> (so no row is printed twice in sight). Row names are code spans."""
    from ..report.markdown import escape
    from ..report.model import LONG_TABLE
    from ..report.sections import verdict_counts, verdict_table

    rows = [{**r, "name": f"{r['kind']}: {r['name']}",
             "status": f"**{r['status']}**" if r.get("regression") else r["status"]} for r in verdict.records]
    changed = [r for r, orig in zip(rows, verdict.records) if orig["status"] != "same"]
    head = "regression" if verdict.regressions else "no regression"
    unjudged = "; timing not judged" if timing_unjudged(verdict.records) else ""
    strict = " With --strict-timing a noisy row is a regression." if verdict.strict_timing else ""
    if verdict.rule:
        rule = escape(verdict.rule + strict)
    else:
        rule = ""
        if any(is_timing(r) for r in verdict.records):
            mw = f" (rows without rounds: Mann-Whitney p < {verdict.alpha:g})" if verdict.alpha is not None else ""
            rule += (f" Timing regresses when the ratio (of the time relative to a same-run copy, where both runs "
                     f"have it) exceeds {verdict.threshold:g} and the noise floor, every round apart (an exact "
                     f"one-sided rank test: p = 1/C(Rb + Rn, Rb), 0.05 for 3 vs 3 rounds) and the raw time moved "
                     f"the same way{mw}; a row within the "
                     f"threshold whose rounds spread wider than it is insignificant; a row timed on a shared CPU "
                     f"(cpu share below {NOISY_CPU_SHARE:g}), or whose same-run copy reference moved more than "
                     f"{REFERENCE_MOVED:g}x, is noisy.{strict}")
        if any(not is_timing(r) for r in verdict.records):
            rule += " Quality metrics have their own tolerances (threshold column)."
    out = [f"### qstate compare: {head} ({verdict_counts(verdict.records)}){unjudged}", "",
           f"Baseline {escape(', '.join(verdict.baseline))}; new {escape(', '.join(verdict.new))}."
           + (" " + rule.strip() if rule.strip() else ""), ""]
    out += [f"- {escape(n)}" for n in verdict.notes] + ([""] if verdict.notes else [])  # a list ends before a table
    full = verdict_table(rows)
    if len(rows) <= LONG_TABLE or len(changed) == len(rows):
        out.append(_table_md(full))
    else:
        if changed:
            out += [_table_md(verdict_table(changed)), ""]
        out.append(_table_md(full, "All verdicts"))
    return "\n".join(out) + "\n"
