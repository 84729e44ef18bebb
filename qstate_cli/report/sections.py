"""One report section per results document, by kind (docs/results.md), plus summary lines.
Each function here is named by its kind's entry in qstate_cli/kinds.py."""
from __future__ import annotations

import math
from collections import defaultdict

from ..bench.roofline import classify
from ..results import is_finite_number
from . import corpus, plots
from .model import Plot, Section, Table, cell, pct

OUR_PATHS = ("triton", "triton-interpreter", "cpu-numba", "reference")


def _ok(r: dict) -> bool:
    return r.get("status", "ok") == "ok"



def is_baseline(row: dict) -> bool:
    return row.get("path") not in OUR_PATHS


def _slug(*parts) -> str:
    text = "-".join(str(p) for p in parts if p is not None)
    return "".join(ch if ch.isalnum() else "-" for ch in text.lower()).strip("-") or "plot"


# -- kernels ---------------------------------------------------------------------------

def with_roofline(row: dict) -> dict:
    """The row with `cache_resident` and `pct_of_copy` as bench/roofline.py defines them
    (results written before that field are classified here), and `roofline`: the text of
    the roofline cell ("cache-resident" or the percentage)."""
    out = dict(row)
    if out.get("role") != "copy" and "cache_resident" not in out:
        out.update(classify(out))
    pct = out.get("pct_of_copy")
    out["roofline"] = ("cache-resident" if out.get("cache_resident")
                       else f"{pct:.1f}" if is_finite_number(pct) else None)
    return out


