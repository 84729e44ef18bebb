"""numba kernel of the replay's fused codec (replay.py says what it computes; imports numba).

One compilation for every covered state layout: `lay` (codec.py's 8 ints) is a runtime
tuple here, so its branches are taken per block, not resolved at compile time.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c


@njit(cache=True, inline="always", error_model="numpy")
def round_codes(n, u, cnt, lay, table, rounding, q):
    """q[:cnt] = codes of n[:cnt] given the uniforms u[:cnt] (codec.encode_block's rounding,
    reduced to the format's bits): linear clamp(rint(n + u - 1/2)) (nearest: rint(n));
    code books: floor k, then up from table[k] towards table[k + 1] (codec._up)."""
    bits = lay[c.BITS]
    mask = np.int32((1 << bits) - 1)
    if lay[c.KIND] == c.LINEAR:
        if lay[c.SIGNED]:
            lo_code, hi_code = np.int32(-(1 << (bits - 1))), np.int32((1 << (bits - 1)) - 1)
        else:
            lo_code, hi_code = np.int32(0), np.int32((1 << bits) - 1)
        if rounding != c.NEAREST:
            for j in range(cnt):
                n[j] = n[j] + (u[j] - c.HALF)
        for j in range(cnt):
            q[j] = min(max(np.int32(np.rint(n[j])), lo_code), hi_code) & mask
    elif lay[c.UNIT]:  # {1, ..., UNIT} / UNIT (codec._round_unit_table)
        ntf, unit = np.float32(lay[c.NT]), np.float32(lay[c.UNIT])
        step = c.ONE / unit
        top_k = np.float32(lay[c.NT] - 2)
        for j in range(cnt):
            v = n[j]
            kf = min(max(min(max(np.floor(v * unit), c.ZERO), ntf) - c.ONE, c.ZERO), top_k)
            lo = (kf + c.ONE) * step
            if rounding == c.NEAREST:
                up = (v - lo) >= step * c.HALF
            else:
                frac = min(max((v - lo) * unit, c.ZERO), c.ONE)
                up = u[j] < frac if rounding == c.STOCHASTIC else u[j] >= c.ONE - frac
            q[j] = np.int32(kf) + np.int32(up)
    else:
        nt = lay[c.NT]
        for j in range(cnt):
            v = n[j]
            k = c.table_floor(table, nt, bits, v)
            q[j] = np.int32(k) + np.int32(c._up(v, table[k], table[k + 1], rounding, u[j]))


@njit(nogil=True, cache=True, error_model="numpy")
def replay_codec(b0, b1, x, codes, s16, out, lay, lim, table, B, numel, ostart, nvalid, owner, keys):
    """Blocks b0 .. b1 - 1 of the layout: codes, scales (uint16 words, codec.scale_at) and
    values read back (out) of x (replay.py's docstring); keys: uint32 [tensors, 2]."""
    row = np.empty(B, np.float32)
    u = np.zeros(B, np.float32)
    q = np.empty(B, np.int32)
    rounding, sbf16 = lay[c.ROUND], lay[c.SBF16] != 0
    top, top_min = lim[0], lim[1]
    for b in range(b0, b1):
        start = b * B
        cnt = min(B, numel - start)
        t = owner[b]
        k1, k2 = keys[t, 0], keys[t, 1]
        o, nv = ostart[b], nvalid[b]
        bctr = o // B
        i0 = np.uint64(start)
        amax_bits = np.uint32(0)
        for j in range(cnt):
            v = c.stored_value(x[i0 + np.uint64(j)], lay, False)
            row[j] = v
            amax_bits = max(amax_bits, np.uint32(c.bits_of_f32(v) & np.uint32(0x7FFFFFFF)))
        if sbf16 and amax_bits & np.uint32(0xFFFF):  # round the scale up to a bf16 value
            amax_bits = np.uint32((amax_bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000))
        absmax = c.f32_from_bits(amax_bits)
        inv = top / absmax if absmax >= top_min else c.ZERO
        for j in range(cnt):
            row[j] = row[j] * inv  # n
        if rounding == c.STOCHASTIC:
            for j in range(cnt):
                ctr = o + j if j < nv else (start + j) & 1
                u[j] = c.uniform16(ctr, k1, k2)
        elif rounding == c.BRED:
            ub = c.uniform(bctr, k1, k2)
            for j in range(cnt):
                u[j] = ub
        round_codes(row, u, cnt, lay, table, rounding, q)
        c.store_scale(s16, b, absmax, sbf16)
        c.pack_codes(q, lay[c.BITS], start, cnt, codes)
        c.decode_block(codes, absmax, lay, lim, table, bctr, start, cnt, k1, k2, q, row)
        for j in range(cnt):
            out[i0 + np.uint64(j)] = row[j]
    return 0
