"""fp32_math's sqrt, erf and exp as inlined numba functions of one fp32 value: the same IEEE
operations in the same order (fastmath off: no FMA), so the same bits as qstate_cli/fp32_math.py
on CPU tensors (tests/test_fp32_math.py). Imports numba."""
from __future__ import annotations

import numpy as np
from numba import njit

from ... import fp32_math as F
from . import codec as c  # sets numba's cache folder before anything here compiles
from .rounding import pow2_normal

f32 = np.float32
LOG2E, LN2_HI, LN2_LO, EXP_LO, EXP_HI = f32(F.LOG2E), f32(F.LN2_HI), f32(F.LN2_LO), f32(F.EXP_LO), f32(F.EXP_HI)
E0, E1, E2, E3, E4, E5, E6, E7 = (f32(v) for v in F.EXP_TAYLOR)
S0, S1, S2, S3, S4, S5, S6 = (f32(v) for v in F.ERF_SMALL)
T0, T1, T2, T3, T4, T5, T6, T7, T8, T9 = (f32(v) for v in F.ERF_TAIL)
ERF_ONE, SIXTEEN = f32(F.ERF_ONE), f32(F.ERF_ONE * F.ERF_ONE)
TAIL_LO = f32(F.TAIL_LO)
# elements of an erf_row: at 16 the replay's m_nearest ran at 5.6 instead of 2.75 ns per element
# where every row takes the tail (4-bit m, this Xeon; short loops vectorized worse), at 64 it
# skipped fewer tails (docs/diagnose.md, "Replay throughput")
ROW = 32


@njit(cache=True, inline="always", error_model="numpy")
def pow2(k):
    """2^k for a whole fp32 k in [-126, 127] (fp32_math.pow2)."""
    return pow2_normal(np.int32(k))


@njit(cache=True, inline="always", error_model="numpy")
def reduce(x):
    """(k, e^r) of x = k ln2 + r (fp32_math._reduce)."""
    k = np.floor(x * LOG2E + c.HALF)
    r = (x - k * LN2_HI) - k * LN2_LO
    return k, ((((((E7 * r + E6) * r + E5) * r + E4) * r + E3) * r + E2) * r + E1) * r + E0


@njit(cache=True, inline="always", error_model="numpy")
def exp32(x):
    """e^x (fp32_math.exp32)."""
    ok = (x >= EXP_LO) & (x <= EXP_HI)
    k, p = reduce(x if ok else c.ZERO)
    k1 = np.floor(k * c.HALF)
    core = (p * pow2(k1)) * pow2(k - k1)
    y = core if ok else (c.ZERO if x < EXP_LO else x)
    return c.INF if x > EXP_HI else y


@njit(cache=True, inline="always", error_model="numpy")
def exp_tail32(x):
    """e^x, +0 below TAIL_LO (fp32_math.exp_tail): exp32 takes 0 there, so no lane of a
    vector computes a subnormal."""
    low = x < TAIL_LO
    e = exp32(c.ZERO if low else x)
    return c.ZERO if low else e


@njit(cache=True, inline="always", error_model="numpy")
def exp_normal(x):
    """exp32(x) for x in [-87, 88] (fp32_math.exp_normal)."""
    k, p = reduce(x)
    return p * pow2(k)


@njit(cache=True, inline="always", error_model="numpy")
def erf_small(x):
    """erf32's |x| < 1 branch: x P(x^2) (fp32_math.erf32)."""
    u = x * x
    return x * ((((((S6 * u + S5) * u + S4) * u + S3) * u + S2) * u + S1) * u + S0)


@njit(cache=True, inline="always", error_model="numpy")
def erf32(x):
    """erf(x) (fp32_math.erf32)."""
    a = abs(x)
    u = x * x
    small = erf_small(x)
    t = c.ONE / (c.ONE if a < c.ONE else a)  # the clamp's value wherever the tail is taken
    r = ((((((((T9 * t + T8) * t + T7) * t + T6) * t + T5) * t + T4) * t + T3) * t + T2) * t + T1) * t + T0
    e = exp_normal(-(u if u < SIXTEEN else SIXTEEN))  # fp32_math.erf32's clamp (NaN: any value, unused)
    tail = c.ONE if a >= ERF_ONE else c.ONE - (e * t) * r
    return (-tail if x < c.ZERO else tail) if a >= c.ONE else small


@njit(cache=True, inline="always", error_model="numpy")
def erf32_outer(x):
    """erf32(x) wherever |x| is not in [1, 4) (NaN included): the polynomial of |x| < 1, and
    +-1 at |x| >= 4, the same bits, without the tail's exp, division and polynomial."""
    return (-c.ONE if x < c.ZERO else c.ONE) if abs(x) >= c.ONE else erf_small(x)


@njit(cache=True, inline="always", error_model="numpy")
def erf_tail_lane(x):
    """1 where erf32(x) takes its tail (1 <= |x| < 4, erf32_outer's exception), else 0 (int32)."""
    a = abs(x)
    return np.int32((a >= c.ONE) & (a < ERF_ONE))


@njit(cache=True, forceinline=True, error_model="numpy")
def erf_row(xs, out, tail):
    """out[k] = erf32(xs[k]) for the ROW elements of xs, given tail = whether erf_tail_lane
    is 1 for any of them: erf32 where so, else erf32_outer, the same bits. A vector computes
    both of erf32's branches in every lane; the staleness model's arguments mostly fall on
    one side for a whole row (bf16-sr's m: |x| < 1 for all three), so a row of the replay's
    Gaussian model (replay_gauss_kernel.py) skips the tail's ~35 fp32 ops per element.
    forceinline: numba compiles it once for all its callers, LLVM inlines it (inlined by numba
    at each of the model's seven call sites, the kernels took 5.6 s longer to compile, and
    ran 2-4% faster)."""
    if tail:
        for k in range(ROW):
            out[k] = erf32(xs[k])
    else:
        for k in range(ROW):
            out[k] = erf32_outer(xs[k])


@njit(cache=True, inline="always", error_model="numpy")
def sqrt32(x):
    """sqrt(x), correctly rounded (fp32_math.sqrt)."""
    return np.sqrt(x)


@njit(nogil=True, cache=True, error_model="numpy")
def apply(which, x, out):
    """out[i] = sqrt32 (0), exp32 (1), erf32 (2) or exp_tail32 (3) of x[i], or erf32 by
    erf_row (4; rows of ROW consecutive values, the last ones by erf32): for the tests."""
    if which == 4:
        whole = x.size - x.size % ROW
        for r0 in range(0, whole, ROW):
            tail = np.int32(0)
            for k in range(ROW):
                tail |= erf_tail_lane(x[r0 + k])
            erf_row(x[r0:r0 + ROW], out[r0:r0 + ROW], tail)
        for i in range(whole, x.size):
            out[i] = erf32(x[i])
        return 0
    for i in range(x.size):
        if which == 0:
            out[i] = sqrt32(x[i])
        elif which == 1:
            out[i] = exp32(x[i])
        elif which == 2:
            out[i] = erf32(x[i])
        else:
            out[i] = exp_tail32(x[i])
    return 0
