"""Drop-in optimizers with quantized states: AdamW (and Adam), Lion, SGD, Muon.

    opt = qstate_cli.optim.AdamW(model.parameters(), lr=1e-3, states="bred-4bit", reset=None)

`states` is a preset or configuration name (quant/config.py) or a StateConfig; `reset` a
reset policy (optim/reset.py). The update rules are the full-precision ones
(optim/rules.py); only the stored states change. Per optimizer, one rule in three uses:

    update        the reference step of one parameter
    launch_kernel the fused step of many with the kernel's launch function (`run.launch`,
                  kernels/<kernel>.py via optim/fused.py), the same rule op for op
    replay_step   the state recursion a trace replay runs (diagnose/recursions.py): the
                  rule with a zero parameter, lr = 1 and no weight decay, so the new
                  states are bit for bit the reference's and the parameter update is
                  minus the update direction (states never depend on p, lr or decoupled
                  weight decay)

`state_betas(hp)` names the EMA beta that sets each state's memory (theory, resets).
The registry of all of them is optim/registry.py.
"""
from __future__ import annotations

import torch

from ..errors import QstateError
from . import rules
from .base import QuantizedOptimizer


class AdamW(QuantizedOptimizer):
    """AdamW with quantized m and v. `decoupled=False` gives Adam (L2 added to g)."""

    state_names = ("m", "v")
    kernel = "adamw"
    elementwise = True  # `update` is elementwise: chunks, shards, tensors laid end to end (optim/rule_traits.py)
    # m an EMA of g (beta1), v an EMA of g^2 (beta2), bias-corrected: diagnose's Gaussian staleness
    # model (sigma^2 = v / c_t), theory.py's stall curve of v and the reset advice apply (Adam too)
    adam_moments = True

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

    @staticmethod
    def state_betas(hp: dict) -> dict[str, float]:
        return {"m": float(hp["betas"][0]), "v": float(hp["betas"][1])}

    @staticmethod
    def replay_step(hp: dict, g, x_hat: dict, s: rules.Scalars, first: dict):
        """direction = (m / (sqrt(v) / sqrt(bc2) + eps)) / bc1; new m, v."""
        b1, b2 = (float(b) for b in hp["betas"])
        p, m, v = rules.adamw(_zero(g), g, x_hat["m"], x_hat["v"], s, b1, b2, float(hp["eps"]))
        return -p, {"m": m, "v": v}

    @staticmethod
    def replay_notes(hp: dict) -> list[str]:
        notes = []
        if hp.get("weight_decay") and not hp.get("decoupled", True):
            notes.append("Adam's coupled weight decay (g + wd * p) needs the parameters: replayed without it")
        if hp.get("amsgrad"):
            notes.append("amsgrad's running max of v is not replayed (plain Adam states)")
        return notes

    def launch_kernel(self, group, batch, run):
        beta1, beta2 = group["betas"]
        s, l2 = self.kernel_scalars(group, run.since, run.device)
        run.launch(batch, s, run.layouts["m"], run.layouts["v"], p_kind=run.p_kind, g_kind=run.g_kind,
                   step=run.step, written=(run.written["m"], run.written["v"]),
                   fresh=(run.fresh["m"], run.fresh["v"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                   l2_wd=l2, tables=(run.tables["m"], run.tables["v"]))

    @staticmethod
    def kernel_scalars(group, since: int, device) -> tuple:
        """(rules.packed_scalars of this step, Adam's coupled decay l2 or 0.0): what the
        kernels read (AdamW decays the parameter: wd in the scalars; Adam adds p * l2 to g)."""
        beta1, beta2 = group["betas"]
        wd, l2 = group["weight_decay"], 0.0
        if not group["decoupled"] and wd:
            wd, l2 = 0.0, wd
        return rules.packed_scalars(group["lr"], wd, beta1, beta2, since, device), l2

    def one_pass_rule(self) -> str | None:
        return "adamw" if self._own_rule(AdamW) else None  # kernels/cpu/elementwise.adamw_step


class Adam(AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kw):
        super().__init__(params, lr, betas, eps, weight_decay, decoupled=False, **kw)

    @staticmethod
    def replay_notes(hp: dict) -> list[str]:
        return AdamW.replay_notes({"decoupled": False, **hp})


class Lion(QuantizedOptimizer):
    """Lion with a quantized momentum m."""

    kernel = "lion"
    elementwise = True  # `update` is elementwise: chunks, shards, tensors laid end to end (optim/rule_traits.py)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0,
                 states="bred-4bit", reset=None, seed=0, min_quant_numel=4096, backend="auto"):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults, states, reset, seed, min_quant_numel, backend)

    def update(self, group, p32, g, x_hat, since_reset, first):
        beta1, beta2 = group["betas"]
        s = rules.step_scalars(group["lr"], group["weight_decay"], beta1, beta2, since_reset, p32.device)
        p, m = rules.lion(p32, g, x_hat["m"], s, beta1, beta2)
        return p, {"m": m}

    @staticmethod
    def state_betas(hp: dict) -> dict[str, float]:
        return {"m": float(hp["betas"][1])}  # beta2 drives the stored momentum

    @staticmethod
    def replay_step(hp: dict, g, x_hat: dict, s: rules.Scalars, first: dict):
        """direction = sign(b1 m_hat + (1 - b1) g); new m."""
        b1, b2 = (float(b) for b in hp["betas"])
        p, m = rules.lion(_zero(g), g, x_hat["m"], s, b1, b2)
        return -p, {"m": m}

    def one_pass_rule(self) -> str | None:
        return "lion" if self._own_rule(Lion) else None  # kernels/cpu/elementwise.momentum_step

    @staticmethod
    def kernel_scalars(group, since: int, device):
        """rules.packed_scalars of this step: what the kernels read (lr, decay = 1 - lr * wd)."""
        beta1, beta2 = group["betas"]
        return rules.packed_scalars(group["lr"], group["weight_decay"], beta1, beta2, since, device)

    def pass_arguments(self, group, since: int) -> dict:
        """kernels/cpu/elementwise.momentum_step's arguments of this step (as launch_kernel's)."""
        beta1, beta2 = (float(b) for b in group["betas"])
        return dict(scalars=self.kernel_scalars(group, since, "cpu"), hyper=(beta1, 1.0 - beta1, beta2, 1.0 - beta2),
                    nesterov=False, use_wd=False)

    def launch_kernel(self, group, batch, run):
        beta1, beta2 = group["betas"]
        s = self.kernel_scalars(group, run.since, run.device)
        run.launch(batch, s, run.layouts["m"], p_kind=run.p_kind, g_kind=run.g_kind,
                   step=run.step, written=run.written["m"], fresh=run.fresh["m"], beta1=beta1, beta2=beta2,
                   table=run.tables["m"])


