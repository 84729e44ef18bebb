"""One report section per results document, by kind (docs/results.md), plus summary lines.
Each function here is named by its kind's entry in qstate_cli/kinds.py."""
from __future__ import annotations

from collections import defaultdict

from ..bench.roofline import classify
from ..results import is_finite_number
from . import labels, plots
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


KERNELS_SHOWN = ("config", "baseline", "numel", "dtype", "device", "optimizer")  # in names, figures, x axis


def kernels(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    axes = labels.varying(doc, skip=KERNELS_SHOWN)  # e.g. threads, rounds, copy_numel, backend
    rows = labels.with_axes([with_roofline(r) for r in doc["records"]], doc, axes)
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
                              "the copy bandwidth measured in the same run (right). Dashed: baselines. One line "
                              "per configuration, path and varying suite parameter (one colour per configuration); "
                              "a size measured more than once on one line is drawn at the median of its rows. "
                              "Crosses in the top band: cache-resident rows (faster than the memory copy, or their "
                              "own bytes copy at cache speed), which a memory roofline does not describe.",
                              lambda g=group, t=title: plots.size_sweep(g, t, palette, is_baseline)))
    cols = [("name", "name"), ("path", "path"), *labels.axis_columns(axes), ("numel", "numel"),
            ("param_dtype", "dtype"),
            ("time_ms", "time (ms)", ".4g"), ("time_ms_iqr", "IQR (ms)", ".3g"), ("time_ms_min", "min (ms)", ".4g"),
            ("gbps", "GB/s", ".1f"), ("roofline", "% of copy"), ("time_rel_copy", "x copy of own bytes", ".3g"),
            ("noisy", "noisy"), ("compile_ms", "compile (ms)", ".0f")]
    sec.tables.append(Table.of("Size sweep", sorted(sweep, key=lambda r: (str(r.get("name")), str(r.get("path")),
                                                                          r["variant"], r.get("numel") or 0)),
                               cols, "noisy: IQR above 10% of the median. cache-resident: the row ran faster than "
                               "the memory copy or its own bytes copy at cache speed (no roofline percentage); "
                               "x copy of own bytes: time over a same-run copy of the row's bytes_moved."))
    models = [r for r in rows if _ok(r) and r.get("model") not in (None, "")]
    if models:
        sec.tables.append(Table.of("Whole-model steps", models, [("name", "name"), ("model", "model"),
                                   ("n_tensors", "tensors"), ("numel", "numel"), ("path", "path"),
                                   *labels.axis_columns(axes),
                                   ("time_ms", "time (ms)", ".4g"), ("gbps", "GB/s", ".1f"),
                                   ("roofline", "% of copy"), ("time_rel_copy", "x copy of own bytes", ".3g")]))
    _not_measured(sec, rows, [("name", "name"), ("config", "config"), ("numel", "numel"), ("path", "path"),
                              *labels.axis_columns(axes)])
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
    line += (f"; at numel {top:,.0f} the fastest of ours is {best.get('name')} ({best.get('path')}): "
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
    axes = labels.varying(doc, skip=("config", "baseline"))
    rows = labels.with_axes(doc["records"], doc, axes)
    sec = Section("Memory: optimizer-state bytes", "memory", source)
    ok = [r for r in rows if _ok(r) and is_finite_number(r.get("bytes_per_param"))]
    if ok:
        ok_sorted = sorted(ok, key=lambda r: r["bytes_per_param"], reverse=True)
        models = sorted({str(r.get("model")) for r in ok})
        sec.plots.append(Plot(_slug("memory", *models), "Optimizer-state bytes per parameter",
                              "Exact accounting of the stored states (codes and block scales).",
                              lambda: plots.bars([labels.label(f"{r.get('name')} ({r.get('model')})" if len(models) > 1
                                                               else r.get("name"), r) for r in ok_sorted],
                                                 [r["bytes_per_param"] for r in ok_sorted],
                                                 "optimizer-state bytes per parameter", "State memory", palette,
                                                 colors=[str(r.get("name")) for r in ok_sorted])))
    sec.tables.append(Table.of("State memory", rows, [
        ("name", "name"), ("config", "config"), *labels.axis_columns(axes), ("model", "model"), ("params", "params"),
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


# -- train -----------------------------------------------------------------------------

def train(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    axes = labels.varying(doc, skip=("config", "seeds"))  # e.g. batch_size, lr
    rows = labels.with_axes(doc["records"], doc, axes)
    series = labels.with_axes(doc.get("series") or [], doc, axes)
    sec = Section("Training: loss per configuration", "train", source)
    if series:
        sec.plots.append(Plot("train-loss", "Loss curves", "Same model, initialization and data order for every "
                              "configuration; one line per seed.", lambda: plots.loss_curves(series, palette)))
    shown = [{**r, "diverged": r.get("diverged") if _ok(r) else r.get("status")} for r in rows]  # never "no"
    ax_cols = labels.axis_columns(axes)
    sec.tables.append(Table.of("Runs", sorted(shown, key=lambda r: (str(r.get("config")), r["variant"],
                                                                    str(r.get("seed")))), [
        ("config", "config"), *ax_cols, ("seed", "seed"), ("steps", "steps"),
        ("final_val_loss", "final val loss", ".4f"), ("best_val_loss", "best val loss", ".4f"),
        ("gap_to_fp32", "gap to fp32", "+.4f"), ("diverged", "diverged"), ("diverged_at_step", "at step"),
        ("steps_per_s", "steps/s", ".1f"), ("bytes_per_param", "state bytes/param", ".4f"), ("reset", "reset"),
        ("status", "status")], "diverged: failed where the run raised (its reason is under Not measured)."
                               if any(not _ok(r) for r in rows) else ""))
    _not_measured(sec, rows, [("config", "config"), *ax_cols, ("seed", "seed")])
    gaps = defaultdict(list)
    for r in rows:
        if is_finite_number(r.get("gap_to_fp32")) and not r.get("diverged") and r.get("config") != "fp32":
            gaps[labels.label(r.get("config"), r)].append(r["gap_to_fp32"])
    diverged = sorted({labels.label(r.get("config"), r) for r in rows if r.get("diverged") is True})
    parts = [f"train: {len({r.get('config') for r in rows})} configurations"]
    others = {c: sum(v) / len(v) for c, v in gaps.items()}
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
