"""The staleness model for every format that can stall, per element and step (pure torch).

A stored state x_hat at a grid point (code k) takes the nominal update
D = x_new - x_hat; under nearest rounding its code stays when D falls inside k's rounding
cell, -H_lo < D < H_hi, with H the half-gaps to the neighbouring grid points; under
stochastic rounding it stays with probability max(0, 1 - |D| / G) (G the full gap on
D's side); BReD re-dithers the value read back every step: no stall (0).
The grid is the format's own, at the element's position (`windows`):

    linear   gaps of 1 code x delta, delta = absmax(block) / L
    table    (DE maps, no-zero linear maps) T[k+1] - T[k] and T[k] - T[k-1], x absmax
    float    the ulp of the element's binade (x the block scale when block-scaled)
    edges    no neighbour beyond the top code (the block's absmax element) or below the
             bottom one: that side never leaves the cell (gap = inf)
    sqrt     the grid is on sqrt(x): a gap u on y = sqrt(x) is (y + u)^2 - y^2 on x

Two predictions, each a rate over the element-steps with a non-zero nominal update:

- empirical: the element sits at its running stored value x_hat and takes the replay's
  own nominal update D = x_new - x_hat (the trace's gradients through the optimizer's
  recursion): no assumption about the gradients' law, so heavy tails, zeros, a falling
  E[g^2] and a state that has ratcheted away from its fp32 value all count. A float's gap
  is the binade average eps ln2 |x| (the model's smoothing: with the exact ulp this would
  be the observation itself); block grids keep their exact gaps, and what the model leaves
  out there is the block scale moving under a frozen code;
- Gaussian (Adam's states, no quantized replay needed): the element sits at the fp32
  shadow s (same gradients, fp32 states) before the step; g ~ N(0, sigma^2) with
  sigma^2 = s_v / c_t (the bias-corrected
  v; c_t = 1 - beta2^(t-1) the build-up level, theory.buildup_level). For v, z = g^2 / sigma^2
  ~ chi^2_1 and the cell is z in (c (1 - rho_lo), c (1 + rho_hi)), rho = H / ((1 - beta2) s):
  P_NR = F1(c (1 + rho_hi)) - F1(c (1 - rho_lo)) (theory.py's formula, with the local
  spacing at the element's position in place of the binade's average eps ln 2); for m, the
  cell is g in (m - H_lo / (1 - beta1), m + H_hi / (1 - beta1)) under N(0, sigma^2).
  Stochastic rounding takes the tent's expectation in closed form (F3 = the chi^2_3 CDF:
  E[z; z <= x] = F3(x) for z ~ chi^2_1; for a normal, E[g; a < g < b] = sigma (phi(a/sigma)
  - phi(b/sigma))).
The Gaussian formulas' sqrt, erf and exp are fp32_math's on fp32 CPU tensors (IEEE basic
operations, so the fused replay's numba kernels give the same bits) and torch's elsewhere;
the stochastic formulas' tail factors (phi, and chi2_3's exp(-x / 2)) are +0 below e^-80
(fp32_math.exp_tail: exp computes no subnormal there, docs/diagnose.md "Subnormal tails").
"""
from __future__ import annotations

import math

import torch

from .. import fp32_math as F
from ..quant.codebooks import codebook_tensor
from ..quant.config import StateSpec

INF = float("inf")
_SQRT2 = math.sqrt(2.0)


