"""Warnings for state specs an optimizer would train badly with (QuantizedOptimizer's
constructor): checked once, when the optimizer is built."""
from __future__ import annotations

import warnings

from ..quant.config import StateSpec


def check_state_spec(optimizer: str, state: str, spec: StateSpec) -> None:
    """Warn of a spec that trains badly: an unsigned format for m (a momentum takes both
    signs: its negative values are lost), and a 4-bit linear grid for v (its zero level: a
    small v reads back as 0 and m / (sqrt(v) + eps) blows up, which is why the presets keep
    v on lin4nz). Warnings, not errors: the kernels' tests step such specs on purpose."""
    fmt, why = spec.fmt, None
    if state == "m" and fmt.kind != "identity" and not fmt.signed:
        why = (f"{fmt.name} is unsigned, and m (a momentum) takes both signs: its negative values are lost; "
               f"use a signed format (int4, de4, de8, e2m1, ...)")
    elif state == "v" and fmt.kind == "linear" and fmt.bits == 4:
        why = ("a 4-bit linear grid has a zero level, so a small v reads back as 0 and the update "
               "m / (sqrt(v) + eps) blows up; the 4-bit presets keep v on lin4nz")
    if why:
        warnings.warn(f"{optimizer} {state}={spec}: {why}", UserWarning, stacklevel=4)
