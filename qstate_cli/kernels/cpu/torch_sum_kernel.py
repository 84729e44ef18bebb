"""numba: torch's CPU sum, in torch's own order of additions (torch_sum.py says why and
checks it against torch; imports numba).

torch (ATen's cascade sum, SumKernel.cpp) sums a contiguous row of n values, accumulating
in the result's dtype, as follows, with W the lanes of one of its vectors of that dtype:

    n >= W: the row's first V = n // W vectors in groups of 4 (4 W values): accumulators
            acc[k, lane] += value of group r, vector k, lane, over the groups in a cascade of
            4 levels (below); the V % 4 vectors left over are added to acc[0]; then acc[0] +=
            acc[1], acc[2], acc[3]; the result is ((0 + the n % W tail values one by one) +
            acc[0, 0]) + acc[0, 1] + ... + acc[0, W - 1]
    n < W:  the same with W = 1 (groups of 4 values): ((acc[0] + the n % 4 left over) +
            acc[1]) + acc[2] + acc[3]

The cascade over G groups: level_power p = max(4, ceil_log2(G) // 4); every 2**p groups the
level-0 accumulators are added into level 1 and zeroed, level 1 into level 2 whenever the
group count is a multiple of 2**(2p), and so on (4 levels); the groups after the last full
2**p run stay in level 0; at the end level 0 += levels 1, 2, 3. Every addition is one
correctly rounded op in the accumulator's dtype (fastmath off), so the same order gives
the same bits.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c  # noqa: F401 - sets numba's cache folder before anything here compiles
from . import native as nv

LEVELS = 4  # cascade levels
ILP = 4  # vectors per group
MAX_LANES = 16  # the most lanes W a probe tries
ACC_SIZE = LEVELS * ILP * MAX_LANES + 1  # row_sum's scratch


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _ceil_log2(x):
    if x <= 2:
        return 1
    k = 0
    y = x - 1
    while y > 0:
        y >>= 1
        k += 1
    return k


@njit(nogil=True, cache=True, forceinline=True, error_model="numpy")
def _cascade(a, start, groups, width, acc, rows):
    """acc[0 : 4 width] = the per-(vector, lane) sums of `groups` groups of 4 width values from
    a[start], in acc's dtype (a float64 acc: each fp32 value cast, then added); of each of
    `rows` interleaved rows at once (1: one row; row_sums_across). Indices are uint64 (numba
    then skips its negative-index wraparound, so the loops vectorize)."""
    r = np.uint64(ILP * width) * np.uint64(rows)  # a group's values (of every row: row_sums_across)
    p = max(4, _ceil_log2(groups) // LEVELS)
    step = 1 << p
    # levels above 0 stay zero unless a run of 2**p groups fills level 0; adding their +0.0
    # changes no sum (an accumulator starts at +0.0 and never holds -0.0), so a short row
    # skips them: it zeros and folds level 0 only (replay_stats_kernel.dimension_sums, rows of
    # 2 .. 128 values: 4.6 -> 3.1 ms per 2**20 errors)
    levels = np.uint64(LEVELS) if groups >= step else np.uint64(1)
    for e in range(levels * r):
        acc[e] = 0.0
    mask = step - 1
    i = 0
    while i + step <= groups:
        for _ in range(step):
            base = np.uint64(start) + np.uint64(i) * r
            for e in range(r):
                acc[e] += a[base + e]
            i += 1
        for lev in range(1, LEVELS):
            hi, lo = np.uint64(lev) * r, np.uint64(lev - 1) * r
            for e in range(r):
                acc[hi + e] += acc[lo + e]
                acc[lo + e] = 0.0
            if i & (mask << (lev * p)):
                break
    while i < groups:
        base = np.uint64(start) + np.uint64(i) * r
        for e in range(r):
            acc[e] += a[base + e]
        i += 1
    for lev in range(np.uint64(1), levels):
        hi = lev * r
        for e in range(r):
            acc[e] += acc[hi + e]


@njit(nogil=True, cache=True, error_model="numpy")
def row_sum(a, start, n, lanes, acc):
    """The sum of fp32 a[start : start + n] as torch adds it (module docstring), W = lanes,
    in acc's dtype: float32 (x.sum(dtype=float32), lanes = torch's fp32 lanes) or float64
    (x.sum(dtype=float64): cast, then summed; lanes = its fp64 lanes). acc: scratch of
    ACC_SIZE values; its last holds the running sum. A function of its own, not inlined by
    numba: its 14 inlined copies in the replay's kernels were ~22 s of their first-use compile,
    and a call per row costs nothing measurable (docs/cpu.md, "Compile time")."""
    t = np.uint64(acc.size - 1)
    s0 = np.uint64(start)
    if n < lanes:  # one lane: groups of 4 values
        groups = n // ILP
        _cascade(a, start, groups, 1, acc, 1)
        acc[t] = acc[0]
        for k in range(np.uint64(groups * ILP), np.uint64(n)):
            acc[t] += a[s0 + k]
        for k in range(1, ILP):
            acc[t] += acc[np.uint64(k)]
        return acc[t]
    w = np.uint64(lanes)
    vectors = n // lanes
    groups = vectors // ILP
    _cascade(a, start, groups, lanes, acc, 1)
    for v in range(np.uint64(groups * ILP), np.uint64(vectors)):  # vectors left over: into acc[0]
        base = s0 + v * w
        for lane in range(w):
            acc[lane] += a[base + lane]
    for k in range(1, ILP):
        for lane in range(w):
            acc[lane] += acc[np.uint64(k) * w + lane]
    acc[t] = 0.0
    for k in range(np.uint64(vectors * lanes), np.uint64(n)):
        acc[t] += a[s0 + k]
    for lane in range(w):
        acc[t] += acc[lane]
    return acc[t]


# ---- U rows at once: the same order per row, each op a vector across the rows ---------------------
# Rows interleaved, a[x U + u] = value x of row u, and accumulators likewise (acc[e U + u]):
# every loop of _cascade (its `rows` = U) and row_sum over a group's values, e < r, becomes
# one flat loop over e U + u < r U, the same additions per row in the same order (so each
# row's bits), and the vector units work across the rows instead of along short rows (the
# dimension statistic's rows of 2 .. unit values: replay_stats_kernel.dimension_sums).
@njit(nogil=True, cache=True, forceinline=True, error_model="numpy")
def row_sums_across(a, n, lanes, acc, U):
    """row_sum of each of U interleaved rows of n values (a[x U + u]; acc: scratch of ACC_SIZE
    U values, in the sums' dtype): row u's sum, torch's bits, lands in acc[t + u], t = the
    returned offset."""
    uu = np.uint64(U)
    t = np.uint64(acc.size) - uu
    if n < lanes:  # one lane: groups of 4 values
        groups = n // ILP
        _cascade(a, nv.ROW0, groups, 1, acc, U)
        for u in range(uu):
            acc[t + u] = acc[u]
        for x in range(np.uint64(groups * ILP) * uu, np.uint64(n) * uu):
            acc[t + x % uu] += a[x]
        for k in range(1, ILP):
            for u in range(uu):
                acc[t + u] += acc[np.uint64(k) * uu + u]
        return t
    w = np.uint64(lanes) * uu  # a vector's values of every row
    vectors = n // lanes
    groups = vectors // ILP
    _cascade(a, nv.ROW0, groups, lanes, acc, U)
    for v in range(np.uint64(groups * ILP), np.uint64(vectors)):  # vectors left over: into acc[0]
        base = v * w
        for e in range(w):
            acc[e] += a[base + e]
    for k in range(1, ILP):
        for e in range(w):
            acc[e] += acc[np.uint64(k) * w + e]
    for u in range(uu):
        acc[t + u] = 0.0
    for x in range(np.uint64(vectors * lanes) * uu, np.uint64(n) * uu):
        acc[t + x % uu] += a[x]
    for lane in range(np.uint64(lanes)):
        for u in range(uu):
            acc[t + u] += acc[lane * uu + u]
    return t


# ---- 8 lanes, streamed: a row's sum accumulated while its values are computed --------------------
# At 8 lanes a row of n = 32 G values (G groups of 4 vectors) with G < 256 takes the cascade's
# first two levels only: level 0 sums 16 groups at a time, element by element of the group,
# level 1 adds those block sums in turn; at the end level 0 (the groups after the last
# full block, or zeros) + level 1, then the 4 vectors into the first and its 8 lanes into 0.
# (Adding a zero changes no sum: the accumulators start at +0 and never hold -0.) So the
# kernels add each value into acc[e] (e = its place in its group) as they compute it.
GROUP8 = 32  # values per group at 8 lanes
STREAM8 = 2 * GROUP8  # a streamed sum's accumulators: level 0, level 1
MAX_GROUPS8 = 256  # rows of fewer groups: levels 0 and 1 only


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def streams8(lanes, n):
    """Whether a row of n values can be summed streamed (torch's 8 lanes, whole groups, < 256 of them)."""
    return lanes == 8 and n % GROUP8 == 0 and n // GROUP8 < MAX_GROUPS8


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def stream8_start(acc):
    for e in range(np.uint64(STREAM8)):
        acc[e] = np.float32(0.0)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def stream8_group_done(acc, g):
    """After group g (from 0): every 16 groups, level 0 into level 1."""
    if (g + 1) & 15 == 0:
        for e in range(np.uint64(GROUP8)):
            acc[np.uint64(GROUP8) + e] += acc[e]
            acc[e] = np.float32(0.0)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def stream8_sum(acc):
    """The row's sum, torch's bits (row_sum(row, 0, n, 8, ...) for n = 32 G, G < MAX_GROUPS8)."""
    for e in range(np.uint64(GROUP8)):
        acc[e] += acc[np.uint64(GROUP8) + e]
    for k in range(np.uint64(1), np.uint64(ILP)):
        for lane in range(np.uint64(8)):
            acc[lane] += acc[k * np.uint64(8) + lane]
    s = np.float32(0.0)
    for lane in range(np.uint64(8)):
        s += acc[lane]
    return s


@njit(nogil=True, cache=True, error_model="numpy")
def streamed8(a, out):
    """out[r] = the streamed 8-lane sum of each row of fp32 a [rows, 32 G] (tests)."""
    acc = np.empty(STREAM8, np.float32)
    n = a.shape[1]
    for r in range(a.shape[0]):
        stream8_start(acc)
        for g in range(n // GROUP8):
            for e in range(GROUP8):
                acc[e] += a[r, g * GROUP8 + e]
            stream8_group_done(acc, g)
        out[r] = stream8_sum(acc)
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def row_sums(a, lanes, out):
    """out[r] = torch's a[r].sum(dtype=out.dtype) of each row of fp32 a [rows, n]: float32, or
    float64 (each value cast, then summed), with lanes = torch's lanes of that dtype; or of
    fp64 a into float64 out (the probes, tests)."""
    acc = np.empty(ACC_SIZE, out.dtype)
    n = a.shape[1]
    flat = a.reshape(-1)
    for r in range(a.shape[0]):
        out[r] = row_sum(flat, r * n, n, lanes, acc)
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def row_sums_interleaved(a, lanes, out):
    """out[u] = row_sums_across's sum of row u of fp64 a [U, n], the rows interleaved first (tests)."""
    U, n = a.shape
    x = np.empty(U * n, np.float64)
    for u in range(U):
        for j in range(n):
            x[j * U + u] = a[u, j]
    acc = np.empty(ACC_SIZE * U, np.float64)
    t = row_sums_across(x, n, lanes, acc, U)
    for u in range(U):
        out[u] = acc[t + np.uint64(u)]
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def add_step(u, units, series, i, lanes):
    """StateStats._add / UpdateStats' bookkeeping of one step, as torch does it: units += u
    (fp64 += fp32, elementwise) and series[r, i] = u[r].sum(dtype=float64) per row r of the
    step's fp32 per-unit sums u [rows, n_units] (lanes: torch's fp64 lanes)."""
    acc = np.empty(ACC_SIZE, np.float64)
    n = u.shape[1]
    for r in range(u.shape[0]):
        for k in range(n):
            units[r, k] += np.float64(u[r, k])
        series[r, i] = row_sum(u[r], nv.ROW0, n, lanes, acc)
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def range_sum(a, start, n, lanes):
    """row_sum of fp32 a[start : start + n] in fp64 (x.sum(dtype=float64)'s order for one of
    split_sum's chunks), as a call of its own: a thread sums the rows it wrote (torch_sum.sum_plan)."""
    acc = np.empty(ACC_SIZE, np.float64)
    return row_sum(a, start, n, lanes, acc)


@njit(nogil=True, cache=True, error_model="numpy")
def split_sum(a, parts, lanes):
    """torch's a.sum(dtype=float64) of a 1-D fp32 (or fp64) a, as ATen splits a sum to one
    value over `parts` threads (torch_sum.sum64 works out `parts`): chunks of ceil(n / parts)
    values, each summed as a row (row_sum, lanes = torch's fp64 lanes), then 0 + the chunk
    sums in thread order. Summed here on one thread: the bits depend on the chunks only."""
    acc = np.empty(ACC_SIZE, np.float64)
    n = a.size
    chunk = (n + parts - 1) // parts
    total = 0.0
    for t in range(parts):
        b0 = min(n, t * chunk)
        total += row_sum(a, b0, min(n, b0 + chunk) - b0, lanes, acc)
    return total
