"""Synthetic traces with known gradient laws, for tests and for checking the staleness
model against what its assumptions say (no training, seeded, in memory).

    gaussian(n, steps)          g ~ N(0, 1) i.i.d.: the model's own assumption
    heavy_tailed(n, steps)      g = sigma_t * t_df / sd(t_df): Student-t tails (kurtosis
                                3 + 6 / (df - 4) for df > 4, infinite below), unit variance
                                at sigma_t = 1, and sigma_t^2 falling `decay`-fold over the
                                run, geometrically (what a fine-tune's gradients do)
    with_dead_blocks(trace, k)  the first k 2048-element blocks of the first tensor zeroed
                                at every step (an embedding's unused rows)

Every trace is one fp32 tensor "w" of n elements (n a multiple of 2048) and an AdamW
optimizer with the given betas.
"""
from __future__ import annotations

import math

import torch

from .schema import BLOCK, Trace, TraceTensor


def _trace(grads: torch.Tensor, beta1: float, beta2: float, name: str = "w") -> Trace:
    steps, n = grads.shape
    t = TraceTensor(name, 0, (n,), torch.arange(-(-n // BLOCK)), grads.contiguous())
    return Trace("adamw", {"betas": [beta1, beta2], "eps": 1e-8}, 0, 1, steps, "fp32", [t],
                 {"source": "qstate_cli.trace.synthetic"})


def gaussian(n: int, steps: int, beta1: float = 0.9, beta2: float = 0.999, seed: int = 0) -> Trace:
    """i.i.d. N(0, 1) gradients."""
    gen = torch.Generator().manual_seed(seed)
    return _trace(torch.randn(steps, n, generator=gen), beta1, beta2)


def heavy_tailed(n: int, steps: int, df: float = 3.0, decay: float = 10.0, beta1: float = 0.9,
                 beta2: float = 0.999, seed: int = 0) -> Trace:
    """Student-t gradients (df > 2) of unit variance times sigma_t, sigma_t^2 = decay^(-t / steps)."""
    if df <= 2:
        raise ValueError("df must be > 2 (finite variance)")
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(steps, n, generator=gen)
    chi2 = torch.distributions.Chi2(torch.tensor(float(df)))
    torch.manual_seed(seed)  # Chi2.sample draws from the global generator
    t = z / torch.sqrt(chi2.sample((steps, n)) / df)
    t = t / math.sqrt(df / (df - 2))
    sigma = decay ** (-0.5 * torch.arange(steps, dtype=torch.float32) / steps)
    return _trace(t * sigma[:, None], beta1, beta2)


def with_dead_blocks(trace: Trace, k: int) -> Trace:
    """The trace with the first k blocks of its first tensor zero at every step."""
    grads = trace.tensors[0].grads.clone()
    grads[:, : k * BLOCK] = 0.0
    t0 = trace.tensors[0]
    tensors = [TraceTensor(t0.name, t0.index, t0.shape, t0.blocks, grads, t0.init)] + trace.tensors[1:]
    return Trace(trace.optimizer, trace.hparams, trace.seed, trace.step_start, trace.n_steps, trace.grad_dtype,
                 tensors, dict(trace.meta))
