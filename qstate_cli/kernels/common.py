"""Triton building blocks every fused kernel shares: the constants, the hash, the format math.

The helpers of the fused kernels live in three modules (each reproduces a piece of the spec,
qstate_cli/quant and optim/rules.py, bit for bit):

    common.py   this: the kernels' constants (format kinds, rounding modes, value dtypes, the
                per-tensor address table's columns, Format), the hash and the format math
    memory.py   addresses, tile geometry, loads and stores of parameters and gradients,
                non-finite gradient tracking
    codes.py    the state codec: decode_state / encode_state (quantizer.decode / encode)

Here:

    hash32, step_keys, uniform      quant/hash.py: lowbias32; per-step keys k1, k2 of a stream
                                    key (computed on the host: launch.stream_key);
                                    u = (bits >> 8) * 2**-24 (per block)
    one_plus_uniform16              1 + hash.uniform16 (per element, one hash per pair)
    code_to_float, round_half_even  int <-> fp32 without conversion instructions
    nozero_entry                    (k + 1) / NT, the no-zero linear map's entry, exactly
    step_of, inverse_step           delta = absmax / top, top / absmax (quantizer.step_of,
                                    normalize), 0 below top * 2**-126
    table_floor, table_interp       a code book (sorted fp32 table of NT entries): floor by
                                    binary search, linear interpolation at k + f

Rounding: every division and square root is `div_rn` / `sqrt_rn`, and kernels are
launched with enable_fp_fusion=False (no FMA contraction): fp32 results equal torch's,
op for op. Throughput (H100/H200 issue 8x fewer int<->float conversions and MUFU ops
than fp32 adds per clock): codes become floats and back without conversion instructions,
by the 1.5 * 2**23 trick (adding it rounds |n| < 2**22 to an integer held in the low
mantissa bits), and the only per-element MUFU ops are AdamW's sqrt and division.
"""
from __future__ import annotations

from collections import namedtuple

import triton
import triton.language as tl

from . import fastmath as fm

# format kinds, rounding modes and value dtypes as the kernels see them (launch.py maps specs)
LINEAR = tl.constexpr(0)
TABLE = tl.constexpr(1)
NOZERO = tl.constexpr(2)  # the table {(j + 1) / NT}, j < NT (lin4nz, lin8nz): entries computed, not loaded
NEAREST = tl.constexpr(0)
STOCHASTIC = tl.constexpr(1)
BRED = tl.constexpr(2)
F32 = tl.constexpr(0)
BF16 = tl.constexpr(1)
F16 = tl.constexpr(2)
# a state's format as the codec's compile-time constants (launch.StateLayout.constexprs, in order):
# bound in a kernel as `M: tl.constexpr = Format(M_KIND, ...)` (a plain `m = ...` makes tensors of
# them), passed whole, read by field (FMT.KIND, FMT.BITS, ...)
Format = namedtuple("Format", ["KIND", "BITS", "SIGNED", "TOP", "NT", "ROUND", "SQRT", "SBF16"])
# columns of the per-tensor address table (launch.META_COLUMNS)
(PARAM, GRAD, M_CODES, M_SCALES, V_CODES, V_SCALES, NONFINITE, OUT, NUMEL, TENSOR_ID, FIRST_PROGRAM,
 M_KEY, V_KEY) = (tl.constexpr(i) for i in range(13))
MIN_STEP = tl.constexpr(1.1754943508222875e-38)  # 2**-126: blocks with smaller steps read 0 (quantizer.step_of)
MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
MAGIC_BITS = tl.constexpr(0x4B400000)
INT_BASE = tl.constexpr(8388608.0)  # 2**23: as_float(0x4B000000 | c) - 2**23 == c for 0 <= c < 2**23
INT_BASE_BITS = tl.constexpr(0x4B000000)



