"""sqrt, erf and exp of fp32 CPU tensors from IEEE basic operations (+, -, *, / of two fp32
values, floor, compares, bit casts), so that numba (kernels/cpu/fp32_math_kernel.py, the same
operations in the same order) gives the same bits, on every CPU: the staleness model's
functions on CPU (diagnose/staleness.py). Other devices and dtypes keep torch's own.

Why not torch's: its CPU sqrt, erf and exp are MKL's vector math, whose bits numba cannot
reproduce (sqrt is 1 ulp off on ~0.5% of values) and may differ between the code paths MKL
picks per CPU. On AMD it picks its generic kernels: 1.3, 0.85 and 0.55 ns per element at one
thread on a Zen 4, 18% of a stochastic-rounding replay's time (docs/diagnose.md).

    sqrt(x)  correctly rounded: the fp64 sqrt of x rounded to fp32 (53 >= 2 * 24 + 2 bits:
             the double rounding is innocuous), as the CPU's fp32 sqrt gives it.
    exp(x)   x = k ln2 + r with k = floor(x log2(e) + 1/2) and r = (x - k LN2_HI) - k LN2_LO
             (LN2_HI has 15 significant bits, so k LN2_HI and the first difference are
             exact), e^r by its Taylor polynomial to r^7 (|r| <= 0.347: truncation < 5e-9
             relative), times 2^k as 2^k1 2^(k - k1), k1 = floor(k / 2), so that a subnormal
             result rounds once. +inf above 89, +0 below -104, NaN stays. Error <= 1.221 ulp
             (normal results; at x = 59.265224, 1.2206 ulp), <= 0.78 of 2^-149 (subnormal;
             at x = -87.817528, 0.7771): every fp32 x in [-104, 89], searched exhaustively.
    erf(x)   |x| < 1: x P(x^2), P of degree 6 (fit to erf(x) / x, 1.2e-9 relative);
             1 <= |x| < 4: sign(x) (1 - (exp(-x^2) t) R(t)), t = 1 / |x| (exp(-x^2) is
             normal there: exp_normal, exp's bits in fewer ops), R of degree 9
             (fit to erfc(a) exp(a^2) a, 5e-9 relative); |x| >= 4: sign(x) (erfc(4) =
             1.5e-8 is below half an ulp of 1). Error <= 2.55 ulp and 1.52e-7 absolute
             (both at x = +-0.99074990: 2.5498 ulp, 1.5198e-7; every fp32 |x| < 4 searched).
    exp_tail(x)  e^x, and +0 below TAIL_LO = -80 (e^-80 = 1.8e-35): for a tail factor whose
             values this small do not matter to the result (the staleness model's phi and
             chi2_3: p moves by < 1e-34, docs/diagnose.md, "Subnormal tails"). Its own result
             is never subnormal, which an Intel core (the Xeon measured) pays a microcode
             assist for, per vector instruction that makes or reads one. NaN stays.
Every constant is an fp32 value (torch takes a Python scalar as fp32 in t * c and t + c).
Measured errors, and the parity with the kernels: tests/test_fp32_math.py.
"""
from __future__ import annotations

import torch

LOG2E = 1.4426950216293335  # fp32(1 / ln 2)
LN2_HI = 0.693145751953125  # ln 2's first 15 bits
LN2_LO = 1.428606765330187e-06  # fp32(ln 2 - LN2_HI)
EXP_TAYLOR = (1.0, 1.0, 0.5, 0.1666666716337204, 0.0416666679084301, 0.008333333767950535,
              0.0013888889225199819, 0.00019841270113829523)  # fp32(1 / k!), k = 0..7
EXP_LO, EXP_HI = -104.0, 89.0  # exp is +0 below, +inf above
ERF_SMALL = (1.1283791065216064, -0.3761262595653534, 0.1128358542919159, -0.026853810995817184,
             0.00518832728266716, -0.0008010189631022513, 7.853847637306899e-05)  # P, |x| < 1
ERF_TAIL = (0.5642388463020325, -0.00153559900354594, -0.26221272349357605, -0.14333856105804443,
            1.0590035915374756, -1.7566924095153809, 1.6511377096176147, -0.9528606534004211,
            0.3163394331932068, -0.04649612680077553)  # R(t), 1 <= |x| < 4
ERF_ONE = 4.0  # erf rounds to +-1 from here
TAIL_LO = -80.0  # exp_tail is +0 below: e^-80 = 1.8e-35, fp32 subnormals start at e^-87.3


def ours(x: torch.Tensor) -> bool:
    """Whether x takes this module's functions (fp32 on CPU) rather than torch's."""
    return x.dtype == torch.float32 and x.device.type == "cpu"


def poly(coeffs: tuple, t: torch.Tensor) -> torch.Tensor:
    """sum_k coeffs[k] t^k by Horner's rule, highest first: p = p t + c_k (two roundings each)."""
    p = torch.full_like(t, coeffs[-1])
    for c in coeffs[-2::-1]:
        p.mul_(t).add_(c)  # in place: the same ops, no new tensor per op
    return p


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k for whole fp32 k in [-126, 127], from its exponent bits."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def _reduce(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, e^r): x = k ln2 + r, e^r by the Taylor polynomial (module docstring)."""
    k = (x * LOG2E).add_(0.5).floor_()
    return k, poly(EXP_TAYLOR, (x - k * LN2_HI).sub_(k * LN2_LO))


def exp32(x: torch.Tensor) -> torch.Tensor:
    """e^x (module docstring)."""
    ok = (x >= EXP_LO) & (x <= EXP_HI)
    k, p = _reduce(torch.where(ok, x, 0.0))
    k1 = (k * 0.5).floor_()
    core = p.mul_(pow2(k1)).mul_(pow2(k.sub_(k1)))
    return torch.where(x > EXP_HI, float("inf"), torch.where(ok, core, torch.where(x < EXP_LO, 0.0, x)))


def exp_normal(x: torch.Tensor) -> torch.Tensor:
    """exp32(x) for x in [-87, 88], where e^x is a normal fp32: e^r 2^k in one product, the
    same bits as exp32's two (each exact there). Elsewhere any value (callers select it away)."""
    k, p = _reduce(x)
    return p.mul_(pow2(k))


def erf32(x: torch.Tensor) -> torch.Tensor:
    """erf(x) (module docstring)."""
    a = x.abs()
    u = x * x
    small = poly(ERF_SMALL, u).mul_(x)
    t = torch.ones_like(a).div_(a.clamp(min=1.0))
    e = exp_normal(-u.clamp(max=ERF_ONE * ERF_ONE))  # e^-u in [e^-16, e^-1] wherever the tail is taken
    tail = torch.where(a >= ERF_ONE, 1.0, e.mul_(t).mul_(poly(ERF_TAIL, t)).neg_().add_(1.0))
    return torch.where(a >= 1.0, torch.where(x < 0.0, -tail, tail), small)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt(x): correctly rounded for fp32 on CPU (module docstring), else torch's."""
    return x.double().sqrt().float() if ours(x) else x.sqrt()


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x: exp32 for fp32 on CPU, else torch's."""
    return exp32(x) if ours(x) else torch.exp(x)


def exp_tail(x: torch.Tensor) -> torch.Tensor:
    """e^x, +0 below TAIL_LO (module docstring): exp's bits elsewhere, NaN included."""
    low = x < TAIL_LO
    return torch.where(low, 0.0, exp(torch.where(low, 0.0, x)))


def erf(x: torch.Tensor) -> torch.Tensor:
    """erf(x): erf32 for fp32 on CPU, else torch's."""
    return erf32(x) if ours(x) else torch.special.erf(x)
