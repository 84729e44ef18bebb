"""The floor code of a sorted fp32 code book, shared by the optimizer kernels (codec.py) and
the replay's (replay_kernel.py): k = clamp(#(table <= v) - 1, 0, NT - 2), the code below v
that the rounding starts from (searchsorted(right=True) - 1, clamped).

    floor_code  any code book: a bucket of v's fp32 bits, then 1-2 exact steps (host.search_table
                prepares the buckets once per code book and appends them to the table array)
    floor_codes the same over a row of values, in stages (the replay's encode and model)
    scan_code   a book of at most SCAN_MAX entries: compares and selects against every entry

Both are exact for every fp32 v (tests/test_codebook_search_cpu.py: every entry, its fp32
neighbours, the midpoints). The 4 columns of the layout tuple `lay` (codec.py) that follow
codec's 8 say where the buckets are; the optimizer kernels hold lay as compile-time
constants (the step loop unrolls, NT is known), the replay kernel reads it at run time.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .host import SEARCH_HI, SEARCH_LO
from .native import bits_of_f32, f32_from_bits, pair_at

SHIFT, NM, STEPS, OFF = range(8, 12)  # lay columns after codec's 8 (host.layout_arrays)
MAG_LO, MAG_HI = np.uint32(SEARCH_LO), np.uint32(SEARCH_HI)
LOW, HIGH = np.uint64(0xFFFFFFFF), np.uint64(32)  # a pair's first entry, the shift to its second


@njit(cache=True, inline="always", error_model="numpy")
def floor_code(table, lay, nt, v):
    """clamp(#(table <= v) - 1, 0, nt - 2) (searchsorted(right=True) - 1, clamped) for any
    sorted code book, through a bucket of v's fp32 bits (host.search_table): bucket j, i =
    (clamp(bits(|v|), LO, HI) - LO) >> SHIFT, j = NM + i (v >= +0) or NM - 1 - i (sign set), is
    the pair table[OFF + 2j] = #(table <= its least value) (an int32 bit pattern), table[OFF +
    2j + 1] = the entry at that count; then STEPS (1-2) steps count the entries up to v, the
    first against the pair's entry: 1 + (STEPS - 1) dependent loads, not `bits`.
    lay's constants are compile-time in the optimizer kernels, runtime in the replay's."""
    b = bits_of_f32(v)
    i = np.uint64((min(max(np.uint32(b & np.uint32(0x7FFFFFFF)), MAG_LO), MAG_HI) - MAG_LO)
                  >> np.uint32(lay[SHIFT]))
    nm = np.uint64(lay[NM])
    j = nm - np.uint64(1) - i if b >> np.uint32(31) else nm + i
    p = pair_at(table, np.uint64(lay[OFF]) + np.uint64(2) * j)
    count = np.int64(p & LOW)
    entry = f32_from_bits(np.uint32(p >> HIGH))
    for s in range(lay[STEPS]):
        if s:
            entry = table[np.uint64(count)]
        count += np.int64(entry <= v)
    return min(max(count - 1, np.int64(0)), np.int64(nt - 2))


@njit(cache=True, inline="always", error_model="numpy")
def floor_code_row(table, lay, nt, v, cnt, k, w):
    """floor_code of v[j] for j < cnt into k[j] (int32), in floor_codes' stages (w: a uint64
    scratch row of cnt); nothing else loaded."""
    sh, off = np.uint32(lay[SHIFT]) & np.uint32(31), np.uint32(lay[NM])  # & 31: the shift stays 32-bit
    base = np.uint64(lay[OFF])
    for j in range(cnt):  # bucket NM + i (v >= +0) or NM - 1 - i = NM + ~i (sign set), 2 slots each
        b = bits_of_f32(v[j])
        i = np.uint32((min(max(np.uint32(b & np.uint32(0x7FFFFFFF)), MAG_LO), MAG_HI) - MAG_LO) >> sh)
        neg = np.uint32(np.uint32(0) - np.uint32(b >> np.uint32(31)))  # all ones where the sign is set
        w[j] = base + np.uint64(2) * np.uint64(np.uint32(off + np.uint32(i ^ neg)))
    for j in range(cnt):  # the bucket's count and the entry it points at
        w[j] = pair_at(table, w[j])
    top = np.int32(nt - 2)
    if lay[STEPS] <= 1:  # the one step and the clamp in one loop (de8, de8u: 1.14 -> 1.07 ns per value)
        for j in range(cnt):
            p = w[j]
            kj = np.int32(np.int64(p & LOW) + np.int64(f32_from_bits(np.uint32(p >> HIGH)) <= v[j]) - 1)
            k[j] = min(max(kj, np.int32(0)), top)  # int32 min and max (kj - 1 in numba's int64 kept them 64-bit)
    else:
        for j in range(cnt):  # the first step
            p = w[j]
            k[j] = np.int32(np.int64(p & LOW) + np.int64(f32_from_bits(np.uint32(p >> HIGH)) <= v[j]))
        for s in range(1, lay[STEPS]):  # table[k] (a pair's first entry), then the compare
            for j in range(cnt):
                w[j] = pair_at(table, np.uint64(k[j]))
            for j in range(cnt):
                k[j] = np.int32(k[j] + np.int32(f32_from_bits(np.uint32(w[j] & LOW)) <= v[j]))
        for j in range(cnt):
            k[j] = min(max(np.int32(k[j] - 1), np.int32(0)), top)


@njit(cache=True, inline="always", error_model="numpy")
def floor_codes(table, lay, nt, v, cnt, k, lo, hi, w):
    """floor_code of v[j] for j < cnt into k[j] (int32), with lo[j] = table[k[j]] and hi[j] =
    table[k[j] + 1]; w: a uint64 scratch row of cnt. The same ops per element as floor_code,
    in stages over the rows: the buckets' positions (vectorizes), then the loads, each its own
    scalar loop (LLVM does not gather on these cores, and an AVX2 gather measured 0.43 ns per
    value against 0.32 for scalar loads), each step's compare (vectorizes), the clamp, and lo,
    hi split from their pair (vectorizes). Each load is a pair (native.pair_at) into w: the
    bucket's count with its entry, then table[k], table[k + 1]; a scalar load and a scalar
    store cost about the same (~0.2 ns each), so one u64 store for two fp32 ones took 1.5 ->
    1.05 ns per value (de8, de8u). One loop per element held the loads, compares and branches
    together: 4.4-5.5 against 2.2-2.7 ns per value for the 8-bit books de8 and de8u
    (docs/diagnose.md, "Code-book search in stages")."""
    floor_code_row(table, lay, nt, v, cnt, k, w)
    for j in range(cnt):  # table[k], table[k + 1]
        w[j] = pair_at(table, np.uint64(k[j]))
    for j in range(cnt):
        p = w[j]
        lo[j] = f32_from_bits(np.uint32(p & LOW))
        hi[j] = f32_from_bits(np.uint32(p >> HIGH))


SCAN_MAX = 16  # code books of at most this many entries (4-bit) are scanned, not searched


@njit(cache=True, inline="always", error_model="numpy")
def scan_code(table, nt, v):
    """(k, table[k], table[k + 1]) with k = floor_code's clamp(#(table <= v) - 1, 0, nt - 2),
    for a short code book (nt a compile-time constant): the entries <= v are a prefix (sorted),
    so k = #(table[1 .. nt - 2] <= v), and selecting table[i], table[i + 1] wherever
    table[i] <= v (i = 1 .. nt - 2, from table[0], table[1]) leaves exactly table[k],
    table[k + 1]. nt - 2 compares, adds and pairs of selects against broadcast entries:
    8 elements per AVX2 op (16 per AVX-512 op), no gather (LLVM emulates a gather by scalar loads on these
    cores). The selects are bit masks: written as `t if c else lo`, 28 of them kept the
    block's rounding loop scalar (torchao-4bit raw kernel 84 ms against 15 ms, scripts/cpu_profile.py)."""
    lo, hi = bits_of_f32(table[0]), bits_of_f32(table[1])
    k = np.int32(0)
    for i in range(1, nt - 1):  # unrolled: nt is a constant
        c = table[i] <= v
        m = np.uint32(0) - np.uint32(c)
        lo = np.uint32(lo ^ ((lo ^ bits_of_f32(table[i])) & m))
        hi = np.uint32(hi ^ ((hi ^ bits_of_f32(table[i + 1])) & m))
        k += np.int32(c)
    return k, f32_from_bits(lo), f32_from_bits(hi)
