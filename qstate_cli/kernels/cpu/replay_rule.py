"""The replay's fused update rule on CPU: AdamW/Adam's one step of both states and the
update direction (diagnose/recursions.Recursion.step) in one numba pass over the layout,
instead of ~15 torch ops each its own pass over memory.

    m = m_hat * b1 + g * (1 - b1)            v = v_hat * b2 + (g * g) * (1 - b2)
    u = (m / (sqrt_rn(v) * inv_bc2_sqrt + eps)) * step_size   (as -(0 * decay - ...))

op for op as optim.rules.adamw computes it with p = 0 (every constant rounded to fp32 as
torch rounds a Python scalar against an fp32 tensor; the square root in fp64 then rounded,
rules.sqrt_rn; fastmath off, so no FMA), so the states and the direction are bit for bit
the reference's and every record stays identical (tests/test_replay_rule_cpu.py). Other
optimizers keep Recursion.step. Threads: host.run_blocks over 4096-element ranges.
No numba at import: the kernel (replay_rule_kernel.py) is imported on first use.
"""
from __future__ import annotations

import numpy as np
import torch

from ...optim import rules
from . import unavailable_reason
from .host import run_blocks

CHUNK = 4096  # elements per run_blocks block (ranges of >= MIN_THREAD_ELEMENTS per thread)
_KERNEL: list = []


def _kernel(which: int = 0):
    if not _KERNEL:
        from .replay_rule_kernel import adamw_rule, update_products
        _KERNEL.extend([adamw_rule, update_products])
    return _KERNEL[which]


def update_products(u: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """fp32 [3, n]: u * ref, u * u, (u - ref)^2 per element in one pass (UpdateStats'
    products, each one fp32 op as torch's u * ref, u * u, d * d with d = u - ref)."""
    n = u.numel()
    for t in (u, ref):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n or t.device.type != "cpu":
            raise ValueError(f"update products need contiguous fp32 CPU tensors of {n} elements")
    out = torch.empty(3, n, dtype=torch.float32)
    run_blocks(_kernel(1), n, CHUNK, (u.numpy(), ref.numpy(), out.numpy(), CHUNK, n))
    return out


def fused_rule(rec, device) -> tuple["FusedAdamRule | None", str | None]:
    """(a fused rule for Recursion `rec`, None) or (None, why Recursion.step runs)."""
    if rec.optimizer not in ("adamw", "adam"):
        return None, f"no fused replay rule for {rec.optimizer}"
    why = unavailable_reason(device)
    if why is not None:
        return None, why
    return FusedAdamRule(rec), None


class FusedAdamRule:
    """step(g, x_hat, since, first) -> (direction, {"m": m, "v": v}), as Recursion.step."""

    def __init__(self, rec):
        self.rec = rec
        b1, b2 = self.b12 = tuple(float(b) for b in rec.hparams["betas"])
        self.betas = np.array([b1, 1.0 - b1, b2, 1.0 - b2], np.float32)  # each rounded once, as torch does
        self.eps = np.float32(float(rec.hparams["eps"]))
        self._scalars: dict[int, np.ndarray] = {}

    def scalars(self, since: int) -> np.ndarray:
        """fp32 [b1, 1 - b1, b2, 1 - b2, inv_bc2_sqrt, eps, step_size, decay] of step `since`."""
        sc = self._scalars.get(since)
        if sc is None:  # rules.step_scalars with lr = 1, wd = 0, on the host: the same fp32 values
            bc1, inv_bc2_sqrt = rules.bias_corrections(*self.b12, since)
            one = np.float32(1.0)
            sc = np.concatenate([self.betas, np.array([inv_bc2_sqrt, self.eps, one / np.float32(bc1),
                                                       one - one * np.float32(0.0)], np.float32)])
            self._scalars[since] = sc
        return sc

    def step(self, g: torch.Tensor, x_hat: dict, since: int, first: dict):
        n = g.numel()
        m_hat, v_hat = x_hat["m"], x_hat["v"]
        for t in (g, m_hat, v_hat):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n or t.device.type != "cpu":
                raise ValueError(f"the fused replay rule needs contiguous fp32 CPU tensors of {n} elements")
        u, m, v = (torch.empty(n, dtype=torch.float32) for _ in range(3))
        run_blocks(_kernel(), n, CHUNK, (g.numpy(), m_hat.numpy(), v_hat.numpy(), u.numpy(), m.numpy(), v.numpy(),
                                         self.scalars(since), CHUNK, n))
        return u, {"m": m, "v": v}
