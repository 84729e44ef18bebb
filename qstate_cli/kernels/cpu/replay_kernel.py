"""numba kernel of the replay's fused codec (replay.py says what it computes; imports numba).

One compilation for every covered state layout: `lay` (codec.py's 8 ints) is a runtime
tuple here, so its branches are taken per block. LLVM does not unswitch a loop on a
runtime condition, so every per-element loop below is written once per case (sqrt or
not, signed or not, each rounding, each format kind) and stays branch-free (a minifloat's
sign is a mask, codec.float_code). A code book's
floor code is found from a bucket of the value's fp32 bits and at most M (1 or 2) steps
(search.floor_code, the optimizer kernels' own search), not a binary search, in stages over
the block (book_rows.round_table: the loads in loops of their own, the rest vectorizes); a 4-bit book
(16 entries) is scanned instead (search.scan_code: compares and selects against every entry,
so the loop vectorizes where the search's dependent loads kept it scalar).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c
from . import native
from . import pairs as pc
from .book_rows import pick, round_table
from .search import scan_code


@njit(cache=True, forceinline=True, error_model="numpy")
def load_stored(x, i0, cnt, lay, row):
    """row[:cnt] = codec.stored_value of x[i0 + j] (op for op); returns the bits of max |row|."""
    amax = np.uint32(0)
    if lay[c.SQRT]:
        for j in range(cnt):
            v = x[i0 + np.uint64(j)]
            v = v if abs(v) < c.INF else c.ZERO
            v = np.sqrt(c.ZERO if v < c.ZERO else v)
            row[j] = v
            amax = max(amax, np.uint32(c.bits_of_f32(v) & np.uint32(0x7FFFFFFF)))
    elif lay[c.SIGNED]:
        for j in range(cnt):
            v = x[i0 + np.uint64(j)]
            v = v if abs(v) < c.INF else c.ZERO
            row[j] = v
            amax = max(amax, np.uint32(c.bits_of_f32(v) & np.uint32(0x7FFFFFFF)))
    else:
        for j in range(cnt):
            v = x[i0 + np.uint64(j)]
            v = v if abs(v) < c.INF else c.ZERO
            v = c.ZERO if v < c.ZERO else v
            row[j] = v
            amax = max(amax, np.uint32(c.bits_of_f32(v) & np.uint32(0x7FFFFFFF)))
    return amax


@njit(cache=True, forceinline=True, error_model="numpy")
def round_linear(n, u, cnt, lay, rounding, d, q):
    """q = clamp(rint(n + dither)) reduced to the format's bits (codec.code_of, linear)."""
    bits = lay[c.BITS]
    mask = np.int32((1 << bits) - 1)
    if lay[c.SIGNED]:
        lo_code, hi_code = np.int32(-(1 << (bits - 1))), np.int32((1 << (bits - 1)) - 1)
    else:
        lo_code, hi_code = np.int32(0), np.int32((1 << bits) - 1)
    if rounding == c.STOCHASTIC:
        for j in range(cnt):
            q[j] = min(max(np.int32(np.rint(n[j] + (u[j] - c.HALF))), lo_code), hi_code) & mask
    elif rounding == c.BRED:
        for j in range(cnt):
            q[j] = min(max(np.int32(np.rint(n[j] + d)), lo_code), hi_code) & mask
    else:
        for j in range(cnt):
            q[j] = min(max(np.int32(np.rint(n[j])), lo_code), hi_code) & mask