def kernels(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    rows = [with_roofline(r) for r in doc["records"]]
    sec = Section("Kernels: time and roofline", "kernels", source)
    sweep = [r for r in rows if _ok(r) and r.get("model") in (None, "")]
    groups = defaultdict(list)
    for r in sweep:
        if r.get("role") == "copy":  # the reference every % of copy is measured against: the 100% line
            continue
        groups[(r.get("optimizer"), r.get("param_dtype"), r.get("grad_dtype"), r.get("device"),
                r.get("device_name"))].append(r)
    for (opt, pdt, gdt, dev, dev_name), group in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        title = f"{opt}: {pdt} params, {gdt} grads on {dev} ({dev_name})"
        sec.plots.append(Plot(_slug("kernels", opt, pdt, dev), title,
                              "Median time per optimizer step (left, log-log) and bytes moved per second as % of "
                              "the copy bandwidth measured in the same run (right). Dashed: baselines. A size "
                              "measured more than once (suite points, rounds) is drawn at the median of its rows. "
                              "Crosses in the top band: cache-resident rows (faster than the memory copy, or their "
                              "own bytes copy at cache speed), which a memory roofline does not describe.",
                              lambda g=group, t=title: plots.size_sweep(g, t, palette, is_baseline)))
    cols = [("name", "name"), ("path", "path"), ("numel", "numel"), ("param_dtype", "dtype"),
            ("time_ms", "time (ms)", ".4g"), ("time_ms_iqr", "IQR (ms)", ".3g"), ("time_ms_min", "min (ms)", ".4g"),
            ("gbps", "GB/s", ".1f"), ("roofline", "% of copy"), ("time_rel_copy", "x copy of own bytes", ".3g"),
            ("noisy", "noisy"), ("compile_ms", "compile (ms)", ".0f")]
    sec.tables.append(Table.of("Size sweep", sorted(sweep, key=lambda r: (str(r.get("name")), r.get("numel") or 0)),
                               cols, "noisy: IQR above 10% of the median. cache-resident: the row ran faster than "
                               "the memory copy or its own bytes copy at cache speed (no roofline percentage); "
                               "x copy of own bytes: time over a same-run copy of the row's bytes_moved."))
    models = [r for r in rows if _ok(r) and r.get("model") not in (None, "")]
    if models:
        sec.tables.append(Table.of("Whole-model steps", models, [("name", "name"), ("model", "model"),
                                   ("n_tensors", "tensors"), ("numel", "numel"), ("path", "path"),
                                   ("time_ms", "time (ms)", ".4g"), ("gbps", "GB/s", ".1f"),
                                   ("roofline", "% of copy"), ("time_rel_copy", "x copy of own bytes", ".3g")]))
    _not_measured(sec, rows, [("name", "name"), ("config", "config"), ("numel", "numel"), ("path", "path")])
    return sec, [_kernels_summary(rows, sweep)]


def _not_measured(sec: Section, rows: list[dict], cols: list[tuple]) -> None:
    """A table of the rows that did not run (failed, unavailable) with their reason."""
    bad = [r for r in rows if not _ok(r)]
    if bad:
        sec.tables.append(Table.of("Not measured", bad, cols + [("status", "status"), ("reason", "reason")]))


def _kernels_summary(rows, sweep) -> str:
    counts = _status_counts(rows)
    line = f"kernels: {counts}"
    ours = [r for r in sweep if not is_baseline(r) and is_finite_number(r.get("time_ms"))
            and is_finite_number(r.get("numel")) and r["time_ms"] > 0]
    if not ours:
        return line
    top = max(r["numel"] for r in ours)
    best = min((r for r in ours if r["numel"] == top), key=lambda r: r["time_ms"])
    if best.get("cache_resident"):
        rel = best.get("time_rel_copy")
        where = "cache-resident" + (f", {rel:.3g}x a copy of its own bytes" if is_finite_number(rel) else "")
    else:
        where = f"{cell(best.get('pct_of_copy'), '.1f')}% of copy bandwidth"
    line += (f"; at numel {top:,.0f} the fastest of ours is {best['name']} ({best['path']}): "
             f"{cell(best['time_ms'], '.4g')} ms, {where}")
    fused = [r for r in sweep if r.get("path") == "torch-fused" and r.get("numel") == top
             and is_finite_number(r.get("time_ms"))
             and r.get("param_dtype") == best.get("param_dtype")]
    if fused:
        line += ", " + _speed_vs("torch fused AdamW", fused[0]["time_ms"] / best["time_ms"])
    return line


def _speed_vs(other: str, ratio: float) -> str:
    """ratio = other's time / ours: '1.35x the speed of X', or 'X is 38.7x faster' below 1
    (a ratio printed as 0.00x said nothing)."""
    if ratio >= 1:
        return f"{ratio:.2f}x the speed of {other}"
    return f"{other} is {1 / ratio:.3g}x faster"


def _status_counts(rows) -> str:
    counts = defaultdict(int)
    for r in rows:
        counts[str(r.get("status", "ok"))] += 1
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no rows"


# -- memory ----------------------------------------------------------------------------

def memory(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    rows = doc["records"]
    sec = Section("Memory: optimizer-state bytes", "memory", source)
    ok = [r for r in rows if _ok(r) and is_finite_number(r.get("bytes_per_param"))]
    if ok:
        ok_sorted = sorted(ok, key=lambda r: r["bytes_per_param"], reverse=True)
        models = sorted({str(r.get("model")) for r in ok})
        sec.plots.append(Plot(_slug("memory", *models), "Optimizer-state bytes per parameter",
                              "Exact accounting of the stored states (codes and block scales).",
                              lambda: plots.bars([f"{r.get('name')} ({r.get('model')})" if len(models) > 1 else str(r.get("name"))
                                                  for r in ok_sorted], [r["bytes_per_param"] for r in ok_sorted],
                                                 "optimizer-state bytes per parameter", "State memory", palette)))
    sec.tables.append(Table.of("State memory", rows, [
        ("name", "name"), ("config", "config"), ("model", "model"), ("params", "params"),
        ("state_bytes", "state bytes"), ("bytes_per_param", "bytes/param", ".4f"),
        ("reduction_vs_fp32", "less than fp32", pct), ("measured_state_bytes", "measured bytes"),
        ("peak_extra_mib", "peak extra (MiB)", ".1f"), ("status", "status"), ("reason", "reason")]))
    summary = "memory: no rows measured"
    if ok:
        best = min(ok, key=lambda r: r["bytes_per_param"])
        summary = (f"memory: smallest state is {best['name']} at {best['bytes_per_param']:.5g} bytes/param"
                   + (f" ({pct(best['reduction_vs_fp32'])} less than fp32 states)"
                      if is_finite_number(best.get("reduction_vs_fp32")) else ""))
    return sec, [summary]


# -- diagnose --------------------------------------------------------------------------

def diagnose(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    rows = doc["records"]
    series, hists = doc.get("series") or [], [h for h in doc.get("histograms") or [] if h.get("metric") == "staleness"
                                              and plots.drawable_histogram(h)]
    sec = Section("Diagnose: drift, stalling, staleness", "diagnose", source)
    states = sorted({r.get("state") for r in rows + series if r.get("state")}, key=lambda s: (s != "m", s)) or ["m", "v"]
    if series:
        sec.plots.append(Plot("diagnose-drift", "Drift over steps",
                              "Mean signed error of the stored state over the fp32 shadow's RMS: a bias that builds up "
                              "is drift; BReD's error has zero mean.",
                              lambda: plots.per_state_lines(series, "drift", "drift (mean error / shadow RMS)",
                                                            "Drift", palette, states=states)))
        sec.plots.append(Plot("diagnose-stall-rate", "Stall rate over steps",
                              "Fraction of elements whose nominal update was non-zero but whose stored value did not "
                              "change (under a block scale the value moves with the block's absmax even when the "
                              "element's code is frozen: see the code stall rate).",
                              lambda: plots.per_state_lines(series, "stall_rate", "stall rate (fraction)",
                                                            "Stalling (stored value)", palette, states=states)))
        sec.plots.append(Plot("diagnose-code-stall-rate", "Code stall rate over steps",
                              "Fraction of elements whose nominal update was non-zero but whose stored code (or a "
                              "float state's raw bits) did not change; dashed: the staleness model's prediction "
                              "(Gaussian gradients; build-up after initialization and every reset).",
                              lambda: plots.per_state_lines(series, "code_stall_rate", "code stall rate (fraction)",
                                                            "Stalling (stored code)", palette,
                                                            predicted="stall_rate_predicted", states=states)))
    if hists:
        sec.plots.append(Plot("diagnose-staleness", "Staleness histograms",
                              "Steps since each stored value last changed, at the end of the replay.",
                              lambda: plots.staleness_histograms(hists, palette, states=states)))
    if any(is_finite_number(r.get("stall_rate_predicted"))
           and is_finite_number(r.get("code_stall_rate", r.get("stall_rate")))
           for r in rows):
        sec.plots.append(Plot("diagnose-predicted-vs-observed", "Predicted vs observed stalling",
                              "Mean code stall rate over the replay against the model's prediction (on the diagonal: "
                              "the model is right).", lambda: plots.predicted_vs_observed(rows, palette)))
    ranked = sorted(rows, key=lambda r: (-(r["update_cosine"] if is_finite_number(r.get("update_cosine"))
                                           else -math.inf),
                                         str(r.get("config")), str(r.get("state"))))
    sec.tables.append(Table.of("Summary per configuration and state (best update fidelity first)", ranked, [
        ("config", "config"), ("state", "state"), ("format", "format"), ("rounding", "rounding"),
        ("drift_final", "drift (final)", ".3g"), ("drift_max_abs", "max |drift|", ".3g"),
        ("rel_rms_error", "rel. RMS error", ".3g"), ("dim_slope", "d slope", ".2f"),
        ("stall_rate", "stall rate", ".3f"), ("code_stall_rate", "code stall rate", ".3f"),
        ("code_stall_rate_late", "code stall, last 10%", ".3f"), ("stall_rate_predicted", "predicted", ".3f"),
        ("stall_rate_predicted_empirical_late", "empirical, last 10%", ".3f"),
        ("staleness_p50", "staleness p50"), ("staleness_p90", "p90"),
        ("update_cosine", "update cosine", ".4f"), ("update_rel_error", "update rel. error", ".3g"),
        ("nonfinite_grads", "non-finite grads")],
        "d slope: log-log slope of the aggregate error against dimension (1: bias adds up, 0.5: noise)."))
    warned = [r for r in rows if r.get("model_warning")]
    if warned:
        sec.tables.append(Table.of("Where the Gaussian staleness model misses", warned, [
            ("config", "config"), ("state", "state"), ("code_stall_rate_late", "observed, last 10%", ".3f"),
            ("stall_rate_predicted_late", "Gaussian", ".3f"),
            ("stall_rate_predicted_empirical_late", "empirical", ".3f"), ("model_warning", "why")]))
    resets = [r for r in rows if r.get("reset_period") is not None or r.get("reset_reason")]
    if resets:
        sec.tables.append(Table.of("Recommended reset periods", resets, [
            ("config", "config"), ("state", "state"), ("reset_period", "reset every (steps)"),
            ("reset_reason", "why")]))
    if doc.get("theory"):
        sec.tables.append(Table.of("Staleness model", doc["theory"], [
            ("format", "format"), ("rounding", "rounding"), ("beta2", "beta2"), ("fraction_bits", "fraction bits"),
            ("rho", "rho", ".4g"), ("p_stall_steady", "P(stall), steady", ".4f"),
            ("reset_period", "reset period"), ("reported_period", "paper")]))
    _not_measured(sec, rows, [("config", "config"), ("state", "state"), ("numel", "numel")])
    across, across_summary = corpus.tables(doc)  # one trace: nothing; several: per trace and the median
    sec.tables[:0] = across
    summary = f"diagnose: {len({r.get('config') for r in rows})} configurations"
    if across_summary:
        return sec, [f"{summary}; {across_summary[0]}"]
    if ranked and is_finite_number(ranked[0].get("update_cosine")):
        summary += f"; best update fidelity {ranked[0]['config']} (cosine {ranked[0]['update_cosine']:.4f})"
    drifts = [r for r in rows if is_finite_number(r.get("drift_max_abs"))]
    if drifts:
        worst = max(drifts, key=lambda r: r["drift_max_abs"])
        summary += f"; most drift {worst['config']} ({worst.get('state')}: max |drift| {worst['drift_max_abs']:.3g})"
    return sec, [summary]


# -- train -----------------------------------------------------------------------------

def train(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    rows, series = doc["records"], doc.get("series") or []
    sec = Section("Training: loss per configuration", "train", source)
    if series:
        sec.plots.append(Plot("train-loss", "Loss curves", "Same model, initialization and data order for every "
                              "configuration; one line per seed.", lambda: plots.loss_curves(series, palette)))
    sec.tables.append(Table.of("Runs", sorted(rows, key=lambda r: (str(r.get("config")), str(r.get("seed")))), [
        ("config", "config"), ("seed", "seed"), ("steps", "steps"), ("final_val_loss", "final val loss", ".4f"),
        ("best_val_loss", "best val loss", ".4f"), ("gap_to_fp32", "gap to fp32", "+.4f"),
        ("diverged", "diverged"), ("diverged_at_step", "at step"), ("steps_per_s", "steps/s", ".1f"),
        ("bytes_per_param", "state bytes/param", ".4f"), ("reset", "reset"), ("status", "status")]))
    _not_measured(sec, rows, [("config", "config"), ("seed", "seed")])
    gaps = defaultdict(list)
    for r in rows:
        if is_finite_number(r.get("gap_to_fp32")) and not r.get("diverged"):
            gaps[str(r.get("config"))].append(r["gap_to_fp32"])
    diverged = sorted({str(r.get("config")) for r in rows if r.get("diverged")})
    parts = [f"train: {len({r.get('config') for r in rows})} configurations"]
    others = {c: sum(v) / len(v) for c, v in gaps.items() if c != "fp32"}
    if others:
        best = min(others, key=lambda c: abs(others[c]))
        parts.append(f"closest to fp32: {best} (mean gap {others[best]:+.4f})")
    if diverged:
        parts.append(f"diverged: {', '.join(diverged)}")
    return sec, ["; ".join(parts)]


# -- doctor ----------------------------------------------------------------------------

SEVERITY_ORDER = ("error", "warn", "info")


def doctor(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    rows, meta = doc["records"], doc.get("meta") or {}
    findings = sorted(doc.get("findings") or [], key=lambda f: (SEVERITY_ORDER.index(f.get("severity", "info"))
                                                                if f.get("severity") in SEVERITY_ORDER else 9))
    sec = Section("Doctor: optimizer-state checkpoint", "doctor", source)
    sec.notes.append(f"checkpoint: {meta.get('checkpoint')}"
                     + (f"; compared against {meta['against']}" if meta.get("against") else ""))
    if findings:
        sec.tables.append(Table.of("Findings (error: would change training after a resume)", findings,
                                   [("severity", "severity"), ("optimizer", "optimizer"), ("group", "group"),
                                    ("param", "param"), ("check", "check"), ("message", "finding")]))
    sec.tables.append(Table.of("Parameters", rows, [
        ("optimizer", "optimizer"), ("param", "param"), ("shape", "shape"), ("states", "states"),
        ("state_bytes", "bytes", ","), ("bytes_per_param", "bytes/param", ".4g"), ("step", "step", "g"),
        ("nonfinite", "non-finite", ","), ("v_flushed", "v flushed", ","), ("v_subnormal", "v subnormal", ","),
        ("against_differing", "differ", ","), ("against_max_abs_diff", "max |diff|", ".3g"),
        ("errors", "errors"), ("warnings", "warnings")]))
    s = meta.get("summary") if isinstance(meta.get("summary"), dict) else {}
    line = (f"doctor: {meta.get('checkpoint')}: {s.get('params', len(rows))} parameters, "
            f"{s.get('errors', 0)} errors, {s.get('warnings', 0)} warnings")
    first = next((f for f in findings if f.get("severity") == "error"), None)
    if first:
        line += f"; first: {first.get('param')}: {first.get('message')}"
    return sec, [line]


# -- compare ---------------------------------------------------------------------------

STATUS_ORDER = ("regressed", "failed", "unjudged", "missing", "new", "noisy", "insignificant", "improved",
                "same")


def compare(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    rows = sorted(doc["records"], key=lambda r: (STATUS_ORDER.index(r["status"]) if r.get("status") in STATUS_ORDER
                                                 else 99, str(r.get("name")), str(r.get("metric"))))
    sec = Section("Compare: verdicts", "compare", source)
    meta = doc.get("meta") or {}
    if meta.get("baseline") or meta.get("new"):
        sec.notes.append(f"baseline: {meta.get('baseline')}; new: {meta.get('new')}")
    sec.tables.append(verdict_table(rows))
    return sec, [f"compare: {verdict_counts(rows)}"]


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
                                       ("ratio", "ratio", ".3f"), ("raw_ratio", "raw ratio", ".3f"),
                                       ("noise_floor", "noise floor", ".3f"), ("p_value", "p", ".2g"),
                                       ("threshold", "threshold"), ("why", "why")])


def verdict_counts(rows: list[dict]) -> str:
    counts = defaultdict(int)
    for r in rows:
        counts[r.get("status")] += 1
    return ", ".join(f"{counts[s]} {s}" for s in STATUS_ORDER if counts[s]) or "nothing compared"
