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

import functools
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
    return update_errors(trace, [(cfg, period)], steps_limit, device, split, backend)[0]


def update_errors(trace, runs: list[tuple], steps_limit, device, split=None, backend: str = "auto",
                  batch: int | None = None, config_threads: int = 1, unit: int | None = None,
                  progress=None) -> list[float | None]:
    """update_error of each (configuration, period) of `runs`, replayed together: one replay per
    `batch` runs (all in one by default), so they share each step's gradient gather and the fp32
    shadow that never resets, and step on `config_threads` threads (replay.config_threads_for).
    `unit`: the layout's (replay.layout_unit; by default the largest block of the batch). Each
    run writes only its own states, so with the same unit its error is the one it gets replayed
    alone, bit for bit. `progress(group, groups, done, total)` after each step of each replay."""
    size = len(runs) if batch is None else max(1, int(batch))
    groups = -(-len(runs) // size) if runs else 0
    out = []
    for k in range(groups):  # evenly sized groups: 8 runs at most 7 at once are 4 + 4, not 7 + 1
        group = runs[len(runs) * k // groups: len(runs) * (k + 1) // groups]
        raw = replay(trace, ReplayOptions([c for c, _ in group], resets=[str(p) if p else "none" for _, p in group],
                                          steps_limit=steps_limit, device=device, reference_reset=False,
                                          models=False, state_stats=False, snapshots=1, split=split,
                                          backend=backend,
                                          config_threads=config_threads, unit=unit),
                     progress=None if progress is None else functools.partial(progress, k, groups))
        for c in raw.configs:
            rel = c.update["rel_error"]
            rel = rel[rel == rel]
            out.append(float(rel.mean()) if rel.size else None)
    return out


def replays_for(spec, beta: float, advice: tuple, n_steps: int, baseline: float | None) -> list[int | None]:
    """The periods `validate` replays for this advice (None: without resets, for the baseline)."""
    if spec.rounding == "bred" or spec.fmt.kind == "identity":
        return []
    tried = [p for p in candidates(spec, beta, advice[0]) if p < n_steps]
    return tried + ([None] if tried and baseline is None else [])


def validate(trace, cfg, spec, beta: float, advice: tuple, n_steps: int, baseline: float | None,
             steps_limit=None, device="auto", split=None, backend: str = "auto",
             replayed: dict | None = None) -> Verdict:
    """The advice for `cfg`, validated by replay; `baseline`: its error without resets (None: replay it);
    `replayed`: {period (None: no reset): update error} of runs already replayed (update_errors),
    the others are replayed here."""
    period, reason = advice
    if spec.rounding == "bred" or spec.fmt.kind == "identity":
        return Verdict(period, reason)
    tried = [p for p in candidates(spec, beta, period) if p < n_steps]
    untestable = [p for p in candidates(spec, beta, period) if p >= n_steps]
    if not tried:
        if period is not None:
            reason += f"; not validated: the trace ({n_steps} steps) is too short for a reset every {period} steps"
        return Verdict(period, reason)
    replayed = dict(replayed or {})
    if baseline is None:
        baseline = replayed[None] if None in replayed else update_error(trace, cfg, None, steps_limit, device,
                                                                           split, backend)
    errors = {p: replayed[p] if p in replayed else update_error(trace, cfg, p, steps_limit, device, split, backend)
              for p in tried}
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