@njit(cache=True, forceinline=True, error_model="numpy")
def round_unit(n, u, cnt, lay, rounding, ub, q):
    """Code book {1, ..., UNIT} / UNIT without search (codec.code_of, its closed form, as
    rounding._unit_t computes it): y = n * UNIT, t = k + 1 = clamp(floor(y), 1, NT - 1) after
    clamping floor(y) to [0, NT] (a NaN n takes k = NT - 2, as searchsorted sorts it last), and
    (n - lo) * UNIT = y - t exactly."""
    ntf, unit = np.float32(lay[c.NT]), np.float32(lay[c.UNIT])
    top_t = np.float32(lay[c.NT] - 1)
    if rounding == c.NEAREST:
        for j in range(cnt):
            y = n[j] * unit
            t = min(max(min(max(np.floor(y), c.ZERO), ntf), c.ONE), top_t)
            q[j] = np.int32(t) - np.int32(1) + np.int32((y - t) >= c.HALF)
    elif rounding == c.STOCHASTIC:
        for j in range(cnt):
            y = n[j] * unit
            t = min(max(min(max(np.floor(y), c.ZERO), ntf), c.ONE), top_t)
            q[j] = np.int32(t) - np.int32(1) + np.int32(u[j] < min(max(y - t, c.ZERO), c.ONE))
    else:
        for j in range(cnt):
            y = n[j] * unit
            t = min(max(min(max(np.floor(y), c.ZERO), ntf), c.ONE), top_t)
            q[j] = np.int32(t) - np.int32(1) + np.int32(ub >= c.ONE - min(max(y - t, c.ZERO), c.ONE))


@njit(cache=True, inline="always", error_model="numpy")
def round_book16(n, u, cnt, table, rounding, ub, q, val):
    """round_table for a book of 16 entries (4-bit): k, table[k], table[k + 1] by scan_code
    against the 16 entries, a constant here, so it unrolls and the loop vectorizes (the same
    k as floor_code for every finite n, and n is finite: load_stored zeroes the rest).
    Nearest and stochastic: val[j] = table[q[j]] (codes_read_back)."""
    if rounding == c.NEAREST:
        for j in range(cnt):
            v = n[j]
            k, lo, hi = scan_code(table, 16, v)
            up = (v - lo) >= (hi - lo) * c.HALF
            q[j] = np.int32(k) + np.int32(up)
            val[j] = pick(up, lo, hi)
    elif rounding == c.STOCHASTIC:
        for j in range(cnt):
            v = n[j]
            k, lo, hi = scan_code(table, 16, v)
            up = u[j] < min(max((v - lo) / (hi - lo), c.ZERO), c.ONE)
            q[j] = np.int32(k) + np.int32(up)
            val[j] = pick(up, lo, hi)
    else:
        for j in range(cnt):
            v = n[j]
            k, lo, hi = scan_code(table, 16, v)
            q[j] = np.int32(k) + np.int32(ub >= c.ONE - min(max((v - lo) / (hi - lo), c.ZERO), c.ONE))


@njit(cache=True, forceinline=True, error_model="numpy")
def round_float(n, u, cnt, lay, rounding, ub, q):
    """A minifloat (codec.code_of, its rounding.py case): the floor ordinal and exact fraction
    of |n|, up or not (nearest: ties to the even ordinal), clamped, n's sign bit on top."""
    man, emin, top = lay[c.MAN], lay[c.EMIN], lay[c.MAXORD]
    bits, signed = lay[c.BITS], lay[c.SIGNED]
    if rounding == c.NEAREST:
        for j in range(cnt):
            k, frac = c.float_floor_frac(abs(n[j]), man, emin)
            up = (frac > c.HALF) | ((frac == c.HALF) & ((k & np.int32(1)) == np.int32(1)))
            q[j] = c.float_code(n[j], k + np.int32(up), bits, signed, top)
    elif rounding == c.STOCHASTIC:
        for j in range(cnt):
            k, frac = c.float_floor_frac(abs(n[j]), man, emin)
            q[j] = c.float_code(n[j], k + np.int32(u[j] < frac), bits, signed, top)
    else:
        for j in range(cnt):
            k, frac = c.float_floor_frac(abs(n[j]), man, emin)
            q[j] = c.float_code(n[j], k + np.int32(ub >= c.ONE - frac), bits, signed, top)


@njit(cache=True, forceinline=True, error_model="numpy")
def codes_read_back(val, cnt, sq, delta, out):
    """out[:cnt] = what decode_value gives a code book's codes under nearest or stochastic
    rounding, from the entries the rounding chose (val[j] = table[q[j]]): val * delta, squared
    for a :sqrt state, the same two fp32 ops, without the codes' unpacking and the table's
    loads per element (which LLVM does not vectorize: decode_row's table case)."""
    if sq:
        for j in range(cnt):
            x = val[j] * delta
            out[j] = x * x
    else:
        for j in range(cnt):
            out[j] = val[j] * delta


