"""A searched code book's rounding a row at a time (numba; search.floor_codes' stages), shared
by the replay's codec (replay_kernel.replay_codec) and the optimizer kernels' encode of a
code book of more than SCAN_MAX entries (adamw, lion, sgd, muon: bnb-8bit's de8 and de8u).

    round_table            codes of a row of normalised values n (block-scaled: n = x * top / absmax)
    encode_searched        codec.encode_with_absmax for such a book: the block's scale, n, the codes
    encode_block_searched  codec.encode_block for it (the absmax first: Lion, SGD, Muon)

Per element the ops are codec.code_of's (rounding._book: floor code k, then up or not between
table[k] and table[k + 1]), so the codes are the same bits. What differs is the order: each
stage is a loop of its own over the block (the buckets' positions, each dependent load,
each compare), so every loop but the loads vectorizes. One loop per element kept the loads
among the compares and branches, and nothing of it vectorized but the loads, as gathers
(vgatherqps on a Zen 4, where the two rounding loops were 76% of bnb-8bit's optimizer step,
8.6 ns per element; emulated gathers on AVX2). A load loop alone runs as fast gathered as
scalar (docs/cpu.md, "Gathers and scatters").
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c
from . import native as nv
from .search import SCAN_MAX, floor_codes


def searched(lay: tuple) -> bool:
    """Whether a layout's codes come from a searched code book (more than SCAN_MAX entries,
    not {1, ..., UNIT} / UNIT): the optimizer kernels encode it by encode_searched."""
    return lay[c.KIND] == c.TABLE and not lay[c.UNIT] and lay[c.NT] > SCAN_MAX


@njit(cache=True, inline="always", error_model="numpy")
def pick(up, lo, hi):
    """hi if up else lo, as a bit mask (a branchy select kept rounding loops scalar: search.scan_code)."""
    m = np.uint32(0) - np.uint32(up)
    b = c.bits_of_f32(lo)
    return c.f32_from_bits(np.uint32(b ^ ((b ^ c.bits_of_f32(hi)) & m)))


@njit(cache=True, inline="always", error_model="numpy")
def round_table(n, u, cnt, lay, table, rounding, ub, q, lo, hi, w):
    """q[j] = the code of n[j], j < cnt, for any sorted code book: floor code k (floor_codes: in
    stages over the row, with table[k] and table[k + 1] in lo and hi; w: a uint64 scratch row),
    then up from table[k] towards table[k + 1] (rounding.py's up test; u: the stochastic
    uniforms, ub: BReD's block uniform). Nearest and stochastic: lo[j] = table[q[j]], the
    entry chosen (replay_kernel.codes_read_back)."""
    floor_codes(table, lay, lay[c.NT], n, cnt, q, lo, hi, w)
    if rounding == c.NEAREST:
        for j in range(cnt):
            v, tlo, thi = n[j], lo[j], hi[j]
            up = (v - tlo) >= (thi - tlo) * c.HALF
            q[j] = np.int32(q[j] + np.int32(up))
            lo[j] = pick(up, tlo, thi)
    elif rounding == c.STOCHASTIC:
        for j in range(cnt):
            v, tlo, thi = n[j], lo[j], hi[j]
            up = u[j] < min(max((v - tlo) / (thi - tlo), c.ZERO), c.ONE)
            q[j] = np.int32(q[j] + np.int32(up))
            lo[j] = pick(up, tlo, thi)
    else:
        for j in range(cnt):
            v, tlo, thi = n[j], lo[j], hi[j]
            q[j] = np.int32(q[j] + np.int32(ub >= c.ONE - min(max((v - tlo) / (thi - tlo), c.ZERO), c.ONE)))


@njit(cache=True, inline="always", error_model="numpy")
def encode_searched(x, cnt, amax_bits, lay, lim, table, b, start, k1, k2, prepared, q, rows):
    """codec.encode_with_absmax(x, ..., prepared, q) for a searched code book (amax_bits: the
    bits of max |stored_value(x[j])|): returns the block's scale and leaves the codes in
    q[:cnt]. rows: scratch (n, u, lo, hi fp32, w uint64) of cnt or more (scratch_rows). The
    uniforms are codec._round_block's (uniform_bits, times 2**-16) and BReD's block uniform
    codec.block_dither's, so every code is code_of's."""
    n, u, lo, hi, w = rows
    absmax, inv = c.scale_of(amax_bits, lay, lim)
    rounding = lay[c.ROUND]
    ub = c.block_dither(lay, b, k1, k2)  # a code book's: u_b itself
    if rounding == c.STOCHASTIC:
        c.uniform_bits(q, start, cnt, k1, k2)
        for j in range(cnt):
            u[j] = np.float32(q[j]) * c.TWO_M16
    for j in range(cnt):
        n[j] = c.stored_value(x[j], lay, prepared) * inv
    round_table(n, u, cnt, lay, table, rounding, ub, q, lo, hi, w)
    return absmax


@njit(cache=True, inline="always", error_model="numpy")
def encode_block_searched(x, cnt, lay, lim, table, b, start, k1, k2, prepared, q, rows):
    """codec.encode_block for a searched code book: the absmax, then encode_searched."""
    return encode_searched(x, cnt, c.absmax_bits(x, cnt, lay, prepared), lay, lim, table, b, start, k1, k2,
                           prepared, q, rows)


@njit(cache=True, inline="always")
def scratch_rows(n):
    """encode_searched's scratch rows of n elements (a compile-time constant), on the stack."""
    return nv.scratch_f32(n), nv.scratch_f32(n), nv.scratch_f32(n), nv.scratch_f32(n), nv.scratch_u64(n)
