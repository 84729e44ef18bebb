"""The optimizer state recursions a replay runs, taken from `optim.rules` unchanged.

Each recursion maps (gradient g, states read back x_hat, steps since reset, first-step
flags) to (update direction, new fp32 states) by calling the reference rule with a zero
parameter, lr = 1 and no weight decay: the rule's parameter update is then exactly
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
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import QstateError
from ..optim import rules

SUPPORTED = ("adamw", "adam", "lion", "sgd", "muon")


@dataclass
class Recursion:
    optimizer: str
    hparams: dict
    states: tuple[str, ...]
    betas: dict  # state -> the EMA beta that sets its memory (theory, reset periods)
    notes: list = field(default_factory=list)
    _scalars: dict = field(default_factory=dict)

    @property
    def slowest_state(self) -> str:
        """The state with the longest memory (largest beta): v for Adam, m otherwise."""
        return max(self.states, key=lambda s: self.betas[s])

    def scalars(self, since: int, device) -> rules.Scalars:
        key = (since, str(device))
        if key not in self._scalars:
            b1, b2 = self._b1b2()
            self._scalars[key] = rules.step_scalars(1.0, 0.0, b1, b2, since, device)
        return self._scalars[key]

    def _b1b2(self) -> tuple[float, float]:
        betas = self.hparams.get("betas", (0.9, 0.999))
        return float(betas[0]), float(betas[1])

    def step(self, g: torch.Tensor, x_hat: dict, since: int, first: dict):
        """(direction, {state: new fp32 state}) for one step; see module docstring."""
        zero = torch.zeros((), dtype=torch.float32, device=g.device)
        hp = self.hparams
        if self.optimizer in ("adamw", "adam"):
            b1, b2 = self._b1b2()
            p, m, v = rules.adamw(zero, g, x_hat["m"], x_hat["v"], self.scalars(since, g.device), b1, b2,
                                  float(hp.get("eps", 1e-8)))
            return -p, {"m": m, "v": v}
        if self.optimizer == "lion":
            b1, b2 = self._b1b2()
            p, m = rules.lion(zero, g, x_hat["m"], self.scalars(since, g.device), b1, b2)
            return -p, {"m": m}
        if self.optimizer == "sgd":
            p, buf = rules.sgd(zero, g, x_hat["m"], self.scalars(1, g.device), float(hp.get("momentum", 0.0)),
                               float(hp.get("dampening", 0.0)), bool(hp.get("nesterov", False)), first["m"])
            return -p, {"m": buf}
        upd, buf = rules.muon_momentum(g, x_hat["m"], float(hp.get("momentum", 0.95)), bool(hp.get("nesterov", True)))
        return upd, {"m": buf}


def recursion_for(optimizer: str, hparams: dict) -> Recursion:
    """The recursion of a traced optimizer, with notes on what the replay leaves out."""
    name = optimizer.lower()
    if name not in SUPPORTED:
        raise QstateError(f"optimizer {optimizer!r} is not supported by the replay; supported: {', '.join(SUPPORTED)}")
    hp = dict(hparams)
    notes = []
    if name in ("adamw", "adam"):
        betas = hp.get("betas", (0.9, 0.999))
        rec = Recursion(name, hp, ("m", "v"), {"m": float(betas[0]), "v": float(betas[1])}, notes)
        if name == "adam" and hp.get("weight_decay") and not hp.get("decoupled", False):
            notes.append("Adam's coupled weight decay (g + wd * p) needs the parameters: replayed without it")
        if hp.get("amsgrad"):
            notes.append("amsgrad's running max of v is not replayed (plain Adam states)")
    elif name == "lion":
        betas = hp.get("betas", (0.9, 0.99))
        rec = Recursion(name, hp, ("m",), {"m": float(betas[1])}, notes)
    else:
        mom = float(hp.get("momentum", 0.9 if name == "sgd" else 0.95))
        if name == "sgd" and mom == 0.0:
            raise QstateError("SGD without momentum keeps no state: nothing to diagnose")
        rec = Recursion(name, hp, ("m",), {"m": mom}, notes)
        if name == "sgd" and hp.get("weight_decay"):
            notes.append("SGD's coupled weight decay needs the parameters: replayed without it")
        if name == "muon":
            notes.append("Muon: update fidelity compares momentum updates before Newton-Schulz")
    return rec
