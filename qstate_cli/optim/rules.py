"""The update rules, written once, in fp32, exactly as the Triton kernels compute them.

Each rule takes the parameter p (fp32), the gradient g (fp32, non-finite elements
already zeroed), the states read back from storage (x_hat) and the step scalars, and
returns the new parameter and the new fp32 states (which the caller then quantizes).
The parameter update uses the fp32 states *before* quantization, as bitsandbytes and
torchao do; only what is stored is quantized.

All scalar factors come from `step_scalars`: the bias corrections 1 - beta**t from the
host step counter (float64, then rounded once to fp32), everything that involves lr with
torch fp32 ops on the parameter's device (lr may be a device tensor). The kernels read
these very fp32 numbers from device memory, so an LR schedule causes no recompilation
and no host sync, and reference and kernels agree bit for bit.

Every `/` and sqrt is correctly rounded fp32 on every device (quant.quantizer.sqrt_rn;
tensor / tensor, never tensor / python-number, which CUDA turns into a multiply by the
reciprocal), and no product is fused into an FMA; the kernels do the same ops in the
same order (`tl.math.div_rn`, `tl.sqrt_rn`, launched with enable_fp_fusion=False).

EMA recursion (BRIEF §2): x = beta * x_hat + (1 - beta) * f(g), f(g) = g (m), g*g (v).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..errors import clip
from ..quant.quantizer import sqrt_rn


@dataclass
class Scalars:
    """fp32 0-dim tensors (or floats) that one step of a rule needs."""

    lr: torch.Tensor
    decay: torch.Tensor  # 1 - lr * weight_decay (decoupled weight decay)
    step_size: torch.Tensor  # AdamW: lr / (1 - beta1**t)
    inv_bc2_sqrt: torch.Tensor  # AdamW: 1 / sqrt(1 - beta2**t)


def f32(x, device) -> torch.Tensor:
    """x as a 0-dim fp32 tensor on device; a Python number is written by a fill kernel
    (no host-to-device copy, so no sync), a tensor (a scheduled lr) is used as is."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(x), dtype=torch.float32, device=device)


def fp32_round(x: float) -> float:
    """The fp32 value nearest to a Python float (round to nearest even)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def bias_corrections(beta1: float, beta2: float, t: int) -> tuple[float, float]:
    """(1 - beta1**t, 1 / sqrt(1 - beta2**t)) as fp32 values, each computed in float64 on
    the host and rounded once."""
    bc1 = fp32_round(1.0 - float(beta1) ** int(t))
    bc2 = 1.0 - float(beta2) ** int(t)
    return bc1, fp32_round(1.0 / math.sqrt(bc2)) if bc2 > 0 else math.inf


def step_scalars(lr, weight_decay: float, beta1: float, beta2: float, t: int, device) -> Scalars:
    """Scalars for step t (t = steps since the last reset, >= 1), fp32 on device.

    decay = 1 - lr * wd;  step_size = lr / (1 - beta1**t);  inv_bc2_sqrt = 1 / sqrt(1 - beta2**t)
    """
    bc1, inv_bc2_sqrt = bias_corrections(beta1, beta2, t)
    return Scalars(*_scalar_ops(f32(lr, device), f32(weight_decay, device), f32(bc1, device),
                                f32(inv_bc2_sqrt, device), 1.0))


def _scalar_ops(lr, wd, bc1, inv_bc2_sqrt, one):
    """(lr, one - lr * wd, lr / bc1, inv_bc2_sqrt): step_scalars' fp32 ops, once, on fp32 0-dim
    tensors (one = 1.0) or on numpy float32 scalars (one = np.float32(1)): IEEE fp32 products,
    differences and correctly rounded quotients either way, so the same bits."""
    return lr, one - lr * wd, lr / bc1, inv_bc2_sqrt


def pack_scalars(s: Scalars) -> torch.Tensor:
    """[lr, decay, step_size, inv_bc2_sqrt] as one fp32 tensor: what the kernels read."""
    return torch.stack([s.lr, s.decay, s.step_size, s.inv_bc2_sqrt])


def packed_scalars(lr, weight_decay: float, beta1: float, beta2: float, t: int, device) -> torch.Tensor:
    """pack_scalars(step_scalars(...)), the same fp32 numbers. For a number lr on the CPU they
    are computed as numpy float32 scalars into one tensor: the ~10 torch ops of step_scalars
    cost a CPU step ~0.3 ms once a step's data has pushed the interpreter out of the caches
    (docs/cpu.md, "Step overhead"); a tensor lr or another device keeps the torch ops."""
    if isinstance(lr, torch.Tensor) or torch.device(device).type != "cpu":
        return pack_scalars(step_scalars(lr, weight_decay, beta1, beta2, t, device))
    return torch.from_numpy(host_scalars(lr, weight_decay, beta1, beta2, t))


def host_scalars(lr: float, weight_decay: float, beta1: float, beta2: float, t: int) -> np.ndarray:
    """packed_scalars of a number lr as fp32 numpy [lr, decay, step_size, inv_bc2_sqrt]
    (a new array; the numbers computed once per distinct inputs: a step's launches share them)."""
    key = (float(lr), math.copysign(1.0, lr), float(weight_decay), math.copysign(1.0, weight_decay),
           float(beta1), float(beta2), int(t))  # the signs: -0.0 == 0.0 as a key
    return np.array(_host_scalars(key), dtype=np.float32)


@lru_cache(maxsize=64)
def _host_scalars(key: tuple) -> tuple:
    lr, _, weight_decay, _, beta1, beta2, t = key
    bc1, inv_bc2_sqrt = bias_corrections(beta1, beta2, t)
    with np.errstate(all="ignore"):  # torch's inf and nan, without numpy's warnings
        return _scalar_ops(np.float32(lr), np.float32(weight_decay), np.float32(bc1), np.float32(inv_bc2_sqrt),
                           np.float32(1.0))


def ema(x_hat: torch.Tensor, target: torch.Tensor, beta: float) -> torch.Tensor:
    """beta * x_hat + (1 - beta) * target, as two fp32 products and one sum."""
    return x_hat * beta + target * (1.0 - beta)


def adamw(p, g, m_hat, v_hat, s: Scalars, beta1: float, beta2: float, eps: float):
    """AdamW (Loshchilov & Hutter): decoupled decay, bias-corrected Adam step.

    m = b1 m_hat + (1-b1) g;  v = b2 v_hat + (1-b2) g^2
    p <- p * (1 - lr wd) - (lr / bc1) * m / (sqrt(v) * (1 / sqrt(bc2)) + eps)
    (1 / sqrt(bc2) is a host scalar: one division per element, m / denom, not two)
    """
    m = ema(m_hat, g, beta1)
    v = ema(v_hat, g * g, beta2)
    denom = sqrt_rn(v) * s.inv_bc2_sqrt + eps
    p = p * s.decay - (m / denom) * s.step_size
    return p, m, v


def lion(p, g, m_hat, s: Scalars, beta1: float, beta2: float):
    """Lion (Chen et al. 2023): p <- p (1 - lr wd) - lr sign(b1 m + (1-b1) g);
    m = b2 m_hat + (1-b2) g."""
    c = ema(m_hat, g, beta1)
    p = p * s.decay - torch.sign(c) * s.lr
    m = ema(m_hat, g, beta2)
    return p, m


def sgd(p, g, m_hat, s: Scalars, momentum: float, dampening: float, nesterov: bool, first: bool):
    """SGD with momentum, torch.optim.SGD semantics (coupled weight decay is applied to g
    by the caller): buf = mu buf_hat + (1 - dampening) g (buf = g at the first step);
    d = g + mu buf (Nesterov) or buf;  p <- p - lr d."""
    buf = g.clone() if first else m_hat * momentum + g * (1.0 - dampening)
    d = g + buf * momentum if nesterov else buf
    return p - d * s.lr, buf


def muon_momentum(g, m_hat, beta: float, nesterov: bool):
    """Muon's momentum (Jordan et al. 2024): buf = b buf_hat + (1-b) g;
    update = (1-b) g + b buf (Nesterov) or buf. Returns (update, buf)."""
    buf = ema(m_hat, g, beta)
    upd = g * (1.0 - beta) + buf * beta if nesterov else buf
    return upd, buf


NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=NS_COEFFS) -> torch.Tensor:
    """Approximately orthogonalize a 2-D matrix with `steps` rounds of the quintic
    Newton-Schulz iteration X <- aX + (b A + c A^2) X, A = X X^T, from X = G / (|G|_F + eps),
    in fp32 ((a, b, c) = coefficients; Muon's from Jordan et al.). torch.optim.Muon runs the
    same iteration in bf16."""
    a, b, c = (float(k) for k in coefficients)
    x = g.to(torch.float32)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.T if transposed else x


