"""The optimizers qstate knows, in one table: name -> class (rules, states, kernel, replay
recursion) and the learning rate `qstate bench train` starts from.

    name   class   states  default lr  reset on   kernel
    adamw  AdamW   m, v    1e-2        v (beta2)  kernels/adamw.py
    adam   Adam    m, v    1e-2        v (beta2)  kernels/adamw.py (L2 added to g)
    lion   Lion    m       1e-3        m (beta2)  kernels/lion.py
    sgd    SGD     m       0.3         momentum   kernels/sgd.py
    muon   Muon    m       0.02        momentum   kernels/muon.py (+ Newton-Schulz in torch)

Default learning rates. AdamW/Adam: tuned for fp32 states on tiny-lm at 500 steps (a
sweep 1.5e-3, 3e-3, 6e-3, 1e-2, 2e-2 gave final val loss 2.27, 2.14, 1.90, 1.86, 1.94), so
a quantized run cannot look better than fp32 merely by taking effectively larger steps at
a too-small lr. The others are the usual starting points (Lion ~ AdamW / 10, Muon's
0.02), not tuned here.

Every user of an optimizer's facts reads them here: the benchmarks (which states a step
keeps), the training study (class, lr, reset beta), the trace replay (recursion, betas,
notes) and the recorder's names (a trace of torch.optim.AdamW replays as "adamw").
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from ..errors import QstateError, clip
from ..quant.formats import suggest
from . import rules
from .base import QuantizedOptimizer
from .optimizers import SGD, Adam, AdamW, Lion, Muon


@dataclass(frozen=True)
class OptimizerInfo:
    name: str
    cls: type[QuantizedOptimizer]
    default_lr: float  # bench train's peak learning rate (module docstring)

    @property
    def states(self) -> tuple[str, ...]:
        return self.cls.state_names

    def hparams(self, given: dict | None = None) -> dict:
        """The class's default hyper-parameters, overridden by `given` (e.g. a trace's)."""
        sig = inspect.signature(self.cls.__init__)
        defaults = {k: p.default for k, p in sig.parameters.items()
                    if p.default is not inspect.Parameter.empty and k not in ("states", "reset", "seed", "backend")}
        return {**defaults, **(given or {})}

    def check_hparams(self, given: dict) -> None:
        """Refuse hyper-parameters no run can have (QstateError naming the first): lr, eps,
        weight_decay finite with lr >= 0, eps > 0, weight_decay >= 0; betas two numbers
        in [0, 1); momentum in [0, 1), dampening in [0, 1]; nesterov, maximize, decoupled
        true or false; Muon's ns_steps in [0, 100), ns_coefficients three numbers, adjust_lr_fn
        "original" or "match_rms_adamw". A beta of 1 would make the EMA never move (and 1/(1-beta) infinite);
        names the optimizer does not take (amsgrad, foreach, ...) are left alone."""
        hp = dict(given)
        for key, low, high, closed in (("lr", 0.0, math.inf, True), ("eps", 0.0, math.inf, False),
                                       ("weight_decay", 0.0, math.inf, True), ("momentum", 0.0, 1.0, True),
                                       ("dampening", 0.0, 1.0, True)):
            if key in hp:
                _number(key, hp[key], low, high, closed, high_open=key == "momentum")
        if "betas" in hp:
            betas = hp["betas"]
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise QstateError(f"hparams betas {betas!r}: give two numbers (beta1, beta2)")
            for b in betas:
                _number("betas", b, 0.0, 1.0, True, high_open=True, whole=betas)
        for key in ("nesterov", "maximize", "decoupled"):
            if key in hp and not isinstance(hp[key], bool):
                raise QstateError(f"hparams {key} {hp[key]!r}: must be true or false")
        if {"ns_steps", "ns_coefficients", "adjust_lr_fn"} & set(hp):  # Muon's Newton-Schulz settings
            try:
                rules.check_newton_schulz(hp.get("ns_steps", 5), hp.get("ns_coefficients", rules.NS_COEFFS),
                                          hp.get("eps", 1e-7), hp.get("adjust_lr_fn"))
            except ValueError as exc:
                raise QstateError(f"hparams {exc}") from None

    def betas(self, given: dict | None = None) -> dict[str, float]:
        """{state: the EMA beta that sets its memory} under these hyper-parameters."""
        return self.cls.state_betas(self.hparams(given))

    def reset_state(self, given: dict | None = None) -> str:
        """The state a reset is timed on: the one with the longest memory."""
        return self.cls.reset_state(self.hparams(given))


OPTIMIZERS: dict[str, OptimizerInfo] = {info.name: info for info in (
    OptimizerInfo("adamw", AdamW, 1e-2),
    OptimizerInfo("adam", Adam, 1e-2),
    OptimizerInfo("lion", Lion, 1e-3),
    OptimizerInfo("sgd", SGD, 0.3),
    OptimizerInfo("muon", Muon, 0.02),
)}


def _number(key: str, value, low: float, high: float, low_closed: bool, high_open: bool = False, whole=None):
    shown = clip(f"{key} {whole if whole is not None else value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2 ** 1023:  # past any float
        raise QstateError(f"hparams {shown}: must be a finite number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise QstateError(f"hparams {shown}: must be a finite number")
    if value < low or (value == low and not low_closed) or value > high or (value == high and high_open):
        lo, hi = "[" if low_closed else "(", ")" if high_open or high == math.inf else "]"
        each = "each beta " if whole is not None else ""
        raise QstateError(f"hparams {shown}: {each}must be in {lo}{low:g}, {high:g}{hi}")


def optimizer_info(name: str) -> OptimizerInfo:
    """The registry entry of `name` (case-insensitive); QstateError naming the closest ones."""
    key = str(name).strip().lower()
    if key not in OPTIMIZERS:
        raise QstateError(f"unknown optimizer {name!r}{suggest(key, list(OPTIMIZERS))}")
    return OPTIMIZERS[key]
