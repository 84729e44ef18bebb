"""The rounding of one element to its code, specialized per layout in Python (numba overload).

    code_of(n, lay, table, dither, u)   the code (reduced to the format's bits) of
                                        n = stored_value(x) * top / absmax

    linear     clamp(rint(n + d)), two's complement if signed; d = u - 1/2 (stochastic), the
               block's dither (BReD), 0 (nearest)
    unit book  {1, ..., UNIT} / UNIT: k = clamp(floor(n * UNIT) - 1, 0, NT - 2), then up or not
               between lo = (k + 1) / UNIT and hi = (k + 2) / UNIT in closed form (no search;
               computed as t = k + 1 and (n - lo) * UNIT = n * UNIT - t, the same values: _unit_t)
    code book  k by search.py (scan_code for <= SCAN_MAX entries, else floor_code), then up or
               not between lo = table[k] and hi = table[k + 1]
    minifloat  on |n|: the floor ordinal k and its exact fraction from the fp32 bits (or the
               uniform grid below the least normal), up, clamp(k + up, 0, MAXORD), n's sign
               bit on top (quant/formats._float_floor_frac, quantizer.encode and _store);
               nearest: up if frac > 1/2, ties to even k
    up         nearest: n - lo >= (hi - lo) / 2 (ties up, as torchao); stochastic: u < frac;
               BReD: dither >= 1 - frac; frac = clamp((n - lo) / (hi - lo), 0, 1), whose clamp
               the kernels leave out: u and dither lie in [0, 1), so u < f and dither >= 1 - f
               are what u < clamp(f, 0, 1) and dither >= 1 - clamp(f, 0, 1) are for every f
               (f < 0: both false, 1 - f rounds to >= 1; f > 1: both true, 1 - f <= 0; n is
               finite: codec.stored_value maps non-finite values to 0); 4 fewer vector ops
               per 16 pairs in sr-4bit's encode (its 4 M-element step 2.5% faster, Zen 4)

u: the element's uniform (stochastic rounding); dither: codec.block_dither. lay must be a
kernel's closure constant (numba types it as a tuple of literal ints): the overload reads
its values and returns the one branch-free function for that layout, so numba's IR holds
no other format's branches. An `inline="always"` function that branched on `lay[...]`
instead was re-parsed, every branch included, at each call (numba prunes branches on
`lay[...]` only in LLVM): 14 calls of it in AdamW's kernel with the 4-bit pair encoder
(pairs.py) took its nearest-4bit compile from 29 to 145 s CPU; 25 s with this overload
(docs/cpu.md, "Encode by pairs: kept").
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core.errors import TypingError
from numba.extending import overload

from . import layout as c
from .native import bits_of_f32, f32_from_bits, shl32, shr32
from .search import SCAN_MAX, floor_code, scan_code


def code_of(n, lay, table, dither, u):
    """The code of n for layout lay (module docstring); numba only."""


def _literal_lay(lay) -> tuple:
    """lay's values from its numba type (a tuple of literal ints), or a one-line TypingError."""
    if not isinstance(lay, types.BaseTuple) or not all(isinstance(t, types.IntegerLiteral) for t in lay.types):
        raise TypingError(f"code_of: lay must be a kernel's closure constant (literal ints), got {lay}")
    return tuple(t.literal_value for t in lay.types)


@overload(code_of, inline="always", prefer_literal=True)
def _code_of(n, lay, table, dither, u):
    lv = _literal_lay(lay)
    if lv[c.KIND] == c.FLOAT:
        return _minifloat(lv[c.BITS], lv[c.SIGNED], lv[c.ROUND], lv[c.MAN], lv[c.EMIN], lv[c.MAXORD])
    if lv[c.KIND] == c.LINEAR:
        return _linear(lv[c.BITS], lv[c.SIGNED], lv[c.ROUND])
    if lv[c.UNIT]:
        return _unit(lv[c.UNIT], lv[c.NT], lv[c.ROUND])
    return _book(lv, lv[c.NT], lv[c.ROUND])


