"""When to reset optimizer states (m and v back to zero, bias correction restarted).

The staleness paper (Topollai & Choromanska, EMNLP 2026) shows that low-precision states
stall more and more after initialization, and that a reset restores responsiveness.

    none      never reset
    N         reset every N steps (after steps N, 2N, ...)
    auto      the theory-guided period for the state format and beta (`auto_period`),
              resolved when the optimizer starts and again when it loads a checkpoint
    callable  any fn(step, since_reset) -> bool (a hook for custom policies)

A checkpoint (QuantizedOptimizer.state_dict) holds the policy as it was asked for
(`asked`: none, N, auto or custom) in each param group's `reset`; load_state_dict
restores it as it restores lr and betas (optim/checkpoint.py: restore_reset).
"""
from __future__ import annotations

from typing import Callable

from ..errors import QstateError

# The float format of the same storage width whose staleness model stands in for a format
# the model does not cover (linear, code-book, no-zero): as the staleness paper stores v.
STAND_IN_FLOAT = {4: "e2m2", 8: "e4m3", 16: "bf16"}


def auto_period(spec, beta: float) -> tuple[int | None, str]:
    """`reset="auto"`: (the period in steps, None for no reset; why) for the state the
    optimizer resets on (AdamW's v, the momentum m otherwise), stored as `spec`, at its EMA
    `beta`. The staleness model's period (theory.reset_period: the first step after a reset
    at which the predicted stall probability reaches 90% of its steady state) is written
    for floating formats with p fraction bits; for a linear, code-book or no-zero format
    the float format of the same width (STAND_IN_FLOAT) stands in, with the state's own
    rounding. BReD never stalls in the model and fp32 states do not stall: no reset."""
    from ..quant.config import parse_spec
    from ..theory import fraction_bits_of, reset_period

    if spec.fmt.kind == "identity":
        return None, "fp32 states do not stall"
    if spec.rounding == "bred":
        return None, "theory: BReD does not stall"
    model_spec, basis = spec, f"theory: {spec.fmt.name} model"
    if fraction_bits_of(spec) is None:
        stand_in = STAND_IN_FLOAT.get(spec.fmt.bits)
        if stand_in is None:
            return None, f"theory: no model for {spec.fmt.name}"
        model_spec = parse_spec(f"{stand_in}:{spec.rounding}")
        basis = f"theory: {stand_in} model stands in for {spec.fmt.name} (same width)"
    period = reset_period(model_spec, beta)
    return period, basis + ("" if period else " predicts no stall build-up")


class ResetPolicy:
    # class defaults: a policy unpickled from an older qstate (an optimizer pickled whole) lacks newer fields
    period: int | None = None
    fn: Callable[[int, int], bool] | None = None
    auto: bool = False
    basis: str | None = None

    def __init__(self, period: int | None = None, fn: Callable[[int, int], bool] | None = None,
                 auto: bool = False, basis: str | None = None):
        if period is not None and period < 1:
            raise QstateError(f"reset period must be a positive number of steps, got {period}")
        self.period = period
        self.fn = fn
        self.auto = auto  # not resolved yet
        self.basis = basis  # an 'auto' policy resolved: why its period (auto_period); None otherwise

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

    def resolved(self, period: int | None, basis: str) -> "ResetPolicy":
        """An 'auto' policy with its period filled in (None: no reset needed) and why."""
        return ResetPolicy(period=period, basis=basis) if self.auto else self

    @property
    def asked(self) -> str:
        """The policy as it was asked for (what a checkpoint keeps): none, N, auto, custom."""
        return "auto" if self.auto or self.basis is not None else str(self)

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
