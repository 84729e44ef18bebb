"""Display rows for the terminal tables of `qstate bench kernels|memory` (a view of the
records: nothing here is written to the result files).

Kernels: `size` is the model name or the element count; `iqr_pct` = 100 * IQR / median;
`x_fused` = time of torch-fused at the same size and dtype / this row's time (> 1:
faster than torch's fused AdamW at that parameter dtype); `note` carries the status
and reason of rows that did not run, and `noisy` for rows whose IQR exceeds 10%;
`pct_of_copy` reads "cache" for a cache-resident row (bench/roofline.py).
"""
from __future__ import annotations

KERNEL_COLUMNS = ["name", "path", "param_dtype", "size", "time_ms", "iqr_pct", "gbps", "pct_of_copy",
                  "bytes_per_elem", "x_fused", "compile_ms", "note"]
KERNEL_FORMATS = {"time_ms": ".4g", "iqr_pct": ".1f", "gbps": ".3g",
                  "pct_of_copy": lambda v: v if isinstance(v, str) else f"{v:.1f}",
                  "bytes_per_elem": ".4g", "x_fused": ".3g", "compile_ms": ".0f"}
KERNEL_HEADERS = {"param_dtype": "dtype", "time_ms": "ms (median)", "iqr_pct": "IQR %", "gbps": "GB/s",
                  "pct_of_copy": "% copy", "bytes_per_elem": "B/elem", "x_fused": "x fused",
                  "compile_ms": "compile ms"}

MEMORY_COLUMNS = ["name", "path", "model", "params", "bytes_per_param", "reduction_pct", "state_mib",
                  "measured_mib", "peak_extra_mib", "first_step_peak_bytes_per_param", "step_peak_bytes_per_param",
                  "note"]
MEMORY_MEASURED = ("measured_mib", "peak_extra_mib", "first_step_peak_bytes_per_param", "step_peak_bytes_per_param")
MEMORY_FORMATS = {"bytes_per_param": ".4f", "reduction_pct": lambda v: f"{v:.1f}" if abs(v) >= 0.05 else "0.0", "state_mib": ".3f", "measured_mib": ".3f",
                  "peak_extra_mib": ".3f", "params": ",", "first_step_peak_bytes_per_param": ".2f",
                  "step_peak_bytes_per_param": ".2f"}
MEMORY_HEADERS = {"bytes_per_param": "bytes/param", "reduction_pct": "% less than fp32",
                  "state_mib": "state MiB", "measured_mib": "measured MiB", "peak_extra_mib": "peak extra MiB",
                  "first_step_peak_bytes_per_param": "1st step peak B/param",
                  "step_peak_bytes_per_param": "step peak B/param"}


def memory_columns(rows: list[dict]) -> list[str]:
    """MEMORY_COLUMNS less the measured ones that no row has (the CUDA-only ones on a CPU)."""
    return [c for c in MEMORY_COLUMNS if c not in MEMORY_MEASURED or any(r.get(c) is not None for r in rows)]


def memory_source(rows: list[dict]) -> str | None:
    """What the measured peaks are: "cuda-allocator" or "process-rss" (rows' measured_by)."""
    return next((r["measured_by"] for r in rows if r.get("measured_by")), None)


NOTE_CHARS = 160  # the full reason is in the result file (the note column wraps: cli/tables.py)


def _note(row: dict) -> str | None:
    if row.get("status") not in (None, "ok"):
        note = f"{row['status']}: {row.get('reason') or ''}".strip()
        return note if len(note) <= NOTE_CHARS else note[:NOTE_CHARS - 1] + "…"
    return "noisy" if row.get("noisy") else None


def kernel_display_rows(rows: list[dict]) -> list[dict]:
    fused = {(r["numel"], r["model"], r["param_dtype"]): r["time_ms"] for r in rows
             if r["name"] == "torch-fused" and r.get("time_ms")}
    out = []
    for r in rows:
        t = r.get("time_ms")
        ref = fused.get((r["numel"], r["model"], r["param_dtype"]))
        out.append({**r, "size": r["model"] or f"{r['numel']:,}",
                    "iqr_pct": 100 * r["time_ms_iqr"] / t if t else None,
                    "x_fused": ref / t if (t and ref and r["role"] != "copy") else None,
                    "pct_of_copy": "cache" if r.get("cache_resident") else r.get("pct_of_copy"),
                    "note": _note(r)})
    return out


def memory_display_rows(rows: list[dict]) -> list[dict]:
    mib = 2**20
    return [{**r, "model": r["model"] or "tensor",
             "reduction_pct": 100 * r["reduction_vs_fp32"] if r.get("reduction_vs_fp32") is not None else None,
             "state_mib": r["state_bytes"] / mib if r.get("state_bytes") is not None else None,
             "measured_mib": r["measured_state_bytes"] / mib if r.get("measured_state_bytes") is not None else None,
             "note": _note(r)} for r in rows]