@njit(cache=True, inline="always", error_model="numpy")
def _clamp_code(n, lo_code, hi_code, mask):
    """clamp(rint(n), lo_code, hi_code) & mask as int32."""
    return min(max(np.int32(np.rint(n)), np.int32(lo_code)), np.int32(hi_code)) & np.int32(mask)


def _linear(bits: int, signed: int, rounding: int):
    """clamp(rint(n + d)) & (2**bits - 1), d by the rounding (the same fp32 ops as quantizer.encode)."""
    lo_code = -(1 << (bits - 1)) if signed else 0
    hi_code = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1
    mask = (1 << bits) - 1
    if rounding == c.STOCHASTIC:
        def impl(n, lay, table, dither, u):
            return _clamp_code(n + (u - c.HALF), lo_code, hi_code, mask)
    elif rounding == c.BRED:
        def impl(n, lay, table, dither, u):
            return _clamp_code(n + dither, lo_code, hi_code, mask)
    else:
        def impl(n, lay, table, dither, u):
            return _clamp_code(n, lo_code, hi_code, mask)
    return impl


@njit(cache=True, inline="always", error_model="numpy")
def _unit_t(n, unit, nt):
    """(y, t): y = n * UNIT (exact: UNIT is a power of two) and t = clamp(floor(y), 1, NT - 1)
    as fp32, so the floor code is k = t - 1, its value lo = t / UNIT, and (n - lo) * UNIT is
    y - t exactly (t <= y <= 2t in the unclamped range, Sterbenz; power-of-two scalings commute
    with fp32 rounding): the spec's (n - lo) and (hi - lo) = 1 / UNIT, two ops fewer."""
    y = n * np.float32(unit)
    return y, min(max(np.floor(y), c.ONE), np.float32(nt - 1))


def _unit(unit: int, nt: int, rounding: int):
    """Code book {1, ..., UNIT} / UNIT: k + up with k = t - 1, up from y - t (_unit_t: no search,
    no division). Stochastic and BReD write it t - (not up), which LLVM turns into one byte
    subtract of the comparison's mask: `t - 1 + up` took 5.18 against 5.09-5.13 ms (sr-4bit's
    AdamW kernel, Zen 4)."""
    if rounding == c.NEAREST:
        def impl(n, lay, table, dither, u):
            y, t = _unit_t(n, unit, nt)
            return np.int32(t) - np.int32(1) + np.int32((y - t) >= c.HALF)
    elif rounding == c.STOCHASTIC:
        def impl(n, lay, table, dither, u):
            y, t = _unit_t(n, unit, nt)
            return np.int32(t) - np.int32(not (u < y - t))
    else:
        def impl(n, lay, table, dither, u):
            y, t = _unit_t(n, unit, nt)
            return np.int32(t) - np.int32(not (dither >= c.ONE - (y - t)))
    return impl


def _minifloat(bits: int, signed: int, rounding: int, man: int, emin: int, maxord: int):
    """The code of n for a minifloat with `man` mantissa bits, least normal exponent emin
    (> -126: 4- and 8-bit formats) and largest magnitude ordinal maxord (module docstring):
    float_floor_frac and float_code with the layout's constants (folded at compile time)."""
    if rounding == c.NEAREST:
        def impl(n, lay, table, dither, u):
            k, frac = float_floor_frac(abs(n), man, emin)
            up = (frac > c.HALF) | ((frac == c.HALF) & ((k & np.int32(1)) == np.int32(1)))
            return float_code(n, k + np.int32(up), bits, signed, maxord)
    elif rounding == c.STOCHASTIC:
        def impl(n, lay, table, dither, u):
            k, frac = float_floor_frac(abs(n), man, emin)
            return float_code(n, k + np.int32(u < frac), bits, signed, maxord)
    else:
        def impl(n, lay, table, dither, u):
            k, frac = float_floor_frac(abs(n), man, emin)
            return float_code(n, k + np.int32(dither >= c.ONE - frac), bits, signed, maxord)
    return impl