# ---- the hash (quant/hash.py) ---------------------------------------------------------------
@triton.jit
def hash32(x):
    """lowbias32 on uint32 (multiplies wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def step_keys(key, step):
    """k1 = hash32(key ^ step), k2 = hash32(k1 ^ 0x9e3779b9) for a stream key and a step."""
    k1 = hash32(key ^ step)
    return k1, hash32(k1 ^ 0x9E3779B9)


@triton.jit
def uniform(counter, k1, k2):
    """U[0, 1) on the 2**-24 grid: (hash32(hash32(c ^ k1) ^ k2) >> 8) * 2**-24."""
    bits = hash32(hash32(counter ^ k1) ^ k2)
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def one_plus_uniform16(row0, k1, k2, B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, C0: tl.constexpr = 0):
    """1 + u for every element of a [ROWS, W] tile part (tile()), u = quant/hash.uniform16 of
    its flat index i: one hash per pair (i even, i + 1), 16 bits each, put into the mantissa
    of 1.0 (exact; the caller subtracts 1 or 3/2 instead of converting)."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, W // 2) + C0 // 2
    pair = (row0 * (B // 2)).to(tl.uint32) + (r[:, None] * (B // 2) + c[None, :]).to(tl.uint32)
    bits = hash32(hash32(pair ^ k1) ^ k2)
    lo = ((bits << 7) & 0x7FFF80) | 0x3F800000  # even i: bits 0..15
    hi = ((bits >> 9) & 0x7FFF80) | 0x3F800000  # odd i: bits 16..31
    return tl.reshape(tl.join(lo, hi), [ROWS, W]).to(tl.float32, bitcast=True)


# ---- integer <-> float without conversion instructions --------------------------------------------
@triton.jit
def code_to_float(u, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """The integer value of an unsigned BITS-bit code u (two's complement if SIGNED), as fp32."""
    if SIGNED:  # (u ^ half) - half, half = 2**(BITS-1)
        return ((u ^ (1 << (BITS - 1))) | INT_BASE_BITS).to(tl.float32, bitcast=True) - (INT_BASE + (1 << (BITS - 1)))
    return (u | INT_BASE_BITS).to(tl.float32, bitcast=True) - INT_BASE


@triton.jit
def round_half_even(n):
    """(r, int32 r): n rounded to the nearest integer, ties to even (|n| < 2**22)."""
    t = n + MAGIC
    return t - MAGIC, t.to(tl.int32, bitcast=True) - MAGIC_BITS


@triton.jit
def nozero_entry(k, NT: tl.constexpr):
    """Entry k of the no-zero linear map, (k + 1) / NT, exactly: the float 2**e + (k + 1) / NT
    with e = 23 - log2(NT) (whose ulp is 1 / NT) built from its bits, minus 2**e."""
    E: tl.constexpr = 23 - NT.bit_length() + 1
    return ((k + 1) | ((127 + E) << 23)).to(tl.float32, bitcast=True) - (2.0 ** E)


@triton.jit
def step_of(absmax, TOP: tl.constexpr):
    """delta = absmax / top, 0 where absmax < top * 2**-126 (quantizer.step_of)."""
    if TOP == 1.0:
        delta = absmax
    else:  # rn(absmax / TOP) where it is used (fastmath: Markstein's correction)
        delta = fm.div_top(absmax, TOP)
    return tl.where(absmax >= TOP * MIN_STEP, delta, 0.0)


@triton.jit
def inverse_step(absmax, TOP: tl.constexpr):
    """top / absmax, 0 where absmax < top * 2**-126 (quantizer.normalize): n = x * this."""
    ok = absmax >= TOP * MIN_STEP
    return tl.where(ok, tl.math.div_rn(tl.full(absmax.shape, TOP, tl.float32), tl.where(ok, absmax, 1.0)), 0.0)


# ---- code books ---------------------------------------------------------------------------------
@triton.jit
def table_floor(table_ptr, n, NT: tl.constexpr, LOG: tl.constexpr):
    """clamp(#(table <= n) - 1, 0, NT - 2) by binary search (NT <= 2**LOG entries, sorted)."""
    pos = tl.zeros(n.shape, tl.int32)
    for i in tl.static_range(LOG):
        cand = pos + (1 << (LOG - 1 - i))
        ok = cand <= NT - 1
        t = tl.load(table_ptr + tl.where(ok, cand - 1, 0))
        pos = tl.where(ok & (t <= n), cand, pos)
    return tl.maximum(pos - 1, 0)


@triton.jit
def table_interp(table_ptr, k, f, NT: tl.constexpr):
    """Value at fractional ordinal k + f, linear between neighbours, extrapolated at the ends
    (formats.Format.interp: kc = clamp(k, 0, NT-2); f += k - kc; lo + f * (hi - lo))."""
    kc = tl.minimum(tl.maximum(k, 0), NT - 2)
    f = f + tl.where(k < kc, -1.0, tl.where(k > kc, 1.0, 0.0))  # k - kc is -1, 0 or 1 here
    lo = tl.load(table_ptr + kc)
    hi = tl.load(table_ptr + kc + 1)
    return lo + f * (hi - lo)