def windows(spec: StateSpec, s: torch.Tensor, full: bool, binade_average: bool = False, reduce_absmax=None):
    """(down, up): distances in state units from the element's grid point (nearest to s)
    to the edges of its rounding cell (full=False: half-gaps, nearest rounding) or to its
    neighbours (full=True: whole gaps, stochastic rounding). inf: no neighbour that side;
    0 where the block's scale is 0 (everything reads back as 0: any update moves it).
    binade_average: a float format's gap is its binade average eps ln2 |x| (theory.py's
    smoothing) rather than the ulp at x. reduce_absmax: a tensor scale's absmax over pieces
    of one tensor (quantizer.encode)."""
    fmt = spec.fmt
    y = s.clamp(min=0.0).sqrt() if spec.sqrt else s
    if spec.scaled:  # per block
        yb = y.view(-1, spec.block)
        delta = (yb.abs().amax(1, keepdim=True) / fmt.top).expand_as(yb).reshape(-1)
    elif spec.has_scales:  # one scale for the tensor (tensor_scale)
        amax = y.abs().amax().reshape(1) if y.numel() else torch.zeros(1, dtype=y.dtype, device=y.device)
        if reduce_absmax is not None:
            amax = reduce_absmax(amax)
        delta = (amax / fmt.top).expand_as(y)
    if spec.has_scales:
        n = torch.where(delta > 0, y / torch.where(delta > 0, delta, 1.0), 0.0)
    else:
        delta, n = torch.ones_like(y), y
    down, up = _grid_gaps(fmt, n)
    if binade_average and fmt.kind == "float":
        avg = (2.0 ** -fmt.man_bits) * math.log(2.0) * n.abs()
        down = torch.where(torch.isinf(down) | (avg == 0), down, avg)
        up = torch.where(torch.isinf(up) | (avg == 0), up, avg)
    frac = 1.0 if full else 0.5
    down, up = down * delta * frac, up * delta * frac
    if spec.sqrt:  # from gaps on y = sqrt(x) to gaps on x around the same point
        y0 = y.abs()
        up = (y0 + up) ** 2 - y0 * y0
        down = y0 * y0 - (y0 - down).clamp(min=0.0) ** 2
    return down, up


