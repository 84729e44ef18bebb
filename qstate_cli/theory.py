"""The staleness model: predicted stall probabilities and reset periods (pure math).

Model (Topollai & Choromanska, EMNLP 2026; BRIEF §2). The second moment v of AdamW is
stored in a floating format with p fraction bits (eps = 2**-p: bf16 p=7, fp16 10,
fp8 e4m3 3, e5m2 2, fp4 e2m1 1, unsigned fp4 e2m2 2). Gradients are Gaussian, so
z = g^2 / sigma^2 ~ chi-squared with one degree of freedom, F(x) = erf(sqrt(x / 2)).
A value's spacing relative to itself averages eps * ln 2 over a binade, so with

    rho = eps * ln 2 / (2 (1 - beta2))

round-to-nearest leaves the stored v unchanged (a *stall*) when the nominal update
(1 - beta2)(g^2 - v) is under half a spacing, i.e. |z / c - 1| < rho:

    P_NR(c) = F(c (1 + rho)) - F(max(0, c (1 - rho)))
    P_SR(c) = E_z[ max(0, 1 - |z / c - 1| / (2 rho)) ]       (stochastic rounding)

where c = c_t = 1 - beta2**(t - 1) is the level v has reached t steps after a zero
initialization or a reset (c = 1: steady state). BReD never stalls in this sense: the
value read back carries a fresh dither every step, so P_BReD = 0.

Reset period (our reading of "reset once stalling has built up"): the first step T
after a reset at which the predicted stall probability reaches `BUILDUP` (90%) of its
steady-state value; beyond it the state is about as stale as it will get, and a reset
restores responsiveness. The paper reports ~1000 (bf16), ~300 (fp8), ~200 (fp4) steps
at beta2 = 0.999; `qstate diagnose --theory` prints ours beside those.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

BUILDUP = 0.9
REPORTED_PERIODS = {"bf16": 1000, "e4m3": 300, "e2m2": 200}  # at beta2 = 0.999 (paper)


def chi2_cdf(x):
    """F(x) = P(z <= x) for z ~ chi^2_1, = erf(sqrt(x / 2)); 0 for x <= 0."""
    from scipy import special  # imported at first use: ~1.4 s with scipy.stats, which every command would pay

    return special.erf(np.sqrt(np.maximum(np.asarray(x, dtype=float), 0.0) / 2.0))


def rho(fraction_bits: int, beta: float) -> float:
    """Half the mean relative spacing over the EMA's step size: eps ln2 / (2 (1 - beta))."""
    return 2.0 ** -fraction_bits * math.log(2.0) / (2.0 * (1.0 - beta))


def p_stall_nearest(r: float, c=1.0):
    """One-step stall probability under round-to-nearest at level c (array or float)."""
    c = np.asarray(c, dtype=float)
    return chi2_cdf(c * (1 + r)) - chi2_cdf(np.maximum(0.0, c * (1 - r)))


_S = np.linspace(0.0, 12.0, 24001)  # z = s^2 with s half-normal: a smooth integrand


@lru_cache(maxsize=1)
def _half_normal_weights() -> np.ndarray:
    """Trapezoid weights of the half-normal density on _S: 2 phi(s) ds, half a step at each
    end (np.gradient's whole step at s = 0 added 2 phi(0) ds / 2, ~2e-4, to P_SR)."""
    from scipy import stats

    ds = np.full_like(_S, _S[1] - _S[0])
    ds[0] = ds[-1] = ds[0] / 2
    return 2.0 * stats.norm.pdf(_S) * ds