@njit(cache=True, forceinline=True, error_model="numpy")
def _decode_loop(q, cnt, lay, table, dp, out):
    for j in range(cnt):
        out[j] = c.decode_value(q[j], lay, table, dp)


@njit(cache=True, error_model="numpy")
def decode_row(q, cnt, lay, table, dp, out):
    """out[:cnt] = codec.decode_value of each code in q (codec.decode_block's loop), the loop
    written once per case (format kind x BReD x sqrt): inside each, LLVM folds decode_value's
    tests of lay against the case, so the loop is branch-free and packs (one loop with the
    tests inside stayed scalar: perf, 63% of replay_codec's time on int4). Every copy is the same
    loop, so the case cannot change a value. Written out flat on purpose: the same 16 copies
    through two nested inlined helpers ran as fast but compiled ~20 s slower (docs/diagnose.md).
    Compiled as its own function (LLVM inlines it; numba does not): numba's own inlining of its
    16 copies into replay_codec was ~125 of the kernel's 131 s first-use compile. _decode_loop
    is forceinline (package docstring): compiled once, LLVM copies it into each case, where it
    folds the case's tests as before; decode_row compiles in a few seconds instead of ~50, at
    the same speed (a plain call, not inlined by LLVM, ran ~10% slower)."""
    kind, bred, sq, unit = lay[c.KIND], lay[c.ROUND] == c.BRED, lay[c.SQRT] != 0, lay[c.UNIT] != 0
    if kind == c.LINEAR:
        if bred:
            if sq:
                _decode_loop(q, cnt, lay, table, dp, out)
            else:
                _decode_loop(q, cnt, lay, table, dp, out)
        elif sq:
            _decode_loop(q, cnt, lay, table, dp, out)
        else:
            _decode_loop(q, cnt, lay, table, dp, out)
    elif kind == c.FLOAT:
        if bred:
            if sq:
                _decode_loop(q, cnt, lay, table, dp, out)
            else:
                _decode_loop(q, cnt, lay, table, dp, out)
        elif sq:
            _decode_loop(q, cnt, lay, table, dp, out)
        else:
            _decode_loop(q, cnt, lay, table, dp, out)
    elif unit:
        if bred:
            if sq:
                _decode_loop(q, cnt, lay, table, dp, out)
            else:
                _decode_loop(q, cnt, lay, table, dp, out)
        elif sq:
            _decode_loop(q, cnt, lay, table, dp, out)
        else:
            _decode_loop(q, cnt, lay, table, dp, out)
    elif bred:
        if sq:
            _decode_loop(q, cnt, lay, table, dp, out)
        else:
            _decode_loop(q, cnt, lay, table, dp, out)
    elif sq:
        _decode_loop(q, cnt, lay, table, dp, out)
    else:
        _decode_loop(q, cnt, lay, table, dp, out)


@njit(cache=True, forceinline=True, error_model="numpy")
def block_uniforms(o, nv, start, cnt, k1, k2, u):
    """u[:cnt] = stochastic rounding's uniforms of a block at layout position start whose nv
    recorded elements are flat indices o, o + 1, ... of their tensor (o even: replay.fused_state)."""
    p0 = o >> 1
    for i in range(nv >> 1):  # element o + 2i and the next share hash o / 2 + i: its halves
        u[2 * i], u[2 * i + 1] = pc.pair_uniforms(np.uint32(p0 + i), k1, k2)
    if nv & 1:
        u[nv - 1] = c.uniform16(o + nv - 1, k1, k2)
    for j in range(nv, cnt):  # padding: LayoutStream folds it to hash counter 0
        u[j] = c.uniform16((start + j) & 1, k1, k2)


GOLDEN = np.uint32(0x9E3779B9)


@njit(cache=True, forceinline=True)
def finish_read_back(row, cnt, nv, clamp0, pad0, out, i0):
    """out[i0 + j] = row[j], j < cnt, as the replay keeps the value read back: with clamp0
    max(value, 0) as torch's clamp(min=0) (a negative value is +0; -0.0 and NaN stay), with
    pad0 the positions j >= nv (padding) 0, as the replay's index_fill_ did."""
    for j in range(cnt):
        v = row[j]
        if clamp0 and v < c.ZERO:
            v = c.ZERO
        if pad0 and j >= nv:
            v = c.ZERO
        out[i0 + np.uint64(j)] = v


