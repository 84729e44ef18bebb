"""`qstate compare BASELINE NEW`: verdicts per row and metric, and the exit code CI needs.

Statuses (docs/results.md, kind "compare"):
- improved / regressed / same: compared as metrics.py says (timing: noise.py, on the
  time relative to a same-run copy, rounds apart and beyond the noise floor; quality
  metrics: a tolerance per metric, direction-aware);
- noisy: a timing row measured while the machine was shared (cpu_share < 0.75), or whose
  same-run copy reference itself moved more than 4x between the runs (noise.py): never
  improved or regressed (but a one-thread step that NEW slowed beyond what its CPU share
  explains regresses: noise.py rule 1b), and no regression either, unless --strict-timing
  (for a dedicated runner, where a shared CPU is itself a fault) makes it one; the verdict's notes
  say how many timing rows could not be judged and why, and when none could, that the
  verdict says nothing about timing;
- insignificant: a timing ratio beyond the threshold that the evidence does not support
  (rounds overlap, within the noise floor, slower relative to the copy but not in time;
  rows without rounds: p >= alpha), or within it on a row whose noise floor exceeds it
  (noise.py); with no samples and no rounds to test, a slower ratio beyond the threshold
  regresses (fail closed);
- new: a row only NEW has; missing: a row only the baseline has (or NEW could not run it:
  status "unavailable"); where the other side has the row on another code path (kernels'
  `path`), the reason says so (notes.moved_paths: numba missing?);
- failed: NEW's row failed, or has no finite value of the metric while the baseline has one;
- unjudged: the baseline cannot judge NEW's row: its row did not run (skipped, failed,
  unavailable) while NEW's did (regenerate the baseline), its value of the metric is
  missing or not finite (null, NaN; also where NEW's is), or (kernels) the row is a copy
  row on one side and a subject on the other, or its `role` differs between the runs; and
  `nothing compared`, one per kind of which no row was compared on both sides (only copy
  rows, rows that ran on neither side) and none regressed: a gate that compared nothing is
  no pass. Where both rows did not run, NEW's status decides (failed or missing), and that
  is no regression.
A metric that both sides lack because both rows diverged (train's final_val_loss) is left
to the `diverged` metric, which judges those rows. The `copy` rows of kernels results (each
run's reference: the machine's copy speed) are not subjects and get no verdict: a slower
memory bus is no regression of ours; a `role: copy` anywhere else is an input error
(evidence.check_roles). `regression` is true for regressed and unjudged rows, and for failed
and missing rows where the baseline's row ran (status ok): a row the gate cannot judge is
not a pass, unless it is missing and named by an `allow_missing` pattern (--allow-missing:
a peer the CI machine does not install; fnmatch on the row's name or config, or its whole
name). A noisy row is the exception by default (a shared runner is the normal case, and its
timing is no evidence either way); with `strict_timing` it is a regression too. Any
regression makes `qstate compare` exit 1. The notes (notes.py) add what the table cannot
say: the false regressions to expect between identical code over the judged timing rows,
rows judged without rounds, and differences between the runs' machines, versions or bench
settings, and rows that ran on another code path. The Markdown (markdown.py) opens with
what decides, stays under GitHub's comment limit and shows row names as code spans
(greppable, never a mention); no two rows of a verdict share a name (identity.names).
The gate fails closed (evidence.py): empty, mismatched or inconsistent inputs, and
malformed fields (results.load: a key twice in one object too), are an input error (exit
2), never a pass; so are rows of one side that nothing tells apart (identity.py: rows are
matched on their kind's identity, extended where rows share it by the suite parameters or
fields that tell them apart, never by their order in the files).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

from ..errors import QstateError
from ..report.markdown import code_span
from ..results import is_finite_number
from . import evidence
from .evidence import unreadable
from .identity import keyed_rows, names
from .markdown import verdict_markdown
from .metrics import COMPARED, STATUSES, Metric, compared_kinds, metrics
from .noise import judge_rows, run_threads
from .table import verdict_counts
from .notes import (chance_notes, is_timing, missing_device, moved_paths, moved_reason, path_notes, run_notes,
                    timing_notes)

__all__ = ["STATUSES", "Verdict", "apply_strict_timing", "check_threshold", "code_span", "compare_docs",
           "compare_kind", "compare_paths", "verdict_markdown"]  # verdict_markdown, code_span: markdown.py's

NOT_RUN = "baseline row "  # how the reason of a row NEW ran and the baseline did not begins


def _num(v):
    if isinstance(v, bool):
        return float(v)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _run_share(doc: dict, row: dict) -> dict:
    """A timing row judged with its run's lowest cpu_share (meta.cpu_share, kernels) when
    that is lower: a run whose probes saw a shared CPU is noisy in every row; and (kernels)
    with the threads its step ran on (noise.run_threads: rule 1b's bound holds for one)."""
    if doc.get("kind") == "kernels":
        row = {**row, "threads": run_threads(doc, row)}
    run = _num((doc.get("meta") or {}).get("cpu_share"))
    own = _num(row.get("cpu_share"))
    if run is None or own is None or run >= own:
        return row
    return {**row, "cpu_share": run}


def _timing(metric: Metric, b: dict, n: dict, threshold: float, alpha: float) -> dict:
    return judge_rows(b, n, metric.field, threshold, alpha)  # noise.py: rounds, references, noise floor


def _quality(kind: str, metric: Metric, b: dict, n: dict) -> dict:
    bv, nv = _num(b.get(metric.field)), _num(n.get(metric.field))
    if _diverged_without(kind, metric, (b, bv), (n, nv)):
        return {}
    if bv is None or nv is None:
        return unreadable(metric.field, bv, nv)
    tol = metric.tolerance(bv)
    worse = (nv - bv) if metric.better == "lower" else (bv - nv)
    status = "regressed" if worse > tol else "improved" if -worse > tol else "same"
    return {"baseline": bv, "new": nv, "ratio": nv / bv if bv else None, "p_value": None, "threshold": tol,
            "status": status, "regression": status == "regressed"}


def _diverged_without(kind: str, metric: Metric, *sides) -> bool:
    """Whether both sides lack the metric because both rows diverged, in a kind that judges
    divergence as a metric of its own (train: a diverged run has no final loss by design,
    and `diverged` compares the two rows); one side alone is failed or unjudged as usual."""
    return (metric.field != "diverged" and any(m.field == "diverged" for m in metrics(kind))
            and all(value is None and row.get("diverged") is True for row, value in sides))


def _paths(value) -> list[str]:
    """meta.baseline / meta.new as a list of paths (a file written by hand may hold one)."""
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [] if value is None else [str(value)]


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
                 allow_missing=(), used: set | None = None, base_sources=(), new_sources=(),
                 moves: list | None = None) -> list[dict]:
    """Verdicts of the rows of one kind, matched on their identity (identity.py: the kind's
    fields, and what tells apart rows that share them; the copy rows are never judged).
    `used` collects the --allow-missing patterns that named a row, `moves` (kind, baseline
    path, NEW path) per row that ran on another code path (notes.path_notes)."""
    sides, extras, copies = keyed_rows(kind, {
        "baseline": list(zip(base_docs, list(base_sources) or [f"#{i + 1}" for i in range(len(base_docs))])),
        "NEW": list(zip(new_docs, list(new_sources) or [f"#{i + 1}" for i in range(len(new_docs))]))})
    base = {k: _run_share(r.doc, r.row) for k, r in sides["baseline"].items()}
    new = {k: _run_share(r.doc, r.row) for k, r in sides["NEW"].items()}
    shown = names(kind, sides, extras)
    moved = moved_paths(kind, [k for k in base if k not in new], [k for k in new if k not in base])
    if moves is not None:
        moves += [(kind, path, tuple(others)) for k, (path, others) in moved.items() if k in base]
    ctx = {"new_devices": {str(r.get("device")) for r in new.values() if r.get("device") is not None},
           "allow_missing": allow_missing, "used": used, "copies": copies, "moved": moved}
    records = []
    for key in list(base) + [k for k in new if k not in base]:
        b, n = base.get(key), new.get(key)
        for metric in metrics(kind):
            rec = {"name": shown[key], "kind": kind, "metric": metric.field, "unit": metric.unit,
                   "better": metric.better, "baseline": None, "new": None, "ratio": None, "p_value": None,
                   "threshold": None, "raw_ratio": None, "noise_floor": None, "why": None}
            verdict = _unmatched(kind, key, metric, b, n, ctx, shown[key])
            if verdict is None:
                verdict = (_timing(metric, b, n, threshold, alpha) if metric.timing else _quality(kind, metric, b, n))
            if verdict:
                rec.update(verdict)
                records.append(rec)
    return records


