"""Diagnose results across traces: one row per trace and configuration, and each
configuration's median over the traces (what `suites/corpus.yaml` is read by).

A record's trace is its suite point's `trace` parameter (as the user wrote it, e.g.
`corpus:digits-cnn`), else the document's `meta.trace`. Columns that a diagnose record
may or may not carry (the code-level stall rate, the empirical model's prediction, the
model's warning) appear when any record has them. A configuration run at points that
differ in another parameter is one row per value (`bf16 reset=auto`).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

from . import labels
from .model import Table, pct
from ..results import is_finite_number

# (record field of the v state, row key, header, format): shown only when present
OPTIONAL_V = (("code_stall_rate", "code_stall_v", "code stall v", pct),
              ("stall_rate_predicted_empirical", "pred_emp_v", "pred v (empirical)", pct))



def trace_of(record: dict, doc: dict) -> str:
    points = ((doc.get("meta") or {}).get("suite") or {}).get("points") or {}
    params = (points.get(record.get("point")) or {}).get("params") or {}
    return str(params.get("trace") or (doc.get("meta") or {}).get("trace") or "?")


def per_trace_rows(doc: dict) -> list[dict]:
    """One row per (trace, configuration), ranked within each trace by update error."""
    rows: dict[tuple, dict] = {}
    axes = labels.varying(doc, skip=("config", "trace"))  # e.g. reset: `bf16 reset=auto` is its own row
    for r in doc.get("records") or []:
        if r.get("status", "ok") != "ok" or "state" not in r:
            continue
        trace = trace_of(r, doc)
        config = labels.label(r["config"], {"variant": labels.variant(doc, r, axes)})
        row = rows.setdefault((trace, config), {
            "trace": trace, "config": config, "bytes_per_param": r.get("bytes_per_param"),
            "update_rel_error": r.get("update_rel_error"), "update_cosine": r.get("update_cosine")})
        s = r["state"]
        row[f"drift_{s}"] = r.get("drift_mean")
        row[f"stall_{s}"] = r.get("stall_rate")
        if s == "v":
            row["pred_v"] = r.get("stall_rate_predicted")
            for field, key, _, _ in OPTIONAL_V:
                if field in r:
                    row[key] = r[field]
        if r.get("model_warning"):
            row.setdefault("model_warning", [])
            row["model_warning"].append(f"{s}: {r['model_warning']}")
    out = list(rows.values())
    for row in out:
        if "model_warning" in row:
            row["model_warning"] = "; ".join(row["model_warning"])
    by_trace = defaultdict(list)
    for row in out:
        by_trace[row["trace"]].append(row)
    for group in by_trace.values():
        ranked = sorted(group, key=lambda x: (x["update_rel_error"] if is_finite_number(x["update_rel_error"])
                                              else math.inf))
        for i, row in enumerate(ranked, 1):
            row["rank_in_trace"] = i
    return sorted(out, key=lambda x: (x["trace"], x["rank_in_trace"]))


def median_rows(rows: list[dict]) -> list[dict]:
    """Per configuration: median, best and worst update error over the traces that ran it,
    how often it ranked first, and its worst trace. A non-finite error (a diverged update)
    counts as infinitely bad."""
    by_cfg = defaultdict(list)
    for r in rows:
        by_cfg[r["config"]].append(r)
    out = []
    for cfg, group in by_cfg.items():
        errs = [r["update_rel_error"] if is_finite_number(r["update_rel_error"]) else math.inf for r in group]
        worst = max(group, key=lambda r: r["update_rel_error"] if is_finite_number(r["update_rel_error"]) else math.inf)
        out.append({"config": cfg, "traces": len(group), "median_update_rel_error": statistics.median(errs),
                    "min_update_rel_error": min(errs), "max_update_rel_error": max(errs),
                    "median_rank": statistics.median(r["rank_in_trace"] for r in group),
                    "first_in": sum(r["rank_in_trace"] == 1 for r in group), "worst_trace": worst["trace"]})
    return sorted(out, key=lambda r: (r["median_update_rel_error"], r["config"]))


def _err(v) -> str:
    return f"{v:.3g}" if is_finite_number(v) else "diverged" if v == math.inf else "-"


def tables(doc: dict) -> tuple[list[Table], list[str]]:
    """The across-traces tables and a summary line, or nothing for a single trace."""
    rows = per_trace_rows(doc)
    traces = sorted({r["trace"] for r in rows})
    if len(traces) < 2:
        return [], []
    cols = [("trace", "trace"), ("rank_in_trace", "rank"), ("config", "config"), ("bytes_per_param", "B/param", ".4f"),
            ("update_rel_error", "upd err", _err), ("update_cosine", "upd cos", ".4f"),
            ("drift_m", "drift m", "+.2e"), ("drift_v", "drift v", "+.2e"),
            ("stall_m", "stall m", pct), ("stall_v", "stall v", pct)]
    cols += [(key, head, fmt) for _, key, head, fmt in OPTIONAL_V if any(key in r for r in rows)]
    cols.append(("pred_v", "pred v (Gaussian)", pct))
    if any("model_warning" in r for r in rows):
        cols.append(("model_warning", "model warning"))
    med = median_rows(rows)
    per_trace = Table.of(f"Across {len(traces)} traces: each configuration on each trace (ranked by update error)",
                         rows, cols, "upd err: relative error of the parameter update against fp32 states; drift: "
                                     "mean signed error of the stored state over the fp32 shadow's RMS; stall: share "
                                     "of element-steps whose stored value did not move although its update was not 0.")
    medians = Table.of("Median over the traces (the corpus ranking)", med, [
        ("config", "config"), ("traces", "traces"), ("median_update_rel_error", "median upd err", _err),
        ("min_update_rel_error", "best", _err), ("max_update_rel_error", "worst", _err),
        ("median_rank", "median rank", "g"), ("first_in", "first on"), ("worst_trace", "worst on")])
    best = med[0]
    summary = (f"across {len(traces)} traces: lowest median update error {best['config']} "
               f"({_err(best['median_update_rel_error'])}; first on {best['first_in']} of {best['traces']})")
    return [medians, per_trace], [summary]