@njit(cache=True, inline="always")
def _alive(rows):
    """0, read from the scratch rows' owners: a use at the kernel's end, so numba frees them
    only after every use of their borrowed views (it drops a variable after its last use, and
    the tuple holds every row until then)."""
    return rows[0].size + rows[-1].size - rows[0].size - rows[-1].size


@njit(nogil=True, cache=True, error_model="numpy")
def replay_codec(b0, b1, x, codes, s16, out, lay, lim, table, B, numel, plan, base, step, clamp0, pad0):
    """Blocks b0 .. b1 - 1 of the layout: codes, scales (uint16 words, codec.scale_at) and
    values read back (out) of x (replay.py's docstring), out as the replay keeps it with
    clamp0 (a v below 0 read back as 0) and pad0 (padding 0): finish_read_back. plan: int64
    [blocks, 3] = (owner tensor, first flat index: even under stochastic rounding, recorded
    elements); base: uint32 [tensors], the streams' step-free keys, so k1 = hash32(base ^
    step), k2 = hash32(k1 ^ 0x9e3779b9) (quant/hash.stream_keys); table: the code book and
    its search buckets (host.search_table).
    Steps on borrowed views (no reference counts: native.py), the rows' owners kept alive by
    the return."""
    x, codes, s16, out, lim, table, plan, base = native.borrowed((x, codes, s16, out, lim, table, plan, base))
    rows = (np.empty(B, np.float32), np.zeros(B, np.float32), np.empty(B, np.int32), np.empty(B, np.float32),
            np.empty(B, np.float32), np.empty(B, np.uint64))
    row, u, q, lo, hi, w = native.borrowed(rows)  # lo, hi, w: round_table's
    rounding, sbf16 = lay[c.ROUND], lay[c.SBF16] != 0
    book = lay[c.KIND] == c.TABLE and not lay[c.UNIT]  # a searched or scanned code book (round_table, round_book16)
    top, top_min = lim[0], lim[1]
    s32 = np.uint32(step & 0xFFFFFFFF)
    for b in range(b0, b1):
        start = b * B
        cnt = min(B, numel - start)
        k1 = c.hash32(np.uint32(base[plan[b, 0]] ^ s32))
        k2 = c.hash32(np.uint32(k1 ^ GOLDEN))
        o, nv = plan[b, 1], plan[b, 2]
        bctr = o // B
        i0 = np.uint64(start)
        amax_bits = load_stored(x, i0, cnt, lay, row)
        if sbf16 and amax_bits & np.uint32(0xFFFF):  # round the scale up to a bf16 value
            amax_bits = np.uint32((amax_bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000))
        absmax = c.f32_from_bits(amax_bits)
        inv = top / absmax if absmax >= top_min else c.ZERO
        for j in range(cnt):
            row[j] = row[j] * inv  # n
        ub = c.ZERO
        if rounding == c.STOCHASTIC:
            block_uniforms(o, nv, start, cnt, k1, k2, u)
        elif rounding == c.BRED:
            ub = c.uniform(bctr, k1, k2)
        if lay[c.KIND] == c.LINEAR:
            round_linear(row, u, cnt, lay, rounding, ub - c.HALF, q)
        elif lay[c.KIND] == c.FLOAT:
            round_float(row, u, cnt, lay, rounding, ub, q)
        elif lay[c.UNIT]:
            round_unit(row, u, cnt, lay, rounding, ub, q)
        elif lay[c.NT] == 16:
            round_book16(row, u, cnt, table, rounding, ub, q, lo)
        else:
            round_table(row, u, cnt, lay, table, rounding, ub, q, lo, hi, w)
        c.store_scale(s16, b, absmax, sbf16)
        c.pack_codes(q, lay[c.BITS], start, cnt, codes)
        dp = c.decode_params(absmax, lay, lim, bctr, k1, k2)
        if book and rounding != c.BRED:
            codes_read_back(lo, cnt, lay[c.SQRT] != 0, dp[0], row)
        else:
            c.unpack_codes(codes, lay[c.BITS], start, cnt, q)  # codec.decode_block, its loop unswitched
            decode_row(q, cnt, lay, table, dp, row)
        finish_read_back(row, cnt, nv, clamp0, pad0, out, i0)
    return _alive(rows)