def _unmatched(kind: str, key, metric: Metric, b: dict | None, n: dict | None, ctx: dict, name: str) -> dict | None:
    """The verdict of a row that one side lacks or did not run (module docstring: missing,
    failed, new, unjudged); None where both rows ran and their values decide."""
    def say(status: str, regression: bool, reason: str, **values) -> dict:
        return {**values, "status": status, "regression": regression, "reason": reason, "why": reason}

    field_of = metric.field
    other_role = (ctx["copies"]["NEW"].get(key) if n is None else
                  ctx["copies"]["baseline"].get(key) if b is None else None)
    roles = (b or {}).get("role"), (n or {}).get("role")  # kernels: config | baseline | copy (older files: none)
    differ = kind == "kernels" and b is not None and n is not None and None not in roles and roles[0] != roles[1]
    if other_role is not None or differ:
        b_role, n_role = ("copy", roles[1]) if b is None else (roles[0], "copy") if n is None else roles
        return say("unjudged", True, f"role {b_role} in the baseline, {n_role} in NEW: a row whose role differs "
                   "between the runs cannot be compared", baseline=_num((b or {}).get(field_of)),
                   new=_num((n or {}).get(field_of)))
    if n is None or n.get("status") == "unavailable":  # a row that ran and vanished is not a pass
        reason = "not in NEW" if n is None else f"unavailable in NEW: {n.get('reason') or 'no reason given'}"
        elsewhere = None
        if n is None and key in ctx["moved"]:
            elsewhere = moved_reason("baseline", str(b.get("name")), *ctx["moved"][key])
        elif n is None:
            elsewhere = missing_device(b, ctx["new_devices"])
        reason += f"; {elsewhere}" if elsewhere else ""
        allowed = allowed_by(ctx["allow_missing"], kind, b, name)
        if allowed:
            reason += f"; allowed by --allow-missing {allowed}"
            if ctx["used"] is not None:
                ctx["used"].add(allowed)
        return say("missing", _ok(b) and not allowed, reason, baseline=_num((b or {}).get(field_of)))
    if n.get("status", "ok") != "ok":
        return say("failed", _ok(b), f"{n.get('status')} in NEW: {n.get('reason') or 'no reason given'}",
                   baseline=_num((b or {}).get(field_of)))
    if b is None:
        moved = f"; {moved_reason('NEW', str(n.get('name')), *ctx['moved'][key])}" if key in ctx["moved"] else ""
        return say("new", False, f"not in the baseline{moved}", new=_num(n.get(field_of)))
    if not _ok(b):  # a baseline made where the row could not run judges nothing it ran now
        return say("unjudged", True, f"{NOT_RUN}{b.get('status')}" + (f" ({b['reason']})" if b.get("reason") else "")
                   + " while NEW's ran: nothing to judge it against; regenerate the baseline",
                   new=_num(n.get(field_of)))
    return None


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

    @classmethod
    def from_document(cls, doc: dict) -> "Verdict":
        """The verdict a results file of kind compare holds (`document`): its rows (a row
        lacking its kind or name named `?`), meta's files, threshold, alpha, notes and
        strict_timing. The A/B rule is not written, its timing_test is: shown in its place."""
        meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
        records = [{**r, "kind": str(r.get("kind") or "?"),
                    "name": str(r.get("name") if r.get("name") is not None else "?"), "status": str(r.get("status"))}
                   for r in doc.get("records") or [] if isinstance(r, dict)]
        threshold, alpha = meta.get("threshold"), meta.get("alpha")
        test = meta.get("timing_test") if isinstance(meta.get("timing_test"), str) else None
        rule = None
        if not is_finite_number(threshold):  # a file written by hand: no threshold to state a rule with
            timed = any(map(is_timing, records))
            threshold, rule = 0.0, test or ("not recorded in this results file (its meta has no threshold)"
                                            if timed else None)
        elif not is_finite_number(alpha):  # A/B (compare/ab.py) writes no alpha
            alpha, rule = None, test
        notes = [str(n) for n in meta["notes"]] if isinstance(meta.get("notes"), list) else []
        return cls(records, threshold, alpha, _paths(meta.get("baseline")), _paths(meta.get("new")), notes, rule,
                   meta.get("strict_timing") is True, test)

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
    evidence.check_roles(base_docs, base_src, "baseline")
    evidence.check_roles(new_docs, new_src, "NEW")
    records, used, moves = [], set(), []
    for kind in kinds:
        base_kind = [(d, s) for d, s in zip(base_docs, base_src) if d.get("kind") == kind]
        new_kind = [(d, s) for d, s in zip(new_docs, new_src) if d.get("kind") == kind]
        records += compare_kind(kind, [d for d, _ in base_kind], [d for d, _ in new_kind], threshold, alpha,
                                allow_missing, used, [s for _, s in base_kind], [s for _, s in new_kind], moves)
    notes += [f"--allow-missing {p} named no missing row" for p in allow_missing if p not in used]
    if strict_timing:
        apply_strict_timing(records)
    empty = nothing_compared(kinds, records)
    records += empty
    notes = ([r["why"] for r in empty] + _baseline_notes(records) + timing_notes(records, strict_timing)
             + chance_notes(records) + path_notes(moves, base_docs, new_docs)
             + run_notes(base_docs, new_docs, timing_kinds) + notes)
    records.sort(key=lambda r: (STATUSES.index(r["status"]), r["kind"], r["name"], r["metric"]))
    test = FILES_TEST.format(alpha=alpha) if any(is_timing(r) for r in records) else None
    return Verdict(records, threshold, alpha, list(baseline_sources), list(new_sources), notes,
                   strict_timing=strict_timing, timing_test=test)