MUON_LR_ADJUSTMENTS = ("original", "match_rms_adamw")


def muon_lr_ratio(rows: int, cols: int, adjust_lr_fn: str | None = None) -> float:
    """The factor on lr for a (rows, cols) matrix (torch.optim.Muon's adjust_lr_fn):
    "original" (None) sqrt(max(1, rows / cols)); "match_rms_adamw" 0.2 sqrt(max(rows, cols)),
    which makes the update's RMS about AdamW's (Liu et al. 2025)."""
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * max(rows, cols) ** 0.5
    return max(1.0, rows / cols) ** 0.5


def check_newton_schulz(ns_steps, coefficients, eps, adjust_lr_fn) -> None:
    """ValueError (as torch.optim.Muon raises) for settings no Muon step can run with."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps {clip(repr(ns_steps))}: must be a whole number in [0, 100)")
    if (isinstance(coefficients, (str, bytes)) or not hasattr(coefficients, "__len__") or len(coefficients) != 3
            or not all(isinstance(k, (int, float)) and not isinstance(k, bool) and math.isfinite(k)
                       for k in coefficients)):
        raise ValueError(f"ns_coefficients {clip(repr(coefficients))}: must be three finite numbers (a, b, c)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"eps {clip(repr(eps))}: must be a finite number > 0")
    if adjust_lr_fn is not None and adjust_lr_fn not in MUON_LR_ADJUSTMENTS:
        raise ValueError(f"adjust_lr_fn {clip(repr(adjust_lr_fn))}: must be one of {', '.join(MUON_LR_ADJUSTMENTS)} or None")


def muon_direction(upd: torch.Tensor, ns_steps: int = 5, eps: float = 1e-7, coefficients=NS_COEFFS,
                   adjust_lr_fn: str | None = None) -> torch.Tensor:
    """Orthogonalized update for a >= 2-D parameter (flattened to (rows, -1)), times
    muon_lr_ratio(rows, cols, adjust_lr_fn); 1-D parameters keep the momentum update itself, and
    an empty one (a (0, 5) weight) is its own: there is nothing to orthogonalize (torch.optim.Muon
    steps it too)."""
    if upd.ndim < 2 or upd.numel() == 0:
        return upd
    mat = upd.reshape(upd.shape[0], -1)
    o = newton_schulz(mat, ns_steps, eps, coefficients) * muon_lr_ratio(mat.shape[0], mat.shape[1], adjust_lr_fn)
    return o.reshape(upd.shape)
