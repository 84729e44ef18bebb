"""Which rows a copy roofline describes, and which sit in cache (issue 14).

The `copy` row times a large copy (2^26 fp32 values on CPU: 512 MB moved), so its
bandwidth `copy_gbps` is the device memory's. A step whose working set fits in cache is
not bound by that: on a 2-core EPYC (32 MiB L3) a copy of 2 MB moves ~50 GB/s against
~25 GB/s for 512 MB, and torch's fused AdamW at 262,144 elements showed "194% of copy".
A percentage of the memory roofline means nothing there. Each row of a kernels group is
therefore timed beside a copy of its own `bytes_moved` (group.py, `ref_copy_ms`), which
gives the copy bandwidth at the row's own footprint:

    footprint_copy_gbps = bytes_moved / ref_copy_ms                       (GB/s)

and a row is `cache_resident` when either
    gbps > copy_gbps                                   (faster than memory allows), or
    footprint_copy_gbps > CACHE_MARGIN * copy_gbps      (its bytes copy at cache speed).
A cache-resident row gets no `pct_of_copy` (null); its honest measure is
`time_rel_copy` = time_ms / ref_copy_ms, the step's cost in copies of its own bytes.
Elsewhere `pct_of_copy = 100 * gbps / copy_gbps` as before.

CACHE_MARGIN = 1.25 keeps two medians of the same rounds that differ by noise alone
(a footprint near the large copy's) from calling a memory-bound row cache-resident;
cache speeds measured here are 1.6-10x the memory copy (docs/cpu.md).
"""
from __future__ import annotations

import math

CACHE_MARGIN = 1.25


def _num(x) -> float | None:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
    return float(x) if ok else None


def footprint_copy_gbps(bytes_moved, ref_copy_ms) -> float | None:
    """GB/s of a copy of `bytes_moved` bytes (read + written) that took `ref_copy_ms`."""
    b, t = _num(bytes_moved), _num(ref_copy_ms)
    return None if b is None or t is None else b / (t * 1e-3) / 1e9


def cache_resident(gbps, copy_gbps, footprint_gbps) -> bool | None:
    """Whether a row sits in cache (module docstring); None when the copy peak is unknown."""
    g, peak, fp = _num(gbps), _num(copy_gbps), _num(footprint_gbps)
    if g is None or peak is None:
        return None
    return g > peak or (fp is not None and fp > CACHE_MARGIN * peak)


def classify(row: dict) -> dict:
    """footprint_copy_gbps, cache_resident and pct_of_copy of a timed kernels row (a row
    without `ref_copy_ms`, as older results have, is judged on its own gbps only)."""
    fp = footprint_copy_gbps(row.get("bytes_moved"), row.get("ref_copy_ms"))
    resident = cache_resident(row.get("gbps"), row.get("copy_gbps"), fp)
    g, peak = _num(row.get("gbps")), _num(row.get("copy_gbps"))
    pct = None if resident or g is None or peak is None else 100.0 * g / peak
    return {"footprint_copy_gbps": fp, "cache_resident": resident, "pct_of_copy": pct}


def mark(row: dict) -> None:
    """Set classify(row)'s fields on `row` (the copy row itself is the peak: left as is)."""
    if row.get("role") != "copy":
        row.update(classify(row))