def p_stall_stochastic(r: float, c=1.0):
    """One-step stall probability under stochastic rounding at level c (array or float):
    E_s[max(0, 1 - |s^2 / c - 1| / (2 rho))] with s ~ half-normal (z = s^2 ~ chi^2_1).
    The tent is 0 outside c (1 - 2 rho) < z < c (1 + 2 rho), so each level sums the
    quadrature over that band of _S only (a curve of 2000 levels: 15-150 ms, against ~1.3 s
    for the dense [levels, 24001] tent)."""
    c_arr = np.asarray(c, dtype=float).reshape(-1)
    out = np.zeros_like(c_arr)
    w = _half_normal_weights()
    lo = np.searchsorted(_S, np.sqrt(np.maximum(0.0, c_arr * (1.0 - 2.0 * r))), side="left")
    hi = np.searchsorted(_S, np.sqrt(np.maximum(0.0, c_arr * (1.0 + 2.0 * r))), side="right")
    for k in np.flatnonzero(c_arr > 0):
        z = _S[lo[k]:hi[k]] ** 2
        out[k] = np.maximum(0.0, 1.0 - np.abs(z / c_arr[k] - 1.0) / (2.0 * r)) @ w[lo[k]:hi[k]]
    return float(out[0]) if np.ndim(c) == 0 else out.reshape(np.shape(c))


def buildup_level(t, beta: float):
    """c_t = 1 - beta**(t - 1): how far v has come t steps after a zero start."""
    return 1.0 - beta ** (np.asarray(t, dtype=float) - 1.0)


def fraction_bits_of(spec) -> int | None:
    """p for float formats; None where the model does not apply (int/DE/fp32).

    A v stored as sqrt(v) (spec `:sqrt`) moves, relative to itself, half as much per
    update (d sqrt(v) / sqrt(v) = dv / 2v), so it stalls like one fraction bit fewer: p - 1."""
    fmt = getattr(spec, "fmt", spec)
    if getattr(fmt, "kind", None) != "float":
        return None
    return fmt.man_bits - (1 if getattr(spec, "sqrt", False) else 0)


def stall_probability(spec, beta: float, c=1.0):
    """Predicted one-step stall probability of a stored v under `spec`, or None."""
    p = fraction_bits_of(spec)
    if p is None:
        return None
    r = rho(p, beta)
    rounding = getattr(spec, "rounding", "nearest")
    if rounding == "bred":
        return np.zeros_like(np.asarray(c, dtype=float)) if np.ndim(c) else 0.0
    if rounding == "stochastic":
        return p_stall_stochastic(r, c)
    return p_stall_nearest(r, c)


def stall_curve(spec, beta: float, steps: int, reset_period: int | None = None):
    """Predicted P(stall) at steps 1..steps, with build-up restarting at each reset."""
    t = np.arange(1, steps + 1)
    since = (t - 1) % reset_period + 1 if reset_period else t
    out = stall_probability(spec, beta, buildup_level(since, beta))
    return None if out is None else np.asarray(out, dtype=float)


def reset_period(spec, beta: float, buildup: float = BUILDUP, horizon_factor: int = 20) -> int | None:
    """First step at which the predicted stall probability reaches `buildup` of its
    steady-state value (None: no model for this format, or it never stalls)."""
    steady = stall_probability(spec, beta, 1.0)
    if steady is None or float(steady) <= 1e-6:
        return None
    horizon = int(horizon_factor / (1.0 - beta))
    t = np.unique(np.round(np.geomspace(1, horizon, 400)).astype(int))
    curve = np.asarray(stall_probability(spec, beta, buildup_level(t, beta)), dtype=float)
    hit = np.nonzero(curve >= buildup * float(steady))[0]
    if not hit.size:
        return None
    i = hit[0]
    if i == 0:
        return int(t[0])
    lo, hi = int(t[i - 1]), int(t[i])  # refine between the two grid points
    while hi - lo > 1:
        mid = (lo + hi) // 2
        val = float(stall_probability(spec, beta, float(buildup_level(mid, beta))))
        lo, hi = (mid, hi) if val < buildup * float(steady) else (lo, mid)
    return hi


def theory_rows(specs, beta: float) -> list[dict]:
    """One row per spec: rho, steady-state stall probabilities, reset period."""
    rows = []
    for spec in specs:
        p = fraction_bits_of(spec)
        steady = stall_probability(spec, beta, 1.0)
        rows.append({
            "format": spec.fmt.name,
            "rounding": spec.rounding,
            "beta2": beta,
            "fraction_bits": p,
            "rho": None if p is None else round(rho(p, beta), 4),
            "p_stall_steady": None if steady is None else round(float(steady), 4),
            "reset_period": reset_period(spec, beta),
            "reported_period": REPORTED_PERIODS.get(spec.fmt.name) if beta == 0.999 else None,
        })
    return rows