@njit(cache=True, inline="always", error_model="numpy")
def pow2_normal(e):
    """2**e in fp32 for an integer e in [-126, 127], from its exponent bits (no pow call)."""
    return f32_from_bits(np.uint32(np.int32(e + 127) << np.int32(23)))


@njit(cache=True, inline="always", error_model="numpy")
def pow2(e):
    """2**e in fp32 for an integer e in [-149, 127], exactly, built from its bits (below
    2**-126 a subnormal: the one bit e + 149). No pow call, so a loop over a runtime e packs."""
    normal = pow2_normal(max(e, -126))
    sub = f32_from_bits(shl32(1, min(max(e + 149, 0), 31)))
    return normal if e >= -126 else sub


@njit(cache=True, inline="always", error_model="numpy")
def float_floor_frac(mag, man, emin):
    """formats._float_floor_frac of one fp32 magnitude mag >= 0 for a minifloat with `man`
    mantissa bits and least normal exponent emin: (floor ordinal k int32, its exact fraction
    fp32). Normal range: k = bits(mag) >> (23 - man), re-biased, and the dropped bits times
    2**(man - 23); below 2**emin: the uniform grid of spacing 2**(emin - man). emin <= -126
    (bf16): the bits alone, fp32 subnormals and NaN included. Else mag must not be NaN."""
    drop = np.int32(23 - man)
    b = bits_of_f32(mag)
    kn = np.int32(np.int32(shr32(b, drop)) - np.int32((126 + emin) << man))  # a 32-bit shift (native.shr32)
    fn = np.float32(np.int32(b & np.uint32((1 << drop) - 1))) * pow2(-drop)
    y = mag * pow2(min(man - emin, 127))  # exact: a power-of-two scaling (not used if emin <= -126)
    ks = np.floor(y)
    normal = (mag >= pow2(max(emin, -126))) | (emin <= -126)
    return (kn if normal else np.int32(ks)), (fn if normal else y - ks)


@njit(cache=True, inline="always", error_model="numpy")
def float_code(n, q, bits, signed, maxord):
    """The minifloat code of magnitude ordinal q for the element n: clamp(q, 0, maxord), with
    n's sign bit as bit bits - 1 if the format is signed (quantizer.encode's _store); no
    branch, so a loop over it packs with `signed` known only at run time (the replay)."""
    sign = np.int32(shl32(bits_of_f32(n) >> np.uint32(31), bits - 1))
    return np.int32(min(max(q, np.int32(0)), np.int32(maxord)) | (sign & -np.int32(signed)))  # signed: 0 or 1


def _book(lv: tuple, nt: int, rounding: int):
    """Any sorted code book: k by search.py, then up or not (module docstring) between
    lo = table[k] and hi = table[k + 1]."""
    if nt <= SCAN_MAX:
        @njit(inline="always", error_model="numpy")
        def neighbours(table, n):
            return scan_code(table, nt, n)
    else:
        @njit(inline="always", error_model="numpy")
        def neighbours(table, n):
            k = floor_code(table, lv, nt, n)
            return k, table[k], table[k + 1]
    if rounding == c.NEAREST:
        def impl(n, lay, table, dither, u):
            k, lo, hi = neighbours(table, n)
            return np.int32(k) + np.int32((n - lo) >= (hi - lo) * c.HALF)
    elif rounding == c.STOCHASTIC:
        def impl(n, lay, table, dither, u):
            k, lo, hi = neighbours(table, n)
            return np.int32(k) + np.int32(u < (n - lo) / (hi - lo))
    else:
        def impl(n, lay, table, dither, u):
            k, lo, hi = neighbours(table, n)
            return np.int32(k) + np.int32(dither >= c.ONE - (n - lo) / (hi - lo))
    return impl
