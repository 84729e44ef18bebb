"""Warnings for state specs an optimizer would train badly with (QuantizedOptimizer's
constructor): checked once, when the optimizer is built."""
from __future__ import annotations

import os
import sys
import warnings

from ..quant.config import StateSpec


def has_zero_level(fmt) -> bool:
    """Whether the grid reads some code back as exactly 0 (linear and float grids always; a
    code book where it holds 0)."""
    if fmt.kind == "table":
        from ..quant.codebooks import codebook

        return 0.0 in [float(x) for x in codebook(fmt.name)]
    return fmt.kind in ("linear", "float")


def check_state_spec(optimizer: str, state: str, spec: StateSpec) -> None:
    """Warn of a spec that trains badly: an unsigned format for m (a momentum takes both
    signs: its negative values are lost), and a 4-bit grid with a zero level for v (int4,
    de4u, fp4's e2m1/e2m2: a small v reads back as 0 and m / (sqrt(v) + eps) blows up, which
    is why the 4-bit presets keep v on lin4nz; `qstate diagnose demo`, 2000 steps, update
    error vs fp32: lin4nz 0.85, de4u 31, e2m2 601, int4 1437). Warnings, not errors: the kernels' tests step such specs on purpose."""
    fmt, why = spec.fmt, None
    if state == "m" and fmt.kind != "identity" and not fmt.signed:
        why = (f"{fmt.name} is unsigned, and m (a momentum) takes both signs: its negative values are lost; "
               f"use a signed format (int4, de4, de8, e2m1, ...)")
    elif state == "v" and fmt.bits <= 4 and has_zero_level(fmt):
        why = (f"a 4-bit {fmt.kind} grid with a zero level ({fmt.name}), so a small v reads back as 0 and the update "
               f"m / (sqrt(v) + eps) blows up (the demo trace's update error vs fp32: v on lin4nz 0.85, de4u 31, "
               f"e2m2 601, int4 1437); the 4-bit presets keep v on lin4nz")
    if why:
        warnings.warn(f"{optimizer} {state}={spec}: {why}", UserWarning, stacklevel=first_caller_outside())


def first_caller_outside() -> int:
    """warnings.warn's stacklevel (from check_state_spec) of the first frame outside optim/:
    the call that built the optimizer (Adam's constructor calls AdamW's, which calls the
    base class's: a fixed stacklevel pointed inside optim/ for some optimizers)."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1  # check_state_spec's frame is stacklevel 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level
