"""The hyper-parameters no run can have: one rule for the CLI and the constructors.

`check(given, error)` refuses the first bad value of `given` with `error` (the registry's
OptimizerInfo.check_hparams passes QstateError, for a trace's or a flag's values; the
optimizers' constructors and add_param_group pass ValueError, as torch.optim raises):

    lr, weight_decay   finite numbers >= 0 (a one-element tensor lr: its value)
    eps                a finite number > 0
    betas              two numbers, each in [0, 1) (a beta of 1 never moves its EMA, and
                       1 / (1 - beta) is infinite)
    momentum           in [0, 1); dampening in [0, 1]
    nesterov, maximize, decoupled   true or false
    nesterov (SGD)     needs momentum > 0 and dampening 0, as torch.optim.SGD (checked where
                       `given` holds dampening: Muon's Nesterov has no dampening)
    Muon               ns_steps in [0, 100), ns_coefficients three finite numbers, adjust_lr_fn
                       "original", "match_rms_adamw" or None (rules.check_newton_schulz)

Names the rule does not know (amsgrad, foreach, a user's own tags) are left alone here;
optim/guards.py refuses torch options an optimizer does not implement.
"""
from __future__ import annotations

import math
import numbers

import torch

from ..errors import clip
from . import rules

RANGES = (("lr", 0.0, math.inf, True), ("eps", 0.0, math.inf, False), ("weight_decay", 0.0, math.inf, True),
          ("momentum", 0.0, 1.0, True), ("dampening", 0.0, 1.0, True))  # key, low, high, low closed


def check(given: dict, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming the first hyper-parameter of `given` no run can have (module docstring)."""
    hp = dict(given)
    for key, low, high, closed in RANGES:
        if key in hp:
            _number(error, key, hp[key], low, high, closed, high_open=key == "momentum")
    if "betas" in hp:
        betas = hp["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise error(f"hparams betas {betas!r}: give two numbers (beta1, beta2)")
        for b in betas:
            _number(error, "betas", b, 0.0, 1.0, True, high_open=True, whole=betas)
    for key in ("nesterov", "maximize", "decoupled"):
        if key in hp and not isinstance(hp[key], bool):
            raise error(f"hparams {key} {clip(repr(hp[key]))}: must be true or false")
    if hp.get("nesterov") and "dampening" in hp and (hp.get("momentum", 0) <= 0 or hp["dampening"] != 0):
        raise error(f"hparams nesterov: Nesterov momentum needs momentum > 0 and dampening 0 (got momentum "
                    f"{hp.get('momentum', 0)!r}, dampening {hp['dampening']!r}), as torch.optim.SGD has it")
    if {"ns_steps", "ns_coefficients", "adjust_lr_fn"} & set(hp):  # Muon's Newton-Schulz settings
        try:
            rules.check_newton_schulz(hp.get("ns_steps", 5), hp.get("ns_coefficients", rules.NS_COEFFS),
                                      hp.get("eps", 1e-7), hp.get("adjust_lr_fn"))
        except ValueError as exc:
            raise error(f"hparams {exc}") from None


def _number(error, key: str, value, low: float, high: float, low_closed: bool, high_open: bool = False, whole=None):
    shown = clip(f"{key} {whole if whole is not None else value!r}")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype.is_floating_point:
        value = float(value)  # a tensor lr (rules.f32 takes one)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2 ** 1023:  # past any float
        raise error(f"hparams {shown}: must be a finite number")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise error(f"hparams {shown}: must be a finite number")
    if value < low or (value == low and not low_closed) or value > high or (value == high and high_open):
        lo, hi = "[" if low_closed else "(", ")" if high_open or high == math.inf else "]"
        each = "each beta " if whole is not None else ""
        raise error(f"hparams {shown}: {each}must be in {lo}{low:g}, {high:g}{hi}")
