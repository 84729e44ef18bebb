"""A recommended reset period per configuration, with the reasoning spelled out.

The state with the longest memory decides (v for Adam; the momentum otherwise):

1. BReD: the dither changes the stored value every step, so the state cannot go stale:
   no reset.
2. A float format for Adam's v under nearest or stochastic rounding: the staleness model
   (theory.py) gives the step at which the predicted stall probability has built up to
   90% of its steady state after a reset; the observed stall rate is shown beside it.
   Where the trace corpus holds evidence for the format and rounding (evidence.py: the
   model's period, the published one and no reset replayed on corpus traces), the
   option with the lowest update error there is recommended, with its numbers.
3. Otherwise, from the observed *code* stall rate of the replay (summary.py passes the
   code series: under a block scale the stored value moves with the absmax while the
   element's code is frozen, and the frozen code is what goes stale) (the stretch before the first
   reset the replay applied): its plateau is the mean over the last quarter; the period
   is the first step at which the moving average (window max(3, T/50)) reaches 90% of
   the plateau. No reset is recommended when the plateau is under 2% (too little
   stalling to pay for a reset), when stalling is already at half its plateau in the
   first window (there is no build-up for a reset to undo), or when the build-up is not
   over by 3/4 of the trace (record a longer trace).

`qstate diagnose` then replays what this derives (validate.py) and keeps a period only
where it lowers the update error against fp32.
"""
from __future__ import annotations

import numpy as np

from .. import theory
from . import evidence
from .recursions import adam_moments

MIN_PLATEAU = 0.02
MIN_STEPS = 20  # fewer steps before the first reset show no build-up


def recommend(spec, state: str, optimizer: str, beta: float, stall: np.ndarray,
              applied_period: int | None) -> tuple[int | None, str]:
    """(period or None, reason) from the spec and the observed per-step stall rate."""
    seg = stall[:applied_period] if applied_period else stall
    seg = seg[np.isfinite(seg)]
    observed = float(np.mean(seg[-max(1, seg.size // 4):])) if seg.size else float("nan")
    if spec.rounding == "bred":
        return None, (f"BReD re-dithers {state} every step, so the stored value cannot go stale (its code "
                      f"stays put on {observed:.1%} of steps over the last quarter of the trace, but the value read back carries a fresh "
                      f"dither and is unbiased): no reset needed")
    p = theory.fraction_bits_of(spec)
    if adam_moments(optimizer) and state == "v" and p is not None:
        period = theory.reset_period(spec, beta)
        steady = float(theory.stall_probability(spec, beta, 1.0))
        rho = theory.rho(p, beta)
        if period is None:
            return None, (f"staleness model ({spec}, rho={rho:.3g}): predicted steady stall probability "
                          f"{steady:.1%} is negligible: no reset needed")
        why = (f"staleness model ({spec}, beta2={beta}, rho={rho:.3g}): the predicted stall probability builds "
               f"up to 90% of its steady state {steady:.1%} by step {period} after a reset; observed stall rate "
               f"over the last quarter of the trace {observed:.1%}")
        found = evidence.supported(spec, beta)
        if found is None:
            return period, why
        option, chosen, text = found
        return chosen, f"{why}; {text}: " + (f"a reset every {chosen} steps" if chosen else "no reset")
    return observed_period(seg, state, applied_period if applied_period and applied_period < stall.size else None)


def observed_period(seg: np.ndarray, state: str, cut_by: int | None = None) -> tuple[int | None, str]:
    """(period or None, reason) from the code stall series up to the first reset the replay
    applied (`cut_by`: that period, when it cut the trace short)."""
    n = seg.size
    if n < MIN_STEPS and cut_by:
        return None, (f"the replay reset every {cut_by} steps: too few between resets ({n}) to see "
                      f"stalling build up; replay with --reset none (or a longer period) for advice")
    if n < MIN_STEPS:
        return None, f"only {n} steps: too short to see stalling build up; record a longer trace"
    plateau = float(np.mean(seg[-(n // 4):]))
    if plateau < MIN_PLATEAU:
        return None, (f"observed stall rate of {state} over the last quarter of the trace is {plateau:.1%}: "
                      f"too little stalling for a reset to pay")
    w = max(3, n // 50)
    smooth = np.convolve(seg, np.ones(w) / w, mode="valid")  # smooth[j] = mean(seg[j : j + w])
    if smooth[0] >= 0.5 * plateau:
        return None, (f"observed stall rate of {state} is {smooth[0]:.1%} in the first {w} steps and "
                      f"{plateau:.1%} over the last quarter: it does not build up, so a reset would not undo it "
                      f"(a finer format or BReD would)")
    hit = np.nonzero(smooth >= 0.9 * plateau)[0]
    period = int(hit[0] + w) if hit.size else None
    if period is None or period > 0.75 * n:
        return None, (f"observed stall rate of {state} was still building up when the trace ended "
                      f"({n} steps, {plateau:.1%} over the last quarter): record a longer trace")
    return period, (f"observed stall rate of {state} builds up to 90% of its plateau {plateau:.1%} by "
                    f"step {period} (no staleness model for this format)")
