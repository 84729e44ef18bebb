#!/usr/bin/env python
"""Shrink a diagnose results file for the repository (how reports/corpus/diagnose.json is
made from a suite run's OUT/diagnose.json).

    python scripts/downsample_diagnose.py results/corpus/diagnose.json reports/corpus/diagnose.json

Keeps `records` and `theory` (everything the Markdown report's tables read), drops the
per-step `series`, the staleness `histograms` and the `per_code`, `per_tensor` and
`dim_scaling` tables, rounds the records' floats to 4 significant digits and says so in
`meta.downsampled`; compact JSON on one line. Idempotent: a file already downsampled comes out unchanged, so a run
resumed from the committed file (`qstate run ... --resume`) can be downsampled whole.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

DROPPED = ("series", "histograms", "per_code", "per_tensor", "dim_scaling")
NOTE = ("per-step series, staleness histograms, per-code, per-tensor and dimension-scaling tables removed, "
        "floats kept to 4 significant digits, for the repository; qstate run suites/corpus.yaml "
        "--set steps_limit=300 rebuilds them")


def round_sig(x, digits: int = 4):
    """x to `digits` significant digits; non-floats and non-finite floats unchanged."""
    if isinstance(x, float) and math.isfinite(x) and x != 0.0:
        return float(f"{x:.{digits - 1}e}")
    if isinstance(x, list):
        return [round_sig(v, digits) for v in x]
    if isinstance(x, dict):
        return {k: round_sig(v, digits) for k, v in x.items()}
    return x


def downsample(doc: dict) -> dict:
    if doc.get("kind") != "diagnose":
        raise SystemExit(f"not a diagnose results file (kind {doc.get('kind')!r})")
    out = {k: v for k, v in doc.items() if k not in DROPPED}
    out["records"] = round_sig(out.get("records") or [])
    out["meta"] = {**(doc.get("meta") or {}), "downsampled": NOTE}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    args = ap.parse_args()
    doc = downsample(json.loads(args.src.read_text()))
    args.dst.write_text(json.dumps(doc, separators=(",", ":")))
    print(f"{args.dst}: {len(doc.get('records', []))} records, {args.dst.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
