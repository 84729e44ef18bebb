"""The 4-bit block codec by pairs of elements (numba; AdamW's kernel, adamw.py).

A 4-bit code byte holds elements 2k (low nibble) and 2k + 1 (high nibble), and stochastic
rounding's uniforms of that pair are the two halves of one hash (quant/hash.uniform16). So
one loop over the block's pairs rounds both elements, draws their uniforms and stores
their byte, with no int32 codes row in between (codec.encode_with_absmax + pack_codes: two
loops, uniform_bits a third); AdamW encodes m and v in the same loop; Lion, SGD and Muon their one
state (encode_row4). Same ops per element as codec.py (codec.code_of), so the same bits
(tests/test_kernels_cpu.py, tests/test_kernels_cpu_momentum.py). Decoding stays
codec.decode_block's (unpack, then decode): a loop that writes both values of a byte
(interleaved stores) did not pack (scalar vmulss, perf).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c

@njit(cache=True, inline="always", error_model="numpy")
def pair_uniforms(pair, k1, k2):
    """(u of element 2 * pair, u of element 2 * pair + 1): the low and high 16 bits of
    hash32(hash32(pair ^ k1) ^ k2), times 2**-16 (codec.uniform16; pair taken mod 2**32)."""
    h = c.hash32(np.uint32(c.hash32(np.uint32(pair ^ k1)) ^ k2))
    return (np.float32(np.int32(h & np.uint32(0xFFFF))) * c.TWO_M16,
            np.float32(np.int32(h >> c.U16)) * c.TWO_M16)


@njit(cache=True, inline="always", error_model="numpy")
def _byte(x, k, lay, table, inv, dither, u0, u1, prepared):
    """The code byte of pair k: code_of element 2k (low nibble) | code_of element 2k + 1 << 4."""
    lo = c.code_of(c.stored_value(x[2 * k], lay, prepared) * inv, lay, table, dither, u0)
    hi = c.code_of(c.stored_value(x[2 * k + 1], lay, prepared) * inv, lay, table, dither, u1)
    return np.uint8(lo | (hi << 4))


@njit(cache=True, inline="always", error_model="numpy")
def _tail(x, cnt, lay, table, inv, dither, u0, prepared):
    """The last byte of an odd cnt: element cnt - 1's code, high nibble 0 (packing.pack pads)."""
    return np.uint8(c.code_of(c.stored_value(x[cnt - 1], lay, prepared) * inv, lay, table, dither, u0))


@njit(cache=True, inline="always", error_model="numpy")
def encode_pack4_two(x, y, cnt, xbits, ybits, xlay, ylay, xlim, ylim, xtab, ytab, b, start,
                     xk1, xk2, yk1, yk2, prepared, xcodes, ycodes):
    """codec.encode_with_absmax of two 4-bit states of the same block (AdamW's m and v: rows x
    and y, absmax bit patterns xbits, ybits), codes written packed straight into xcodes and
    ycodes (bytes start / 2 ..), in one loop over the block's pairs. Returns both scales."""
    xs, xinv = c.scale_of(xbits, xlay, xlim)
    ys, yinv = c.scale_of(ybits, ylay, ylim)
    xd = c.block_dither(xlay, b, xk1, xk2)
    yd = c.block_dither(ylay, b, yk1, yk2)
    xsr = xlay[c.ROUND] == c.STOCHASTIC
    ysr = ylay[c.ROUND] == c.STOCHASTIC
    i0 = np.uint64(start >> 1)
    pair = np.uint32(np.int64(start) >> 1)  # start is even: element start + 2k is in pair start / 2 + k
    xu0, xu1, yu0, yu1 = c.ZERO, c.ZERO, c.ZERO, c.ZERO
    for k in range(cnt >> 1):
        if xsr:
            xu0, xu1 = pair_uniforms(pair, xk1, xk2)
        if ysr:
            yu0, yu1 = pair_uniforms(pair, yk1, yk2)
        pair = np.uint32(pair + np.uint32(1))  # a 32-bit counter (an int64 one packs as 4 lanes)
        xcodes[i0 + np.uint64(k)] = _byte(x, k, xlay, xtab, xinv, xd, xu0, xu1, prepared)
        ycodes[i0 + np.uint64(k)] = _byte(y, k, ylay, ytab, yinv, yd, yu0, yu1, prepared)
    if cnt & 1:
        if xsr:
            xu0, xu1 = pair_uniforms(pair, xk1, xk2)
        if ysr:
            yu0, yu1 = pair_uniforms(pair, yk1, yk2)
        xcodes[i0 + np.uint64(cnt >> 1)] = _tail(x, cnt, xlay, xtab, xinv, xd, xu0, prepared)
        ycodes[i0 + np.uint64(cnt >> 1)] = _tail(y, cnt, ylay, ytab, yinv, yd, yu0, prepared)
    return xs, ys


@njit(cache=True, inline="always", error_model="numpy")
def encode_pack4(x, cnt, amax_bits, lay, lim, table, b, start, k1, k2, prepared, codes):
    """codec.encode_with_absmax of a 4-bit layout, its codes written packed straight into
    `codes` (bytes start / 2 ..; a high nibble past an odd cnt is 0, as packing.pack pads).
    Returns the block's scale."""
    absmax, inv = c.scale_of(amax_bits, lay, lim)
    dither = c.block_dither(lay, b, k1, k2)
    sr = lay[c.ROUND] == c.STOCHASTIC
    i0 = np.uint64(start >> 1)
    pair = np.uint32(np.int64(start) >> 1)
    u0, u1 = c.ZERO, c.ZERO
    for k in range(cnt >> 1):
        if sr:
            u0, u1 = pair_uniforms(pair, k1, k2)
            pair = np.uint32(pair + np.uint32(1))
        codes[i0 + np.uint64(k)] = _byte(x, k, lay, table, inv, dither, u0, u1, prepared)
    if cnt & 1:
        if sr:
            u0, u1 = pair_uniforms(pair, k1, k2)
        codes[i0 + np.uint64(cnt >> 1)] = _tail(x, cnt, lay, table, inv, dither, u0, prepared)
    return absmax


def by_pairs(lay: tuple) -> bool:
    """Whether a state of layout lay is encoded by pairs: 4-bit, linear or {1..UNIT}/UNIT
    (a kernel's closure bool: numba prunes the branch it guards before inlining)."""
    return bool(lay[c.BITS] == 4 and (lay[c.KIND] == c.LINEAR or lay[c.UNIT]))


@njit(cache=True, inline="always", error_model="numpy")
def encode_row4(x, cnt, lay, lim, table, b, start, k1, k2, codes):
    """codec.encode_block then pack_codes of a 4-bit layout taken by pairs (by_pairs), x[:cnt]
    not yet in the stored domain (prepared False), in two loops (the absmax, then the pairs)
    instead of three or four: the codes go packed straight into `codes`. Returns the scale."""
    return encode_pack4(x, cnt, c.absmax_bits(x, cnt, lay, False), lay, lim, table, b, start, k1, k2, False, codes)
