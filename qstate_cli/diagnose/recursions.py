"""The optimizer state recursions a replay runs: each optimizer's `replay_step`
(optim/optimizers.py), which calls the reference rule (optim.rules) unchanged with a
zero parameter, lr = 1 and no weight decay. The rule's parameter update is then exactly
minus the update direction, and the new states are bit for bit what the reference
optimizer computes (the states never depend on the parameter, the learning rate or
decoupled weight decay). Update fidelity compares these directions between a quantized
configuration and the fp32 shadow; the weight-decay term is the same in both, so it is
left out.

    adamw, adam   m, v (betas); direction (m / (sqrt(v) / sqrt(bc2) + eps)) / bc1
    lion          m (beta2 drives the state); direction sign(b1 m_hat + (1 - b1) g)
    sgd           m = momentum buffer (torch.optim.SGD semantics); direction d
    muon          m = momentum buffer; direction = the Nesterov/plain momentum update
                  before Newton-Schulz orthogonalization (which needs whole matrices)

Which optimizers, their states, betas and notes: optim/registry.py. A traced
hyper-parameter that is missing takes the qstate optimizer's default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from ..errors import QstateError
from ..optim import OPTIMIZERS, OptimizerInfo, rules

SUPPORTED = tuple(OPTIMIZERS)


def adam_moments(optimizer: str) -> bool:
    """The optimizer's m and v are Adam's moments (its class's `adam_moments`, optim/optimizers.py)."""
    info = OPTIMIZERS.get(optimizer)
    return bool(info is not None and info.cls.adam_moments)


@dataclass
class Recursion:
    optimizer: str
    hparams: dict  # the trace's, over the optimizer's defaults
    states: tuple[str, ...]
    betas: dict  # state -> the EMA beta that sets its memory (theory, reset periods)
    notes: list = field(default_factory=list)
    info: OptimizerInfo | None = None
    _scalars: dict = field(default_factory=dict)

    @property
    def adam_moments(self) -> bool:
        """m and v are Adam's moments: the Gaussian staleness model, theory.py's v curve and
        the reset advice apply (adam_moments)."""
        return self.info.cls.adam_moments if self.info is not None else adam_moments(self.optimizer)

    @property
    def slowest_state(self) -> str:
        """The state with the longest memory (largest beta): v for Adam, m otherwise."""
        return max(self.states, key=lambda s: self.betas[s])

    def scalars(self, since: int, device) -> rules.Scalars:
        """lr = 1, no weight decay, the bias corrections of step `since` (cached)."""
        key = (since, str(device))
        if key not in self._scalars:
            b1, b2 = (float(b) for b in self.hparams.get("betas", (0.0, 0.0)))
            self._scalars[key] = rules.step_scalars(1.0, 0.0, b1, b2, since, device)
        return self._scalars[key]

    def step(self, g: torch.Tensor, x_hat: dict, since: int, first: dict):
        """(direction, {state: new fp32 state}) for one step; see module docstring."""
        return self.info.cls.replay_step(self.hparams, g, x_hat, self.scalars(since, g.device), first)


def recursion_for(optimizer: str, hparams: dict) -> Recursion:
    """The recursion of a traced optimizer, with notes on what the replay leaves out."""
    name = optimizer.lower()
    if name not in OPTIMIZERS:
        raise QstateError(f"optimizer {optimizer!r} is not supported by the replay; supported: {', '.join(SUPPORTED)} "
                          f"(a trace of an optimizer that follows one of these rules: record it with "
                          f"Recorder(..., optimizer_name=...))")
    info = OPTIMIZERS[name]
    hp = info.hparams(dict(hparams))
    notes = info.cls.replay_notes(hp)  # raises for a recursion with no state (SGD without momentum)
    return Recursion(name, hp, info.states, info.cls.state_betas(hp), notes, info)


def fused_rule(rec: Recursion, device) -> tuple["FusedAdamRule | None", str | None]:
    """(the fused CPU rule for `rec`, None) or (None, why Recursion.step runs):
    kernels/cpu/replay_rule.py, AdamW and Adam only."""
    if rec.optimizer not in ("adamw", "adam"):
        return None, f"no fused replay rule for {rec.optimizer}"
    from ..kernels.cpu import unavailable_reason

    why = unavailable_reason(device)
    if why is not None:
        return None, why
    return FusedAdamRule(rec), None


@lru_cache(maxsize=1 << 14)
def _adam_scalars(b1: float, b2: float, eps: float, since: int) -> np.ndarray:
    """FusedAdamRule.scalars, computed once per step for the shadow and every configuration
    of a replay (each step's host_scalars took ~3.5 us, more once a step's rows had pushed
    the interpreter out of the caches: per configuration and step, it was a few % of the
    demo's ~240 us). rules.step_scalars with lr = 1, wd = 0, on the host (packed_scalars)."""
    _, decay, step_size, inv_bc2_sqrt = rules.host_scalars(1.0, 0.0, b1, b2, since)
    betas = np.array([b1, 1.0 - b1, b2, 1.0 - b2], np.float32)  # each rounded once, as torch does
    return np.concatenate([betas, np.array([inv_bc2_sqrt, np.float32(eps), step_size, decay], np.float32)])


class FusedAdamRule:
    """step(g, x_hat, since, first) -> (direction, {"m": m, "v": v}), as Recursion.step, in
    one numba pass (kernels/cpu/replay_rule.adamw_rule) with the step's fp32 scalars."""

    def __init__(self, rec: Recursion):
        self.rec = rec
        self.b12 = tuple(float(b) for b in rec.hparams["betas"])
        self.eps = float(rec.hparams["eps"])

    def scalars(self, since: int) -> np.ndarray:
        """fp32 [b1, 1 - b1, b2, 1 - b2, inv_bc2_sqrt, eps, step_size, decay] of step `since`
        (read-only: shared by every rule of these betas and eps, _adam_scalars)."""
        return _adam_scalars(*self.b12, self.eps, since)

    def shadow_step(self, g: torch.Tensor, x: dict, since: int, unit: int, rows: tuple | None = None):
        """The fp32 shadow's step (step.step_shadow) in one pass: (direction, {"m", "v"},
        {"m", "v": per-unit sums of its square}, per-unit sums of the direction's square), the
        same bits as the step and its torch sums (kernels/cpu/replay_rule.adamw_shadow), written
        into rows (u, m, v, sums) where given; None where torch's sum order is not known."""
        from ..kernels.cpu.replay_rule import adamw_shadow  # numba on first use

        out = adamw_shadow(g, x["m"], x["v"], self.scalars(since), unit, rows)
        if out is None:
            return None
        u, m, v, sums = out
        return u, {"m": m, "v": v}, {"m": sums[0], "v": sums[1]}, sums[2]

    def step(self, g: torch.Tensor, x_hat: dict, since: int, first: dict):
        from ..kernels.cpu.replay_rule import adamw_rule  # numba on first use

        u, m, v = adamw_rule(g, x_hat["m"], x_hat["v"], self.scalars(since))
        return u, {"m": m, "v": v}