def nothing_compared(kinds: list[str], records: list[dict]) -> list[dict]:
    """A `nothing compared` record (unjudged, a regression) per kind of which no row was
    compared on both sides and none regressed: a NaN NEW beside a null baseline, a kernels
    file of copy rows only, or rows that ran on neither side passed as "no regression"."""
    out = []
    for kind in kinds:
        mine = [r for r in records if r["kind"] == kind]
        if any(r["status"] in COMPARED or r.get("regression") for r in mine):
            continue
        seen = verdict_counts(mine) if mine else "no row to compare"
        why = (f"no {kind} row was compared on both sides ({seen}): a gate that compared "
               "nothing is no pass")
        out.append({"name": "nothing compared", "kind": kind, "metric": ", ".join(m.field for m in metrics(kind)),
                    "unit": None, "better": None, "baseline": None, "new": None, "ratio": None, "p_value": None,
                    "threshold": None, "raw_ratio": None, "noise_floor": None, "status": "unjudged",
                    "regression": True, "reason": why, "why": why})
    return out


def _baseline_notes(records: list[dict]) -> list[str]:
    """The note for rows NEW ran whose baseline row did not: what to do about them."""
    rows = {(r["kind"], r["name"]) for r in records if r["status"] == "unjudged" and str(r["why"]).startswith(NOT_RUN)}
    if not rows:
        return []
    return [f"{len(rows)} row{'s' * (len(rows) != 1)} ran in NEW but not in the baseline (skipped, failed or "
            "unavailable there): unjudged, a regression, since the baseline cannot judge them; regenerate the "
            "baseline where they can run now (.ci/run: `qstate run suites/ci.yaml --out reports/ci-baseline "
            "--no-report`)"]


def compare_paths(baseline, new, threshold: float = 1.10, alpha: float = 0.01, allow_missing=(),
                  strict_timing: bool = False) -> Verdict:
    """Compare result files or folders of them (every *.json in a folder)."""
    from ..report import load_documents

    base_docs, base_src = load_documents([baseline])
    new_docs, new_src = load_documents([new])
    return compare_docs(base_docs, new_docs, threshold, alpha, base_src, new_src, allow_missing, strict_timing)