def _grid_gaps(fmt, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaps (in normalised units) below and above the grid point nearest to n."""
    if fmt.kind == "linear":
        lo, hi = fmt.code_range
        k = torch.round(n).clamp(lo, hi)
        one = torch.ones_like(n)
        return torch.where(k > lo, one, INF), torch.where(k < hi, one, INF)
    if fmt.kind == "table":
        table = codebook_tensor(fmt.name, str(n.device))
        last = table.numel() - 1
        k = fmt.nearest_ordinal(n)
        up = torch.where(k < last, table[(k + 1).clamp(max=last)] - table[k], INF)
        down = torch.where(k > 0, table[k] - table[(k - 1).clamp(min=0)], INF)
        return down, up
    if fmt.kind == "float":
        k = fmt.nearest_ordinal(n)  # of |n|
        val = fmt.ordinal_value(k)
        above = torch.where(k < fmt.max_ordinal, fmt.ordinal_value((k + 1).clamp(max=fmt.max_ordinal)) - val, INF)
        below = fmt.ordinal_value((k - 1).clamp(min=0))
        if fmt.signed:  # magnitude 0: the neighbours are +-value(1)
            below = torch.where(k > 0, val - below, fmt.ordinal_value(torch.ones_like(k)))
        else:
            below = torch.where(k > 0, val - below, INF)
        neg = n < 0  # in value terms a negative element's "up" is its magnitude's "down"
        return torch.where(neg, above, below), torch.where(neg, below, above)
    raise ValueError(f"no grid for format kind {fmt.kind!r}")


def predict(spec: StateSpec, x_hat: torch.Tensor, x_new: torch.Tensor, s: torch.Tensor, gaussian=None,
            reduce_absmax=None):
    """(empirical P(stall) per element, nominal mask, Gaussian P(stall) per element or None).

    x_hat, x_new: the stored state before the step and its fp32 value after (the replay's
    own nominal update, D = x_new - x_hat); s: the fp32 shadow before the step; gaussian:
    None, ("v", beta, c) or ("m", beta, sigma2) (Adam's states, module docstring)."""
    d = x_new - x_hat
    nominal = d != 0
    if spec.rounding == "bred":
        zero = torch.zeros_like(s)
        return zero, nominal, (zero if gaussian is not None else None)
    sr = spec.rounding == "stochastic"
    down, up = windows(spec, x_hat, full=sr, binade_average=True, reduce_absmax=reduce_absmax)
    if sr:
        p = (1.0 - d.abs() / torch.where(d > 0, up, down)).clamp(min=0.0)
    else:
        p = ((d > -down) & (d < up)).to(s.dtype)
    emp = torch.where(nominal, p, 0.0)
    if gaussian is None:
        return emp, nominal, None
    down, up = windows(spec, s, full=sr, reduce_absmax=reduce_absmax)
    return emp, nominal, gaussian_p(sr, gaussian, s, down, up)


def gaussian_p(sr: bool, gaussian, s: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Gaussian P(stall) per element of predict, given s's cell (down, up) = windows(s)."""
    kind, beta, arg = gaussian
    return gaussian_v(sr, beta, arg, s, down, up) if kind == "v" else gaussian_m(sr, beta, s, arg, down, up)


def _chi2_1(x: torch.Tensor) -> torch.Tensor:
    return F.erf(F.sqrt(x.clamp(min=0.0) / 2))


def _chi2_3(x: torch.Tensor, f1: torch.Tensor | None = None) -> torch.Tensor:
    """F3(x) = F1(x) - sqrt(2 x / pi) exp(-x / 2), x clamped to >= 0, exp(-x / 2) taken as
    +0 below e^-80 (fp32_math.exp_tail); f1: F1(x) where the caller has it (the same values:
    the clamp is idempotent)."""
    x = x.clamp(min=0.0)
    return (_chi2_1(x) if f1 is None else f1) - F.sqrt(2 * x / math.pi) * F.exp_tail(-x / 2)


def _phi(x):
    """The normal density, +0 where it is below e^-80 / sqrt(2 pi) (fp32_math.exp_tail)."""
    return F.exp_tail(-x * x / 2) / math.sqrt(2 * math.pi)


def _Phi(x):
    return 0.5 * (1 + F.erf(x / _SQRT2))


def gaussian_v(sr: bool, beta: float, c: float, s: torch.Tensor, down: torch.Tensor, up: torch.Tensor):
    """P(stall) per element of Adam's v at build-up level c under Gaussian gradients, given
    its cell (`windows`: half-gaps for nearest, sr: whole gaps for stochastic rounding)."""
    if c <= 0:
        return torch.zeros_like(s)
    scale = (1 - beta) * s
    ok = scale > 0
    scale = torch.where(ok, scale, 1.0)
    w_lo, w_hi = c * down / scale, c * up / scale  # window half-widths in z = g^2 / sigma^2
    if not sr:
        p = _chi2_1(c + w_hi) - _chi2_1(c - w_lo)
        return torch.where(ok, p, 0.0)
    big = 1e30
    w_lo, w_hi = w_lo.clamp(max=big), w_hi.clamp(max=big)
    a, b = (c - w_lo).clamp(min=0.0), c + w_hi
    cc = torch.full((1,), c, dtype=s.dtype, device=s.device)  # c's CDFs once, broadcast: the same values
    f1c, f1a, f1b = _chi2_1(cc), _chi2_1(a), _chi2_1(b)  # each CDF once (elementwise: the same values)
    f3c, f3a, f3b = _chi2_3(cc, f1c), _chi2_3(a, f1a), _chi2_3(b, f1b)
    p = ((1 - c / w_lo) * (f1c - f1a) + (f3c - f3a) / w_lo
         + (1 + c / w_hi) * (f1b - f1c) - (f3b - f3c) / w_hi)
    return torch.where(ok & (w_lo > 0) & (w_hi > 0), p.clamp(0.0, 1.0), 0.0)


def gaussian_m(sr: bool, beta: float, m: torch.Tensor, sigma2: torch.Tensor, down: torch.Tensor, up: torch.Tensor):
    """P(stall) per element of Adam's m under g ~ N(0, sigma^2) (sigma^2: the bias-corrected v)."""
    ok = sigma2 > 0
    sigma = F.sqrt(torch.where(ok, sigma2, 1.0))
    lo, hi = down / (1 - beta), up / (1 - beta)  # window in g around m
    if not sr:
        p = _Phi((m + hi) / sigma) - _Phi((m - lo) / sigma)
        return torch.where(ok, p, 0.0)
    big = 1e30
    lo, hi = lo.clamp(max=big), hi.clamp(max=big)
    a, b = (m - lo) / sigma, (m + hi) / sigma
    z0 = m / sigma
    # tent 1 - (m - g) / lo on (m - lo, m), 1 - (g - m) / hi on (m, m + hi); E[g; a < g < b] = sigma (phi(a) - phi(b))
    cz, ca, cb = _Phi(z0), _Phi(a), _Phi(b)  # each once (elementwise: the same values)
    dz, da, db = _phi(z0), _phi(a), _phi(b)
    left = (1 - m / lo) * (cz - ca) + sigma * (da - dz) / lo
    right = (1 + m / hi) * (cb - cz) - sigma * (dz - db) / hi
    return torch.where(ok & (lo > 0) & (hi > 0), (left + right).clamp(0.0, 1.0), 0.0)