class SGD(QuantizedOptimizer):
    """SGD with a quantized momentum buffer (torch.optim.SGD semantics)."""

    kernel = "sgd"
    elementwise = True  # `update` is elementwise: chunks, shards, tensors laid end to end (optim/rule_traits.py)

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

    @staticmethod
    def state_betas(hp: dict) -> dict[str, float]:
        return {"m": float(hp["momentum"])}

    @staticmethod
    def replay_step(hp: dict, g, x_hat: dict, s: rules.Scalars, first: dict):
        """direction d (torch.optim.SGD semantics); new momentum buffer."""
        p, buf = rules.sgd(_zero(g), g, x_hat["m"], s, float(hp["momentum"]), float(hp["dampening"]),
                           bool(hp["nesterov"]), first["m"])
        return -p, {"m": buf}

    @staticmethod
    def replay_notes(hp: dict) -> list[str]:
        if float(hp["momentum"]) == 0.0:
            raise QstateError("SGD without momentum keeps no state: nothing to diagnose")
        if hp.get("weight_decay"):
            return ["SGD's coupled weight decay needs the parameters: replayed without it"]
        return []

    def one_pass_rule(self) -> str | None:
        return "sgd" if self._own_rule(SGD) else None  # kernels/cpu/elementwise.momentum_step

    def pass_arguments(self, group, since: int) -> dict:
        """kernels/cpu/elementwise.momentum_step's arguments of this step (as launch_kernel's)."""
        wd = float(group["weight_decay"])
        return dict(scalars=rules.packed_scalars(group["lr"], 0.0, 0.0, 0.0, 1, "cpu"),
                    hyper=(float(group["momentum"]), 1.0 - float(group["dampening"]), wd, 0.0),
                    nesterov=bool(group["nesterov"]), use_wd=wd != 0.0)

    def launch_kernel(self, group, batch, run):
        s = rules.packed_scalars(group["lr"], 0.0, 0.0, 0.0, 1, run.device)
        run.launch(batch, s, run.layouts["m"], p_kind=run.p_kind, g_kind=run.g_kind,
                   step=run.step, written=run.written["m"], fresh=run.fresh["m"],
                   momentum=group["momentum"], dampening=group["dampening"],
                   weight_decay=group["weight_decay"], nesterov=group["nesterov"], table=run.tables["m"])


