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
from dataclasses import dataclass

from ..errors import QstateError
from ..quant.formats import suggest
from . import checkpoint, hparams
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
        """Refuse hyper-parameters no run can have (QstateError naming the first): the rule
        the optimizers' constructors apply too (optim/hparams.py: lr >= 0, eps > 0, betas in
        [0, 1), SGD's Nesterov needs momentum and no dampening, ...); names the optimizer does
        not take (amsgrad, foreach, ...) are left alone."""
        hparams.check(given, QstateError)

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
for _info in OPTIMIZERS.values():  # what a checkpoint of each holds (optim/checkpoint.py: another optimizer's)
    checkpoint.know(_info.cls)


def keeps_text() -> str:
    """Which states each optimizer keeps, for a table title: "AdamW and Adam keep m and v;
    Lion, SGD and Muon the preset's m"."""
    by_states: dict[tuple, list] = {}
    for info in OPTIMIZERS.values():
        by_states.setdefault(info.states, []).append(info.cls.__name__)
    parts = []
    for k, (states, classes) in enumerate(by_states.items()):
        who = " and ".join([", ".join(classes[:-1]), classes[-1]] if len(classes) > 1 else classes)
        keep = " and ".join(states) if len(states) > 1 else f"the preset's {states[0]}"
        parts.append(f"{who} {'keep ' if k == 0 else ''}{keep}")
    return "; ".join(parts)


def names_text(last: str = " or ") -> str:
    """The optimizers' names for a help text: "adamw, adam, lion, sgd or muon"."""
    names = list(OPTIMIZERS)
    return ", ".join(names[:-1]) + last + names[-1]


def optimizer_info(name: str) -> OptimizerInfo:
    """The registry entry of `name` (case-insensitive); QstateError naming the closest ones."""
    key = str(name).strip().lower()
    if key not in OPTIMIZERS:
        raise QstateError(f"unknown optimizer {name!r}{suggest(key, list(OPTIMIZERS))}")
    return OPTIMIZERS[key]
