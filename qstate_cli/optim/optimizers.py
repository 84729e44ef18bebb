"""Drop-in optimizers with quantized states: AdamW (and Adam), Lion, SGD, Muon.

    opt = qstate_cli.optim.AdamW(model.parameters(), lr=1e-3, states="bred-4bit", reset=None)

`states` is a preset or configuration name (quant/config.py); `reset` a reset policy
(optim/reset.py). The update rules are the full-precision ones (optim/rules.py); only
the stored states change.
"""
from __future__ import annotations

from .base import QuantizedOptimizer
from . import rules


class AdamW(QuantizedOptimizer):
    """AdamW with quantized m and v. `decoupled=False` gives Adam (L2 added to g)."""

    state_names = ("m", "v")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 states="bred-4bit", reset=None, seed=0, min_quant_numel=4096, decoupled=True,
                 backend="auto"):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decoupled=decoupled)
        super().__init__(params, defaults, states, reset, seed, min_quant_numel, backend)

    def update(self, group, p32, g, x_hat, since_reset, first):
        beta1, beta2 = group["betas"]
        wd = group["weight_decay"]
        if not group["decoupled"] and wd:
            g = g + p32 * wd
            wd = 0.0
        s = rules.step_scalars(group["lr"], wd, beta1, beta2, since_reset, p32.device)
        p, m, v = rules.adamw(p32, g, x_hat["m"], x_hat["v"], s, beta1, beta2, group["eps"])
        return p, {"m": m, "v": v}


class Adam(AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kw):
        super().__init__(params, lr, betas, eps, weight_decay, decoupled=False, **kw)


class Lion(QuantizedOptimizer):
    """Lion with a quantized momentum m."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0,
                 states="bred-4bit", reset=None, seed=0, min_quant_numel=4096, backend="auto"):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults, states, reset, seed, min_quant_numel, backend)

    def update(self, group, p32, g, x_hat, since_reset, first):
        beta1, beta2 = group["betas"]
        s = rules.step_scalars(group["lr"], group["weight_decay"], beta1, beta2, since_reset, p32.device)
        p, m = rules.lion(p32, g, x_hat["m"], s, beta1, beta2)
        return p, {"m": m}


class SGD(QuantizedOptimizer):
    """SGD with a quantized momentum buffer (torch.optim.SGD semantics)."""

    beta_for_reset = "momentum"

    def __init__(self, params, lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                 states="bred-4bit", reset=None, seed=0, min_quant_numel=4096, backend="auto"):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov)
        super().__init__(params, defaults, states, reset, seed, min_quant_numel, backend)

    def update(self, group, p32, g, x_hat, since_reset, first):
        if group["weight_decay"]:
            g = g + p32 * group["weight_decay"]
        s = rules.step_scalars(group["lr"], 0.0, 0.0, 0.0, 1, p32.device)
        p, buf = rules.sgd(p32, g, x_hat["m"], s, group["momentum"], group["dampening"],
                           group["nesterov"], first["m"])
        return p, {"m": buf}


class Muon(QuantizedOptimizer):
    """Muon with a quantized momentum buffer: Newton-Schulz orthogonalized updates on
    parameters with >= 2 dimensions (flattened to (rows, -1)); 1-D parameters take the
    momentum update itself (route them to AdamW, as usual with Muon)."""

    beta_for_reset = "momentum"

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 states="bred-4bit", reset=None, seed=0, min_quant_numel=4096, backend="auto"):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
        super().__init__(params, defaults, states, reset, seed, min_quant_numel, backend)

    def update(self, group, p32, g, x_hat, since_reset, first):
        s = rules.step_scalars(group["lr"], group["weight_decay"], 0.0, 0.0, 1, p32.device)
        upd, buf = rules.muon_momentum(g, x_hat["m"], group["momentum"], group["nesterov"])
        p = p32 * s.decay - rules.muon_direction(upd) * s.lr
        return p, {"m": buf}


OPTIMIZERS = {"adamw": AdamW, "adam": Adam, "lion": Lion, "sgd": SGD, "muon": Muon}
