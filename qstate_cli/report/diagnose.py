"""The report section of a diagnose document (docs/results.md, kind "diagnose"), named by
its kind's entry in qstate_cli/kinds.py.

It opens with what was replayed (report/labels.py `replay_context`: trace, steps replayed
of the trace's, codec path, the engine's notes). Rows of one configuration made at suite
points that differ in another parameter (`reset: [none, 20]`) are labelled by it
(`bf16 reset=20`): separate lines in the plots, a column in the tables. Points that replay
different traces get one set of step plots per trace (their steps are not one axis).
"""
from __future__ import annotations

import math
from collections import defaultdict

from ..results import is_finite_number
from . import corpus, labels, plots
from .model import Plot, Section, Table
from .sections import _not_measured, _slug


# (file stem, title, caption, series column, y label, panel title, predicted column) of each step plot
STEP_PLOTS = (
    ("diagnose-drift", "Drift over steps",
     "Mean signed error of the stored state over the fp32 shadow's RMS: a bias that builds up is drift; BReD's "
     "error has zero mean.", "drift", "drift (mean error / shadow RMS)", "Drift", None),
    ("diagnose-stall-rate", "Stall rate over steps",
     "Fraction of elements whose nominal update was non-zero but whose stored value did not change (under a block "
     "scale the value moves with the block's absmax even when the element's code is frozen: see the code stall "
     "rate).", "stall_rate", "stall rate (fraction)", "Stalling (stored value)", None),
    ("diagnose-code-stall-rate", "Code stall rate over steps",
     "Fraction of elements whose nominal update was non-zero but whose stored code (or a float state's raw bits) "
     "did not change; dashed: the staleness model's prediction (Gaussian gradients; build-up after initialization "
     "and every reset).", "code_stall_rate", "code stall rate (fraction)", "Stalling (stored code)",
     "stall_rate_predicted"),
)


def _step_plots(sec: Section, series: list[dict], hists: list[dict], states, palette, trace: str | None) -> None:
    """Drift, stall rates and staleness over one trace's steps."""
    name = (lambda stem: _slug(stem, trace)) if trace else (lambda stem: stem)
    on = f" ({trace})" if trace else ""
    for stem, title, caption, column, ylabel, heading, predicted in STEP_PLOTS if series else ():
        sec.plots.append(Plot(name(stem), f"{title}{on}", caption,
                              lambda column=column, ylabel=ylabel, heading=heading, predicted=predicted:
                              plots.per_state_lines(series, column, ylabel, f"{heading}{on}", palette,
                                                    predicted=predicted, states=states)))
    if hists:
        sec.plots.append(Plot(name("diagnose-staleness"), f"Staleness histograms{on}",
                              "Steps since each stored value last changed, at the end of the replay.",
                              lambda: plots.staleness_histograms(hists, palette, states=states)))


def diagnose(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    axes = labels.varying(doc, skip=("config",))  # e.g. reset, trace, steps_limit
    by_trace = "trace" in axes  # one set of step plots per trace; the other axes label lines
    line_axes = [k for k in axes if k != "trace"]
    rows = labels.with_axes(doc["records"], doc, axes)
    series = labels.with_axes(doc.get("series") or [], doc, line_axes)
    hists = labels.with_axes([h for h in doc.get("histograms") or [] if h.get("metric") == "staleness"
                              and plots.drawable_histogram(h)], doc, line_axes)
    sec = Section("Diagnose: drift, stalling, staleness", "diagnose", source, notes=labels.replay_context(doc))
    states = (sorted({r.get("state") for r in rows + series if r.get("state")}, key=lambda s: (s != "m", s))
              or ["m", "v"])
    groups: dict = defaultdict(lambda: ([], []))
    for r in series:
        groups[corpus.trace_of(r, doc) if by_trace else None][0].append(r)
    for h in hists:
        groups[corpus.trace_of(h, doc) if by_trace else None][1].append(h)
    for trace, (s, h) in sorted(groups.items(), key=lambda kv: str(kv[0])):
        _step_plots(sec, s, h, states, palette, trace)
    if any(is_finite_number(r.get("stall_rate_predicted"))
           and is_finite_number(r.get("code_stall_rate", r.get("stall_rate")))
           for r in rows):
        sec.plots.append(Plot("diagnose-predicted-vs-observed", "Predicted vs observed stalling",
                              "Mean code stall rate over the replay against the model's prediction (on the diagonal: "
                              "the model is right).", lambda: plots.predicted_vs_observed(rows, palette)))
    ranked = sorted(rows, key=lambda r: (-(r["update_cosine"] if is_finite_number(r.get("update_cosine"))
                                           else -math.inf),
                                         str(r.get("config")), r["variant"], str(r.get("state"))))
    ax_cols = labels.axis_columns(axes)
    sec.tables.append(Table.of("Summary per configuration and state (best update fidelity first)", ranked, [
        ("config", "config"), *ax_cols, ("state", "state"), ("format", "format"), ("rounding", "rounding"),
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
            ("config", "config"), *ax_cols, ("state", "state"), ("code_stall_rate_late", "observed, last 10%", ".3f"),
            ("stall_rate_predicted_late", "Gaussian", ".3f"),
            ("stall_rate_predicted_empirical_late", "empirical", ".3f"), ("model_warning", "why")]))
    resets = [r for r in rows if r.get("reset_period") is not None or r.get("reset_reason")]
    if resets:
        sec.tables.append(Table.of("Recommended reset periods", resets, [
            ("config", "config"), *ax_cols, ("state", "state"), ("reset_applied", "reset applied"),
            ("reset_period", "reset every (steps)"), ("reset_reason", "why")]))
    if doc.get("theory"):
        sec.tables.append(Table.of("Staleness model", doc["theory"], [
            ("format", "format"), ("rounding", "rounding"), ("beta2", "beta2"), ("fraction_bits", "fraction bits"),
            ("rho", "rho", ".4g"), ("p_stall_steady", "P(stall), steady", ".4f"),
            ("reset_period", "reset period"), ("reported_period", "paper")]))
    _not_measured(sec, rows, [("config", "config"), *ax_cols, ("state", "state"), ("numel", "numel")])
    across, across_summary = corpus.tables(doc)  # one trace: nothing; several: per trace and the median
    sec.tables[:0] = across
    summary = f"diagnose: {len({r.get('config') for r in rows})} configurations"
    if across_summary:
        return sec, [f"{summary}; {across_summary[0]}"]
    if ranked and is_finite_number(ranked[0].get("update_cosine")):
        summary += (f"; best update fidelity {labels.label(ranked[0]['config'], ranked[0])} "
                    f"(cosine {ranked[0]['update_cosine']:.4f})")
    drifts = [r for r in rows if is_finite_number(r.get("drift_max_abs"))]
    if drifts:
        worst = max(drifts, key=lambda r: r["drift_max_abs"])
        summary += (f"; most drift {labels.label(worst['config'], worst)} ({worst.get('state')}: max |drift| "
                    f"{worst['drift_max_abs']:.3g})")
    return sec, [summary]
