"""numba kernel of the replay's fused code statistics (replay_stats.py says what it counts;
imports numba). One compilation per code storage (packed uint8, or uint16 patterns): bits,
unit, step and the bin's shift and mask are runtime arguments."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c  # sets numba's cache folder before anything here compiles
from . import native as nv
from . import torch_sum_kernel as ts
from .layout import HIST_COPIES

ACC = ts.ACC_SIZE  # torch-order sums' scratch (constants: on the stack)
STREAM = ts.STREAM8

N_CLASSES = 5  # diagnose/stats.N_CODE_CLASSES


LANES = HIST_COPIES  # interleaved histogram copies: neighbours that hit the same bin do not wait on each other


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _add_copies(local, hist, part, nbins):
    """hist[part, k] += the sum of the LANES interleaved local copies of bin k."""
    for k in range(nbins):
        t = np.int64(0)
        for lane in range(LANES):
            t += local[lane * nbins + k]
        hist[part, k] += t


@njit(nogil=True, cache=True, error_model="numpy")
def state_counts(u0, u1, part, x, prev, new, codes, bits, prev_code, last_change, step, unit, sums, hist,
                 shadow, err, shift, mask, lanes, keep, valid, stale):
    """Units u0 .. u1 - 1 (of `unit` elements each) of one state at one replay step: per
    element, nominal = x != prev, stall = nominal and new == prev, code = the stored code
    (unpacked from uint8 `codes` at 4 or 8 bits; a 16-bit float: `codes` is its uint16
    patterns), code stall = nominal and code == prev_code; sums[2 / 3 / 5, u] = the unit's
    stalls / nominal updates / code stalls (fp32, exact below 2**24); last_change = step where
    the code changed; prev_code = code; hist[part, j % copies, bin * 5 + nominal * (1 + stall +
    2 x code stall)] += 1 for the unit's element j, with bin = (code >> shift) & mask (the code
    itself: shift 0; a 16-bit float's binade: its exponent field), hist [threads, copies, bins]
    interleaved copies per thread (layout.hist_copies, a power of two; the caller sums them);
    the error e = new - shadow and e * e (fp32, as torch's). sums[:, u] is the unit's column of
    StateStats' step rows: sums[0 / 1, u] = the sum of e / e * e over the unit in torch's order (lanes: torch's
    fp32 lanes, torch_sum.py; 0: not summed here, err[0] = e and err[1] = e * e are written
    for torch to sum); with keep, err[0] = e is written (a snapshot's errors). sums[4] (the
    shadow's) is the caller's. Per unit: the errors and their sums in one loop (8 lanes:
    streamed, torch_sum_kernel.stream8_*), the comparisons in a second, both branch-free
    (they vectorize; each element's code >> shift and its copy's offset taken from rows, so the
    bin arithmetic stays 32-bit), leaving each element's histogram bin in a row; then the thread's copies
    count the bins (neighbours that hit the same bin do not wait on each other's
    increment; rows held by the caller, not zeroed and added per call: 40 kB of them per
    8-bit state and chunk before). One loop for both did not vectorize (8.2-8.5 ns per
    element, 32 k elements, one thread, against 3.6-3.8 ns split and on borrowed views:
    docs/diagnose.md, "Replay throughput"). stale (int64 [threads, copies, nbins], at a snapshot
    step; nbins 0: none): staleness_counts of the new last_change as well, while its rows are
    in cache (valid: as there), into stale[part, j % copies] (layout.STALE_COPIES, a power of
    two), each element's bin written first (a loop that vectorizes), then counted."""
    x, prev, new, codes, prev_code, last_change, sums, hist, shadow, err, valid, stale = nv.borrowed(
        (x, prev, new, codes, prev_code, last_change, sums, hist, shadow, err, valid, stale))  # no reference counts
    flat, flat_stale = hist.reshape(hist.size), stale.reshape(stale.size)  # the thread's rows, then bin
    q = np.empty(unit, np.int32)
    changed = np.empty(unit, np.int32)
    shifted = np.empty(unit, np.int32)  # code >> shift: the code itself, or a 16-bit float's exponent field
    ea = np.empty(unit, np.float32)
    eb = np.empty(unit, np.float32)
    acc = nv.scratch_f32(ACC)
    s1 = nv.scratch_f32(STREAM)
    s2 = nv.scratch_f32(STREAM)
    streamed = ts.streams8(lanes, unit)
    copies, nbins = hist.shape[1], hist.shape[2]
    own = np.uint64(part * copies * nbins)  # this thread's copies of hist
    s, sh, mk, nb = np.int32(step), np.int32(shift), np.int32(mask), np.int32(nbins)
    e0, e1 = err[0], err[1]
    scopies, sbins = stale.shape[1], stale.shape[2]  # the staleness histogram's (staleness_counts' binning)
    own_stale = np.uint64(part * scopies * sbins)
    top, padded, t1 = np.int64(sbins - 1), valid.size > 1, np.int64(step) + 1  # t1: staleness_counts' step + 1
    copy_at = np.empty(unit, np.int32)  # (j % copies) * nbins: where element j's copy of the bins starts,
    for j in range(unit):  # made once (in the comparison loop, numba's int64 j made it a 64-bit multiply)
        copy_at[j] = np.int32(np.int32(j & (copies - 1)) * nb)
    for u in range(u0, u1):
        start = u * unit
        c.unpack_codes(codes, bits, start, unit, q)
        i0 = np.uint64(start)
        if streamed:  # the sums as the errors are computed (torch_sum_kernel.stream8_*)
            ts.stream8_start(s1)
            ts.stream8_start(s2)
            for g in range(unit // ts.GROUP8):
                b = i0 + np.uint64(g * ts.GROUP8)
                for k in range(np.uint64(ts.GROUP8)):
                    e = new[b + k] - shadow[b + k]
                    s1[k] += e
                    s2[k] += e * e
                ts.stream8_group_done(s1, g)
                ts.stream8_group_done(s2, g)
            sums[0, u] = ts.stream8_sum(s1)
            sums[1, u] = ts.stream8_sum(s2)
            if keep:
                for j in range(unit):
                    i = i0 + np.uint64(j)
                    e0[i] = new[i] - shadow[i]
        else:
            for j in range(unit):
                i = i0 + np.uint64(j)
                e = new[i] - shadow[i]
                ea[j] = e
                eb[j] = e * e
            if lanes > 0:
                sums[0, u] = ts.row_sum(ea, nv.ROW0, unit, lanes, acc)
                sums[1, u] = ts.row_sum(eb, nv.ROW0, unit, lanes, acc)
            if keep or lanes == 0:
                for j in range(unit):
                    e0[i0 + np.uint64(j)] = ea[j]
            if lanes == 0:
                for j in range(unit):
                    e1[i0 + np.uint64(j)] = eb[j]
        n_stall, n_nominal, n_cstall = np.int32(0), np.int32(0), np.int32(0)
        for j in range(unit):  # a loop of its own: numba's shift (int64) kept the comparison loop's bin
            shifted[j] = nv.sar32(q[j], sh)  # arithmetic 64-bit; this one 32-bit (shift < bits <= 16)
        for j in range(unit):  # int32 counts (numba widens an int32 sum to int64: half the lanes)
            i = i0 + np.uint64(j)
            p = prev[i]
            nominal = np.int32(x[i] != p)
            stall = nominal & np.int32(new[i] == p)
            code = q[j]
            same = code == prev_code[i]
            cstall = nominal & np.int32(same)
            lc = last_change[i]  # loaded whatever the test (a load under it made the loop scalar),
            changed[j] = lc if same else s  # and stored apart: in place it became a masked store (slow on AMD)
            prev_code[i] = code
            n_stall = np.int32(n_stall + stall)
            n_nominal = np.int32(n_nominal + nominal)
            n_cstall = np.int32(n_cstall + cstall)
            q[j] = np.int32(np.int32(shifted[j] & mk) * np.int32(N_CLASSES)
                            + np.int32(nominal * np.int32(1 + stall + 2 * cstall)) + copy_at[j])
        for j in range(unit):
            last_change[i0 + np.uint64(j)] = changed[j]
        if sbins:  # each element's bin and copy into `changed` (stored into last_change by now), then counted
            if padded:
                for j in range(unit):
                    k = min(max(t1 - np.int64(changed[j]), np.int64(0)), top)
                    k = k if valid[i0 + np.uint64(j)] else np.int64(0)
                    changed[j] = np.int32(k + np.int64(j & (scopies - 1)) * sbins)
            else:
                for j in range(unit):
                    k = min(max(t1 - np.int64(changed[j]), np.int64(0)), top)
                    changed[j] = np.int32(k + np.int64(j & (scopies - 1)) * sbins)
            for j in range(unit):  # unsigned indices: no negative-index wraparound test
                flat_stale[own_stale + np.uint64(changed[j])] += 1
        for j in range(unit):
            flat[own + np.uint64(q[j])] += 1
        sums[2, u] = np.float32(n_stall)
        sums[3, u] = np.float32(n_nominal)
        sums[5, u] = np.float32(n_cstall)
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def staleness_counts(u0, u1, part, last_change, valid, step, unit, hist):
    """Units u0 .. u1 - 1 of one state at a snapshot step: hist[part, bin] += 1 per element,
    bin = min(step - last_change + 1, nbins - 1) (0 below 0, which last_change <= step never
    gives) for a recorded element and 0 for padding (valid[i] False; valid of size 1: no
    padding), as StateStats._snapshot's torch ops count it. Integer counts: any order gives
    the same histogram, so LANES interleaved copies count neighbours (most elements share a
    few bins: one copy would wait on its own last increment; 3.8 -> 2.4 ns per element at 2**20)."""
    last_change, valid, hist = nv.borrowed((last_change, valid, hist))
    nbins = hist.shape[1]
    top = np.int64(nbins - 1)
    local = np.zeros(LANES * nbins, np.int64)
    padded = valid.size > 1
    s1 = np.int64(step) + 1
    for i in range(u0 * unit, u1 * unit):
        k = min(max(s1 - np.int64(last_change[i]), np.int64(0)), top)
        if padded and not valid[i]:
            k = 0
        local[k + (np.int64(i) & np.int64(LANES - 1)) * nbins] += 1
    _add_copies(local, hist, part, nbins)
    return 0


ACROSS = 8  # units summed at once (torch_sum_kernel.row_sums_across): one AVX-512 vector of fp64


@njit(nogil=True, cache=True, error_model="numpy")
def dimension_sums(u0, u1, part, err, unit, levels, lanes, small, tail):
    """Units u0 .. u1 - 1 of a snapshot's errors (fp32 err [n]): the per-unit parts of the
    dimension statistic (diagnose/stats.py), as StateStats._snapshot's torch ops compute
    them on e = err.double().view(-1, unit). Per unit u, with e_0 = the unit's errors in
    fp64 and e_{k+1}[j] = e_k[2j] + e_k[2j + 1] (the chunk sums of 2**(k+1) errors):
    small[k, u] = sum_j e_k[j] * e_k[j] for k < levels, and tail[u] = sum_j e_levels[j],
    each sum in torch's order of an fp64 row (torch_sum_kernel.row_sum, lanes = torch's
    fp64 lanes), each product and pair sum one correctly rounded fp64 op as torch's, so the
    same bits. unit is a multiple of 2**levels. ACROSS units at a time, interleaved
    (a[j ACROSS + u]: e_k[j] of unit u), so every op is a vector across them (row_sums_across;
    each unit's rows are 2 .. unit values: 2.43 -> 1.16 ns per error at 2**20, unit 128, one
    thread)."""
    err, small, tail = nv.borrowed((err, small, tail))
    U = ACROSS
    uu = np.uint64(U)
    a = np.empty(unit * U, np.float64)  # e_k, then e_{k+1} in b: two rows, so the pair sums vectorize
    b = np.empty(unit * U, np.float64)
    sq = np.empty(unit * U, np.float64)
    acc = np.empty(ACC * U, np.float64)
    for u0b in range(u0, u1, U):
        nu = min(U, u1 - u0b)  # units of this block; the others' lanes sum zeros, not stored
        for u in range(uu):
            if u < nu:
                i0 = np.uint64((u0b + u) * unit)
                for j in range(np.uint64(unit)):
                    a[j * uu + u] = np.float64(err[i0 + j])
            else:
                for j in range(np.uint64(unit)):
                    a[j * uu + u] = 0.0
        m = np.uint64(unit)
        for k in range(levels):
            for x in range(m * uu):
                sq[x] = a[x] * a[x]
            t = ts.row_sums_across(sq, m, lanes, acc, U)
            for u in range(nu):
                small[k, u0b + u] = acc[t + np.uint64(u)]
            m //= np.uint64(2)
            for j in range(m):
                for u in range(uu):
                    b[j * uu + u] = a[2 * j * uu + u] + a[(2 * j + np.uint64(1)) * uu + u]
            a, b = b, a
        t = ts.row_sums_across(a, m, lanes, acc, U)
        for u in range(nu):
            tail[u0b + u] = acc[t + np.uint64(u)]
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def gradient_sums(b0, b1, part, block, g, valid, g2, g4, sq):
    """GradientStats.observe's per-element part of one step's fp32 gradients g [n], over the
    elements [b0 block, min(b1 block, n)) (host.run_parts' range; part unused): sq = g**2
    in fp64 (the cast exact, the product one fp64 op, as torch's g.double() * g.double()),
    g2 += sq, g4 += sq * sq; returns #(g == 0) over the range's recorded elements (valid; of
    size 1: no padding), an exact count. The sum of sq is the caller's (torch_sum.sum64)."""
    g, valid, g2, g4, sq = nv.borrowed((g, valid, g2, g4, sq))
    zeros = np.int64(0)
    i0, i1 = np.uint64(b0 * block), np.uint64(min(b1 * block, g.size))
    if valid.size > 1:  # two loops: the test inside one, with valid[i] loaded under it, kept it scalar
        for i in range(i0, i1):
            _square_into(g, g2, g4, sq, i)
            zeros += np.int64((g[i] == c.ZERO) & valid[i])
    else:
        for i in range(i0, i1):
            _square_into(g, g2, g4, sq, i)
            zeros += np.int64(g[i] == c.ZERO)
    return zeros


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _square_into(g, g2, g4, sq, i):
    """sq[i] = g[i]**2 in fp64 (the cast exact, one fp64 product); g2[i] += it; g4[i] += its square."""
    x = np.float64(g[i])
    s = x * x
    sq[i] = s
    g2[i] += s
    g4[i] += s * s
