"""Does the trace fit the Gaussian staleness model? Checks and the warning they back.

The model (theory.py, staleness.py) assumes each element's gradient is N(0, sigma^2) with
sigma^2 constant over the run. On the trace (GradientStats, stats.py):

    kurtosis   median over elements of T sum g^4 / (sum g^2)^2, divided by the trend's
               own share, mean(S^2) / mean(S)^2 over steps (S: each step's sum of
               g^2, smoothed over max(1, T/50) steps): a Gaussian whose variance
               changes over the run has a pooled kurtosis of 3 mean(S^2)/mean(S)^2
               (4.2 for a 10x geometric fall), which is the trend's doing, not a tail
                                                                  Gaussian: 3; flagged > 4
               (heavy tails) and < 2, the pooled one too (light tails, or a mean far
               from 0: the ratio is not centred, so a constant gradient gives 1; the
               trend's share is the summed g^2's, which a few large elements can drive)
    trend      mean g^2 over the last 10% of steps / over the first 10%
                                                                  constant: 1; flagged
                                                                  outside [1/2, 2]
    zeros      share of element-steps whose gradient is exactly 0 flagged above 1%
               (among live elements: those zero at every step, dead, never stall and
               are counted apart)

A trace with absent rows (gaps.py: steps at which a tensor had no gradient) counts each
element over its own steps only: the zero share over the element-steps that had a gradient,
an element's kurtosis over its own T, and E[g^2] per step as the mean over the elements
present then (GradientStats `present`).

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
KURTOSIS_RANGE = (2.0, 4.0)
TREND_RANGE = (0.5, 2.0)
ZEROS_MAX = 0.01


def gradient_checks(grad: dict, n_steps: int) -> dict:
    """kurtosis, trend of E[g^2] and zero share of the replayed gradients, and which failed."""
    k = max(1, math.ceil(0.1 * n_steps))
    g2 = np.asarray(grad["g2_sum"][:n_steps], dtype=float)
    element_steps = grad["n"] * n_steps
    if "present" in grad:  # absent rows (gaps.py): per step, the mean over the elements that had a gradient
        present = np.asarray(grad["present"][:n_steps], dtype=float)
        element_steps = float(present.sum())
        with np.errstate(divide="ignore", invalid="ignore"):
            g2 = np.where(present > 0, g2 / present, np.nan)
        first, last = _finite_mean(g2[:k]), _finite_mean(g2[-k:])
    else:
        first, last = g2[:k].mean(), g2[-k:].mean()
    kurt = np.asarray(grad["kurtosis"], dtype=float)
    pooled = float(np.median(kurt)) if kurt.size else None
    out = {"grad_kurtosis": pooled / trend_share(g2) if kurt.size else None, "grad_kurtosis_pooled": pooled,
           "grad_g2_trend": float(last / first) if first > 0 and not math.isnan(last) else None,
           "grad_zero_share": float(np.sum(grad["zeros"][:n_steps]) / max(1, element_steps)),
           "grad_dead_elements": int(grad.get("dead", 0))}
    failed = []
    kurt = out["grad_kurtosis"]
    if kurt is not None and kurt > KURTOSIS_RANGE[1]:
        failed.append(f"gradient kurtosis {kurt:.1f} (Gaussian: 3): heavy tails")
    elif kurt is not None and kurt < KURTOSIS_RANGE[0] and pooled < KURTOSIS_RANGE[0]:
        # both: the trend's share comes from the summed g^2, which a few large elements whose
        # variance falls can dominate while most elements are steady (their kurtosis 3)
        failed.append(f"gradient kurtosis {kurt:.1f} (Gaussian: 3): light tails or gradients far from zero mean "
                      f"(the model assumes N(0, sigma^2))")
    trend = out["grad_g2_trend"]
    if trend is not None and not TREND_RANGE[0] <= trend <= TREND_RANGE[1]:
        how = f"fell {1 / trend:.1f}x" if trend < 1 else f"rose {trend:.1f}x"
        failed.append(f"mean g^2 {how} from the first to the last 10% of steps (the model assumes it constant)")
    if out["grad_zero_share"] > ZEROS_MAX:
        failed.append(f"{out['grad_zero_share']:.1%} of gradient elements are exactly 0 (a Gaussian has none)")
    out["failed"] = failed
    return out


def _finite_mean(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else math.nan


def trend_share(g2_sum: np.ndarray) -> float:
    """mean(S^2) / mean(S)^2 of the per-step sums of g^2 smoothed over max(1, T/50) steps:
    the factor a variance changing over the run multiplies a Gaussian's pooled kurtosis by
    (1 for a constant variance; the smoothing keeps the elements' own noise out of it)."""
    s = np.asarray(g2_sum, dtype=float)
    s = s[np.isfinite(s)]
    if s.size == 0 or s.mean() <= 0:
        return 1.0
    w = max(1, s.size // 50)
    s = np.convolve(s, np.ones(w) / w, mode="valid")
    return float(np.mean(s * s) / np.mean(s) ** 2)


def model_warning(predicted_late: float | None, observed_late: float | None, empirical_late: float | None,
                  checks: dict, block_scaled: bool = False) -> str | None:
    """A warning when the Gaussian prediction misses the observed late stall rate by more
    than TOLERANCE; None otherwise (or when either is unknown). block_scaled: the state's
    grid scales with its block's absmax, which moves codes the models hold still; where the
    empirical model (the trace's own updates, the scale held) also predicts more stalls
    than observed, the gap between it and the observation is named as the scale's share."""
    if predicted_late is None or observed_late is None:
        return None
    miss = observed_late - predicted_late
    if abs(miss) <= TOLERANCE:
        return None
    why = list(checks["failed"])
    scale_moved = (block_scaled and miss < 0 and empirical_late is not None
                   and observed_late < empirical_late - TOLERANCE)
    if scale_moved:
        why.append(f"a code also moves when its block's absmax moves, and both models hold the block's scale "
                   f"(staleness.py): the empirical model, which replays this trace's own updates, predicts "
                   f"{empirical_late:.1%}, so about {100 * (empirical_late - observed_late):.0f} points are codes "
                   f"the scale moved")
    if not why:
        why.append(f"no assumption check failed (kurtosis {checks['grad_kurtosis']:.1f}, mean g^2 x"
                   f"{checks['grad_g2_trend']:.2f}, {checks['grad_zero_share']:.1%} zeros): the model's other "
                   f"approximations (the element's position on the grid, a steady level) are off")
    emp = "" if empirical_late is None or scale_moved else \
        f"; the empirical model (the trace's own g^2) predicts {empirical_late:.1%}"
    return (f"the Gaussian model predicts {predicted_late:.1%} stalls over the last 10% of steps, observed "
            f"{observed_late:.1%} ({100 * miss:+.1f} points): {'; '.join(why)}{emp}")
