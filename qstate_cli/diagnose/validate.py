"""Reset advice that helps: replay a recommended period before giving it.

A reset puts m and v back to zero. Whether that helps is a question about the updates the
optimizer takes, so each candidate period P is replayed (replay.py) with the
configuration resetting every P steps and measured against the fp32 optimizer that
never resets (`reference_reset=False`): the mean relative update error
|u - u_fp32| / |u_fp32| over the steps (the record's `update_rel_error`), with the reset
and without it. The period is recommended only when it lowers that error by at least
`MIN_GAIN` (1%) relative; otherwise the advice says that a reset does not pay, with both
numbers. Candidates:

- the period recommend.py derived (for float formats of Adam's v the one the trace corpus
  supports, evidence.py; the observed build-up of the code stall rate otherwise);
- for float formats, also the staleness model's period and the published one
  (theory.REPORTED_PERIODS at beta2 = 0.999: bf16 1000, e4m3 300, e2m2 200): the replay
  on the user's trace picks among them and no reset;
- a format whose codes stall from the first steps on (no build-up for recommend.py to
  see) still gets one candidate: 1 / (1 - beta) steps, the state's memory, so the replay
  decides instead of a rule of thumb.

A candidate of at least the replayed steps cannot be tested (no reset would happen) and is
kept with a note saying so. BReD never gets a reset (nothing goes stale).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import theory
from .evidence import MIN_GAIN, published_period
from .replay import ReplayOptions, replay


@dataclass
class Verdict:
    period: int | None
    reason: str
    error_with: float | None = None  # mean relative update error with the chosen (or best tried) period
    error_without: float | None = None


def candidates(spec, beta: float, period: int | None) -> list[int]:
    """Periods worth replaying for a state under `spec` (module docstring)."""
    out = [period] if period else []
    if spec.fmt.kind == "float" and spec.rounding != "bred":
        out.append(theory.reset_period(spec, beta))
        out.append(published_period(spec, beta))
    out = [p for p in out if p]
    if not out and spec.fmt.kind != "identity":
        out.append(int(round(1.0 / (1.0 - beta))))
    return sorted(set(out))


def update_error(trace, cfg, period: int | None, steps_limit, device, split=None,
                 backend: str = "auto") -> float | None:
    """Mean relative update error of `cfg` resetting every `period` steps against fp32 without resets
    (`split`: torchrun's ranks replay it together, each its share of the elements; `backend`:
    the states' codec, as `qstate diagnose --backend`, diagnose/codec.py)."""
    raw = replay(trace, ReplayOptions([cfg], reset=str(period) if period else "none", steps_limit=steps_limit,
                                      device=device, reference_reset=False, models=False, snapshots=1,
                                      split=split, backend=backend))
    rel = raw.configs[0].update["rel_error"]
    rel = rel[rel == rel]
    return float(rel.mean()) if rel.size else None


def validate(trace, cfg, spec, beta: float, advice: tuple, n_steps: int, baseline: float | None,
             steps_limit=None, device="auto", split=None, backend: str = "auto") -> Verdict:
    """The advice for `cfg`, validated by replay; `baseline`: its error without resets (None: replay it)."""
    period, reason = advice
    if spec.rounding == "bred" or spec.fmt.kind == "identity":
        return Verdict(period, reason)
    tried = [p for p in candidates(spec, beta, period) if p < n_steps]
    untestable = [p for p in candidates(spec, beta, period) if p >= n_steps]
    if not tried:
        if period is not None:
            reason += f"; not validated: the trace ({n_steps} steps) is too short for a reset every {period} steps"
        return Verdict(period, reason)
    if baseline is None:
        baseline = update_error(trace, cfg, None, steps_limit, device, split, backend)
    errors = {p: update_error(trace, cfg, p, steps_limit, device, split, backend) for p in tried}
    best = min(errors, key=lambda p: errors[p] if errors[p] is not None else float("inf"))
    shown = ", ".join(f"every {p}: {errors[p]:.4g}" for p in tried if errors[p] is not None)
    measured = f"update error vs fp32 without resets, replayed: none: {baseline:.4g}; {shown}"
    if errors[best] is not None and baseline is not None and errors[best] < (1 - MIN_GAIN) * baseline:
        why = "" if best == period else (f" (better than the derived {period})" if period else "")
        return Verdict(best, f"{reason}; validated on this trace: a reset every {best} steps{why} lowers the "
                             f"{measured}", errors[best], baseline)
    note = f"; {untestable[0]} not tried (trace too short)" if untestable else ""
    return Verdict(None, f"{reason}; a reset does not pay here ({measured}){note}: no reset",
                   errors[best], baseline)