@njit(nogil=True, cache=True, error_model="numpy")
def replay_codec16(b0, b1, x, codes, out, lay, B, numel, plan, base, step, clamp0, pad0):
    """An unscaled 16-bit minifloat (bf16, fp16; nearest or stochastic rounding): as
    replay_codec (clamp0 and pad0 too) without scales, n = the stored value itself
    (quantizer.encode, unscaled), in runs of B layout positions (plan, base: as there).
    codes: uint16 [numel], the bit patterns (ordinal | sign << 15) the reference stores as
    int16; bf16 by its bits (round_bf16), fp16 by round_float. Borrowed views, as replay_codec."""
    x, codes, out, plan, base = native.borrowed((x, codes, out, plan, base))
    rows = np.empty(B, np.float32), np.zeros(B, np.float32), np.empty(B, np.int32)
    row, u, q = native.borrowed(rows)
    rounding = lay[c.ROUND]
    bf16 = is_bf16(lay)  # round_bf16
    s32 = np.uint32(step & 0xFFFFFFFF)
    dp = (c.ONE, c.ZERO, c.ZERO, np.int32(0))  # decode_params of an unscaled, undithered block
    for b in range(b0, b1):
        start = b * B
        cnt = min(B, numel - start)
        k1 = c.hash32(np.uint32(base[plan[b, 0]] ^ s32))
        k2 = c.hash32(np.uint32(k1 ^ GOLDEN))
        i0 = np.uint64(start)
        load_stored(x, i0, cnt, lay, row)
        if rounding == c.STOCHASTIC:
            block_uniforms(plan[b, 1], plan[b, 2], start, cnt, k1, k2, u)
        if bf16:
            round_bf16(row, u, cnt, rounding, lay[c.MAXORD], q)
            sq = lay[c.SQRT] != 0
            for j in range(cnt):  # the value of ordinal | sign << 15 is its bits << 16 (codec.float_value)
                codes[i0 + np.uint64(j)] = np.uint16(q[j])
                v = c.f32_from_bits(np.uint32(q[j]) << np.uint32(16))
                u[j] = v * v if sq else v  # codec.decode_value: a :sqrt state squared
        else:
            round_float(row, u, cnt, lay, rounding, c.ZERO, q)
            for j in range(cnt):
                codes[i0 + np.uint64(j)] = np.uint16(q[j])
                u[j] = c.decode_value(q[j], lay, row, dp)
        finish_read_back(u, cnt, plan[b, 2], clamp0, pad0, out, i0)
    return _alive(rows)


@njit(cache=True, inline="always", error_model="numpy")
def is_bf16(lay):
    """bf16 (8 exponent bits, 7 mantissa bits, signed): rounded by its bits (round_bf16)."""
    return lay[c.EMIN] <= -126 and lay[c.MAN] == 7 and lay[c.SIGNED] != 0


@njit(cache=True, forceinline=True, error_model="numpy")
def round_bf16(n, u, cnt, rounding, maxord, q):
    """round_float for bf16 (8 exponent bits, 7 mantissa bits, signed; n finite, as
    load_stored leaves it): |n|'s floor ordinal is its fp32 bits >> 16 and the fraction the
    low 16 bits / 2**16 (rounding.float_floor_frac's bits-only case, emin = -126), so the
    rounding is integer work on the bits: nearest, up if the low bits exceed 0x8000 or equal
    it at an odd ordinal; stochastic, up if u < fraction (the same fp32 compare). Clamped to
    maxord, n's sign bit as bit 15 (rounding.float_code)."""
    for j in range(cnt):
        b = c.bits_of_f32(n[j])
        k = np.int32((b & np.uint32(0x7FFFFFFF)) >> np.uint32(16))
        low = np.int32(b & np.uint32(0xFFFF))
        if rounding == c.NEAREST:
            up = np.int32((low > np.int32(0x8000)) | ((low == np.int32(0x8000)) & ((k & np.int32(1)) == np.int32(1))))
        else:
            up = np.int32(u[j] < np.float32(low) * np.float32(1.0 / 65536.0))
        q[j] = min(k + up, np.int32(maxord)) | np.int32((b >> np.uint32(31)) << np.uint32(15))