class Muon(QuantizedOptimizer):
    """Muon with a quantized momentum buffer: Newton-Schulz orthogonalized updates on
    parameters with >= 2 dimensions (flattened to (rows, -1)); 1-D parameters take the
    momentum update itself (route them to AdamW, as usual with Muon). On the kernel path
    the momentum update is fused (kernels/muon.py, all tensors in one launch); the
    Newton-Schulz iteration and the parameter update run in torch per matrix. States no
    kernel takes step together (optim/small.py, `update_flat`): the momentum in one pass,
    Newton-Schulz per matrix."""

    kernel = "muon"
    kernel_needs_out = True
    # not `elementwise`: Newton-Schulz needs whole matrices (no DTensor shards; its own update_flat)
    later_hparams = dict(ns_steps=5, ns_coefficients=rules.NS_COEFFS, eps=1e-7, adjust_lr_fn=None)  # 2026-12-07

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 ns_steps=5, ns_coefficients=rules.NS_COEFFS, eps=1e-7, adjust_lr_fn=None,
                 states="bred-4bit", reset=None, seed=0, min_quant_numel=4096, backend="auto"):
        """ns_steps, ns_coefficients, eps, adjust_lr_fn: torch.optim.Muon's (rules.newton_schulz,
        rules.muon_lr_ratio); the iteration runs in fp32 here, in bf16 in torch."""
        rules.check_newton_schulz(ns_steps, ns_coefficients, eps, adjust_lr_fn)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
                        ns_coefficients=tuple(float(k) for k in ns_coefficients), eps=eps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults, states, reset, seed, min_quant_numel, backend)

    @staticmethod
    def direction(group, upd: torch.Tensor) -> torch.Tensor:
        """rules.muon_direction under the group's Newton-Schulz settings."""
        return rules.muon_direction(upd, group["ns_steps"], group["eps"], group["ns_coefficients"],
                                    group["adjust_lr_fn"])

    def update(self, group, p32, g, x_hat, since_reset, first):
        s = rules.step_scalars(group["lr"], group["weight_decay"], 0.0, 0.0, 1, p32.device)
        upd, buf = rules.muon_momentum(g, x_hat["m"], group["momentum"], group["nesterov"])
        p = p32 * s.decay - self.direction(group, upd) * s.lr
        return p, {"m": buf}

    def update_flat(self, group, shapes, p32, g, x_hat, since_reset, first):
        """The momentum over the tensors laid end to end (it is elementwise), the direction per
        tensor (Newton-Schulz on each >= 2-D tensor's own update, copied out of the flat one
        into a tensor of its own, as `update` has it), then the parameter update, elementwise."""
        upd, buf = rules.muon_momentum(g, x_hat["m"], group["momentum"], group["nesterov"])
        return self.apply_flat(group, shapes, p32, upd), {"m": buf}

    def apply_flat(self, group, shapes, p32, upd):
        """The new parameters (flat fp32) of the flat momentum update `upd`: p * decay -
        direction * lr, the direction Newton-Schulz of each >= 2-D tensor's part of upd."""
        s = rules.step_scalars(group["lr"], group["weight_decay"], 0.0, 0.0, 1, p32.device)
        if any(len(shape) >= 2 for shape in shapes):
            parts = upd.split([shape.numel() for shape in shapes])
            upd = torch.cat([self.direction(group, u.view(shape).clone()).reshape(-1) if len(shape) >= 2 else u
                             for u, shape in zip(parts, shapes)])
        return p32 * s.decay - upd * s.lr

    def one_pass_rule(self) -> str | None:
        """"muon": the momentum in kernels/cpu/elementwise.momentum_step, then apply_flat."""
        return "muon" if self._own_rule(Muon) and type(self).apply_flat is Muon.apply_flat else None

    def pass_arguments(self, group, since: int) -> dict:
        """kernels/cpu/elementwise.momentum_step's arguments of this step (as launch_kernel's)."""
        mu = float(group["momentum"])
        return dict(scalars=rules.packed_scalars(group["lr"], group["weight_decay"], 0.0, 0.0, 1, "cpu"),
                    hyper=(mu, 1.0 - mu, 0.0, 0.0), nesterov=bool(group["nesterov"]), use_wd=False)

    @staticmethod
    def state_betas(hp: dict) -> dict[str, float]:
        return {"m": float(hp["momentum"])}

    @staticmethod
    def replay_step(hp: dict, g, x_hat: dict, s: rules.Scalars, first: dict):
        """direction = the Nesterov/plain momentum update before Newton-Schulz (which needs
        whole matrices); new momentum buffer."""
        upd, buf = rules.muon_momentum(g, x_hat["m"], float(hp["momentum"]), bool(hp["nesterov"]))
        return upd, {"m": buf}

    @staticmethod
    def replay_notes(hp: dict) -> list[str]:
        return ["Muon: update fidelity compares momentum updates before Newton-Schulz"]

    def launch_kernel(self, group, batch, run):
        run.launch(batch, run.layouts["m"], g_kind=run.g_kind, step=run.step,
                   written=run.written["m"], fresh=run.fresh["m"], momentum=group["momentum"],
                   nesterov=group["nesterov"], table=run.tables["m"])
        s = rules.step_scalars(group["lr"], group["weight_decay"], 0.0, 0.0, 1, run.device)
        for p, member in zip(run.params, run.members):
            p32 = p.detach().to(torch.float32)
            p.copy_(p32 * s.decay - self.direction(group, member.out) * s.lr)



def _zero(g: torch.Tensor) -> torch.Tensor:
    """The parameter a replay step runs the rule on (see module docstring)."""
    return torch.zeros((), dtype=torch.float32, device=g.device)
