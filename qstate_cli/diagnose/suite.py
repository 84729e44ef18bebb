"""The YAML-suite hook: one diagnose point from a dict of parameters.

    diagnose_point({"trace": "trace.pt", "config": ["bred-4bit", "bf16"], "reset": "auto"})
      -> {"records": [...], "series": [...], "histograms": [...], "per_code": [...],
          "per_tensor": [...], "dim_scaling": [...], "theory": [...], "meta": {...}}

Keys mirror the `qstate diagnose` options with underscores: trace (required; "demo" is
the cached demo trace), config (a name or a list), bits (int or list), rounding (str or
list), block_size, reset (none | N | auto), steps_limit, device, profile (accepted; the
profile is always in meta), and theory / format / beta2 (theory alone: no trace, the
`theory` rows). Unknown keys raise QstateError naming the closest valid ones.
"""
from __future__ import annotations

from ..errors import QstateError
from ..quant.formats import suggest
from .run import diagnose, select_configs, theory_document

KEYS = ("trace", "config", "bits", "rounding", "block_size", "reset", "steps_limit", "device", "profile",
        "theory", "format", "beta2")


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def diagnose_point(params: dict) -> dict:
    unknown = [k for k in params if k not in KEYS]
    if unknown:
        raise QstateError(f"unknown diagnose parameter {unknown[0]!r}{suggest(unknown[0], KEYS)}")
    if params.get("theory"):
        doc = theory_document([str(f) for f in _as_list(params.get("format"))] or None,
                              float(params.get("beta2", 0.999)))
        return {k: v for k, v in doc.items() if k not in ("schema_version", "kind", "env")}
    if not params.get("trace"):
        raise QstateError("a diagnose point needs 'trace' (a trace file or directory)")
    bits = [int(b) for b in _as_list(params.get("bits"))]
    configs = select_configs([str(c) for c in _as_list(params.get("config"))], bits,
                             [str(r) for r in _as_list(params.get("rounding"))], params.get("block_size"))
    reset = params.get("reset", "none")
    trace = params["trace"]
    if str(trace) == "demo":  # in a suite, always the built-in demo trace (docs/results.md)
        from ..trace.demo import cached_demo

        trace = cached_demo()
    doc, _ = diagnose(trace, configs, reset="none" if reset is None else reset,
                      steps_limit=params.get("steps_limit"), device=params.get("device") or "auto")
    out = {k: v for k, v in doc.items() if k not in ("schema_version", "kind", "env")}
    return out
