"""Does the trace fit the Gaussian staleness model? Checks and the warning they back.

The model (theory.py, staleness.py) assumes each element's gradient is N(0, sigma^2) with
sigma^2 constant over the run. On the trace (GradientStats, stats.py):

    kurtosis   median over elements of T sum g^4 / (sum g^2)^2   Gaussian: 3; flagged > 4
    trend      mean g^2 over the last 10% of steps / over the first 10%
                                                                  constant: 1; flagged
                                                                  outside [1/2, 2]
    zeros      share of element-steps whose gradient is exactly 0 flagged above 1%
               (among live elements: those zero at every step, dead, never stall and
               are counted apart)

Heavy tails put more of g^2 far below its mean (a small g^2 against v stalls), a falling
E[g^2] leaves v above the g^2 it now sees, and zero gradients decay v by beta2 alone: all
three make a state stall more than the Gaussian model predicts. Where the Gaussian
prediction misses the observed late stall rate by more than `TOLERANCE` (5 points), the
record's `model_warning` says by how much and which checks failed (or that none did).
"""
from __future__ import annotations

import math

import numpy as np

TOLERANCE = 0.05
KURTOSIS_MAX = 4.0
TREND_RANGE = (0.5, 2.0)
ZEROS_MAX = 0.01


def gradient_checks(grad: dict, n_steps: int) -> dict:
    """kurtosis, trend of E[g^2] and zero share of the replayed gradients, and which failed."""
    k = max(1, math.ceil(0.1 * n_steps))
    g2 = np.asarray(grad["g2_sum"][:n_steps], dtype=float)
    first, last = g2[:k].mean(), g2[-k:].mean()
    kurt = np.asarray(grad["kurtosis"], dtype=float)
    out = {"grad_kurtosis": float(np.median(kurt)) if kurt.size else None,
           "grad_g2_trend": float(last / first) if first > 0 else None,
           "grad_zero_share": float(np.sum(grad["zeros"][:n_steps]) / max(1, grad["n"] * n_steps)),
           "grad_dead_elements": int(grad.get("dead", 0))}
    failed = []
    if out["grad_kurtosis"] is not None and out["grad_kurtosis"] > KURTOSIS_MAX:
        failed.append(f"gradient kurtosis {out['grad_kurtosis']:.1f} (Gaussian: 3)")
    trend = out["grad_g2_trend"]
    if trend is not None and not TREND_RANGE[0] <= trend <= TREND_RANGE[1]:
        how = f"fell {1 / trend:.1f}x" if trend < 1 else f"rose {trend:.1f}x"
        failed.append(f"mean g^2 {how} from the first to the last 10% of steps (the model assumes it constant)")
    if out["grad_zero_share"] > ZEROS_MAX:
        failed.append(f"{out['grad_zero_share']:.1%} of gradient elements are exactly 0 (a Gaussian has none)")
    out["failed"] = failed
    return out


def model_warning(predicted_late: float | None, observed_late: float | None, empirical_late: float | None,
                  checks: dict) -> str | None:
    """A warning when the Gaussian prediction misses the observed late stall rate by more
    than TOLERANCE; None otherwise (or when either is unknown)."""
    if predicted_late is None or observed_late is None:
        return None
    miss = observed_late - predicted_late
    if abs(miss) <= TOLERANCE:
        return None
    why = "; ".join(checks["failed"]) if checks["failed"] else (
        f"no assumption check failed (kurtosis {checks['grad_kurtosis']:.1f}, mean g^2 x"
        f"{checks['grad_g2_trend']:.2f}, {checks['grad_zero_share']:.1%} zeros): the model's other "
        f"approximations (the element's position on the grid, a steady level) are off")
    emp = "" if empirical_late is None else f"; the empirical model (the trace's own g^2) predicts {empirical_late:.1%}"
    return (f"the Gaussian model predicts {predicted_late:.1%} stalls over the last 10% of steps, observed "
            f"{observed_late:.1%} ({100 * miss:+.1f} points): {why}{emp}")
