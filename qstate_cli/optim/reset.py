"""When to reset optimizer states (m and v back to zero, bias correction restarted).

The staleness paper (Topollai & Choromanska, EMNLP 2026) shows that low-precision states
stall more and more after initialization, and that a reset restores responsiveness.

    none      never reset
    N         reset every N steps (after steps N, 2N, ...)
    auto      the theory-guided period for the state format and beta2
              (diagnose/theory.py: `reset_period`), resolved when the optimizer starts
    callable  any fn(step, since_reset) -> bool (a hook for custom policies)
"""
from __future__ import annotations

from typing import Callable

from ..errors import QstateError


class ResetPolicy:
    def __init__(self, period: int | None = None, fn: Callable[[int, int], bool] | None = None,
                 auto: bool = False):
        if period is not None and period < 1:
            raise QstateError(f"reset period must be a positive number of steps, got {period}")
        self.period = period
        self.fn = fn
        self.auto = auto

    @classmethod
    def parse(cls, value) -> "ResetPolicy":
        """'none' | N | 'auto' | a ResetPolicy | a callable."""
        if isinstance(value, ResetPolicy):
            return value
        if value is None:
            return cls()
        if callable(value):
            return cls(fn=value)
        text = str(value).strip().lower()
        if text in ("none", "never", "0", ""):
            return cls()
        if text == "auto":
            return cls(auto=True)
        if text.isdigit():
            return cls(period=int(text))
        raise QstateError(f"unknown reset policy {value!r}: use none, a number of steps, or auto")

    def resolved(self, period: int | None) -> "ResetPolicy":
        """An 'auto' policy with its period filled in (None: no reset needed)."""
        return ResetPolicy(period=period) if self.auto else self

    def advance(self, last_step: int, last_since: int) -> tuple[int, int, bool]:
        """(the next step, steps since the last reset including it, whether it resets) after
        step last_step, last_since steps after the last reset: what a batched step advances
        its counters by (base.step_counters, fused._step_steady, small.TogetherRun)."""
        step = last_step + 1
        reset = self.should_reset(step, last_since)
        return step, 1 if reset else last_since + 1, reset

    def should_reset(self, step: int, since_reset: int) -> bool:
        """Called before step `step` (1-based); since_reset = steps taken since the last reset."""
        if self.fn is not None:
            return bool(self.fn(step, since_reset))
        return self.period is not None and since_reset >= self.period

    def __str__(self) -> str:
        if self.auto:
            return "auto"
        if self.fn is not None:
            return "custom"
        return str(self.period) if self.period else "none"
