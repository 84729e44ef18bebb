"""A replay's parts put back together: how every statistic adds up across torchrun ranks.

A part is what one rank measured (replay.ReplayPart): under the element split its
contiguous range of unit blocks of the layout (layout.py) for every configuration; under
the configuration split the whole layout for its configurations. Parts come in rank
order, which is layout order, so per-unit and per-element arrays concatenate; per-step
series, histograms and counts add. One process is the one-part case of the same code.

    StateStats     err_sum err2_sum stalls nominal shadow2_sum code_stalls   sum (per step)
                   n, staleness_counts, codes (per code x class)              sum
                   units [6, units]                                           concatenate
                   dim_x2 [snapshots, tensors], dim_small [snapshots, d, tensors]  sum
                   dim_units [snapshots, units]                               concatenate
                   -> dim_ms (stats.dimension_ms), once, on the whole
    UpdateStats    sums [4, steps]: sum; units: concatenate -> cosine, rel_error
                   (stats.fidelity), once, on the whole
    ModelStats     empirical, gaussian, nominal [steps]: sum (NaN where the model was not
                   evaluated: the same steps on every rank)
    GradientStats  g2_sum, zeros [steps], n (live), dead, present [steps] (a trace with
                   absent rows): sum; kurtosis (per live element): concatenate (its median
                   is then the single run's)
    nonfinite      per unit: concatenate
    final states   per tensor: concatenate the pieces

Sums of floats add in a different order than one process adds them (float64; about
1e-16 relative per term): records agree to 1e-12 relative or better, counts exactly
(tests/test_diagnose_distributed.py). Maxima (a tensor scale's absmax) are exact.
"""
from __future__ import annotations

import numpy as np

SUMMED = ("err_sum", "err2_sum", "stalls", "nominal", "shadow2_sum", "code_stalls", "n", "staleness_counts",
          "dim_x2", "dim_small")
CONCATENATED = ("units", "dim_units")  # along the last axis: units in layout order


def _sum(parts: list, key: str):
    out = parts[0][key]
    for p in parts[1:]:
        out = out + p[key]
    return out


def _cat(parts: list, key: str) -> np.ndarray:
    return np.concatenate([p[key] for p in parts], axis=-1)


def states(parts: list[dict]) -> dict:
    """StateStats.collect() of every part of one (configuration, state)."""
    out = {k: _sum(parts, k) for k in SUMMED}
    out.update({k: _cat(parts, k) for k in CONCATENATED})
    out["codes"] = None if parts[0]["codes"] is None else _sum(parts, "codes")
    out["code_mode"], out["dims"] = parts[0]["code_mode"], parts[0]["dims"]
    return out


def update(parts: list[dict]) -> dict:
    """UpdateStats.collect() of every part of one configuration."""
    return {"sums": _sum(parts, "sums"), "units": _cat(parts, "units")}


def models(parts: list[dict]) -> dict:
    """ModelStats.collect() of every part of one (configuration, state)."""
    return {k: _sum(parts, k) for k in ("empirical", "gaussian", "nominal")}


def gradients(parts: list[dict]) -> dict:
    """GradientStats.collect() of every part (distinct unit ranges, in layout order)."""
    out = {k: _sum(parts, k) for k in ("g2_sum", "zeros", "n", "dead")}
    out["kurtosis"] = np.concatenate([p["kurtosis"] for p in parts])
    if all("present" in p for p in parts):  # a trace with absent rows (GradientStats)
        out["present"] = _sum(parts, "present")
    return out


def tensors(parts: list[list]) -> list:
    """Per-tensor pieces of every part -> one tensor per tensor (final states)."""
    import torch

    return [torch.cat([p[j] for p in parts]) for j in range(len(parts[0]))]
