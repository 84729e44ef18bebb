"""The replay's fused update rule on CPU: AdamW/Adam's one step of both states and the
update direction (diagnose/recursions.Recursion.step) in one numba pass over the layout,
instead of ~15 torch ops each its own pass over memory.

    m = m_hat * b1 + g * (1 - b1)            v = v_hat * b2 + (g * g) * (1 - b2)
    u = (m / (sqrt_rn(v) * inv_bc2_sqrt + eps)) * step_size   (as -(0 * decay - ...))

op for op as optim.rules.adamw computes it with p = 0 (every constant rounded to fp32 as
torch rounds a Python scalar against an fp32 tensor; the square root in fp64 then rounded,
rules.sqrt_rn; fastmath off, so no FMA), so the states and the direction are bit for bit
the reference's and every record stays identical (tests/test_replay_rule_cpu.py). The
per-step scalars come from the caller (diagnose/recursions.FusedAdamRule, which knows the
optimizer's rules); other optimizers keep Recursion.step. Threads: host.run_blocks over 4096-element ranges.
No numba at import: the kernel (replay_rule_kernel.py) is imported on first use.
"""
from __future__ import annotations

import numpy as np
import torch

from . import torch_sum
from .host import run_blocks

CHUNK = 4096  # elements per run_blocks block (ranges of >= MIN_THREAD_ELEMENTS per thread)
_KERNEL: list = []


def _kernel(which: int = 0):
    if not _KERNEL:
        from .replay_rule_kernel import adamw_rule, adamw_shadow, update_products, update_sums
        _KERNEL.extend([adamw_rule, update_products, update_sums, adamw_shadow])
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


def update_sums(u: torch.Tensor, ref: torch.Tensor, ref2_units: torch.Tensor, unit: int) -> torch.Tensor:
    """fp32 [4, n / unit]: UpdateStats' rows of one step, per unit: the sums of u * ref, u * u,
    (u - ref)^2 (update_products' products, summed in torch's order: torch_sum.py) and
    ref2_units, in one pass; where torch_sum.lanes() found no order, the products and
    torch's sums."""
    n = u.numel()
    lanes = torch_sum.lanes()
    if lanes is None:
        prod = update_products(u, ref)
        return torch.cat([prod.view(3, -1, unit).sum(2, dtype=torch.float32), ref2_units.view(1, -1)])
    for t in (u, ref):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n or t.device.type != "cpu":
            raise ValueError(f"update sums need contiguous fp32 CPU tensors of {n} elements")
    if n % unit or ref2_units.numel() != n // unit:
        raise ValueError(f"update sums of {n} elements in units of {unit} got {ref2_units.numel()} unit sums")
    sums = torch.empty(4, n // unit, dtype=torch.float32)
    sums[3] = ref2_units
    run_blocks(_kernel(2), n, unit, (u.numpy(), ref.numpy(), sums.numpy(), int(unit), lanes[0]))
    return sums


def adamw_shadow(g: torch.Tensor, m_hat: torch.Tensor, v_hat: torch.Tensor, sc: np.ndarray, unit: int,
                 out: tuple | None = None):
    """The fp32 shadow's step (diagnose/step.step_shadow) in one pass: (u, m, v) as adamw_rule
    gives them and fp32 [3, n / unit], per unit the sums of m * m, v * v and u * u, the bits of
    torch's (x * x).view(-1, unit).sum(1); None where torch_sum.lanes() found no order (the
    caller keeps the torch ops). out: the four tensors to write them into (contiguous, none of
    them an input), else new ones."""
    lanes = torch_sum.lanes()
    n = g.numel()
    if lanes is None or n % unit:
        return None
    for t in (g, m_hat, v_hat):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n or t.device.type != "cpu":
            raise ValueError(f"the fused shadow step needs contiguous fp32 CPU tensors of {n} elements")
    if out is None:
        out = tuple(torch.empty(n, dtype=torch.float32) for _ in range(3)) + (
            torch.empty(3, n // unit, dtype=torch.float32),)
    u, m, v, sums = out
    run_blocks(_kernel(3), n, unit, (g.numpy(), m_hat.numpy(), v_hat.numpy(), u.numpy(), m.numpy(), v.numpy(), sc,
                                     int(unit), lanes[0], sums.numpy()))
    return u, m, v, sums


def adamw_rule(g: torch.Tensor, m_hat: torch.Tensor, v_hat: torch.Tensor, sc: np.ndarray, out: tuple | None = None):
    """(u, m, v), fp32 [n] each: one pass of the AdamW rule over contiguous fp32 CPU tensors,
    sc = fp32 [b1, 1 - b1, b2, 1 - b2, inv_bc2_sqrt, eps, step_size, decay] (the caller's,
    diagnose/recursions.FusedAdamRule: the values rules.step_scalars gives); written into
    `out` = (u, m, v) where given (contiguous fp32 of n elements, none of them an input)."""
    n = g.numel()
    for t in (g, m_hat, v_hat):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n or t.device.type != "cpu":
            raise ValueError(f"the fused replay rule needs contiguous fp32 CPU tensors of {n} elements")
    u, m, v = out if out is not None else (torch.empty(n, dtype=torch.float32) for _ in range(3))
    run_blocks(_kernel(), n, CHUNK, (g.numpy(), m_hat.numpy(), v_hat.numpy(), u.numpy(), m.numpy(), v.numpy(),
                                     sc, CHUNK, n))
    return u, m, v
