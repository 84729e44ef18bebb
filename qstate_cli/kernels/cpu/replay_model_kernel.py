"""numba kernel of the replay's fused staleness model (replay_model.py says what it computes;
imports numba). One compilation for every layout: the format (kind, code range, top, code
book), sqrt, rounding and block size are runtime arguments. Every float op is the fp32 op
diagnose/staleness.py's torch code makes, in its order (fastmath off: no FMA); clamps keep
NaN as torch's do; torch.round is half to even (np.rint)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import codec as c  # sets numba's cache folder before anything here compiles
from . import native as nv
from .book_rows import pick
from .search import HIGH, LOW, NM, OFF, floor_code_row

# prm columns (replay_model.StalenessModel; 8 .. 11: search.py's SHIFT, NM, STEPS, OFF, or a
# minifloat's MAN, EMIN, MAXORD as in codec.py's lay)
P_KIND, P_SQRT, P_ROUND, P_VALID, P_GAUSS, P_NT, P_SIGNED, P_SCALED = range(8)
P_UNIT = 12  # a code book that is exactly {1, ..., UNIT} / UNIT: UNIT (its floor code in closed form), else 0
LINEAR, BOOK, FLOAT = 0, 1, 2
INF_BITS = np.uint32(0x7F800000)
CHUNK = 2048  # elements per pass of model_pass's loops (whole blocks; a block of more is one chunk)


@njit(cache=True, error_model="numpy")
def chunk_windows(src, start, cnt, B, prm, lim, table, frac, binade, y, dl, dn, up, o0, rows):
    """staleness.windows of the blocks (of B elements) in src[start : start + cnt], a whole
    number of them, given y = src (x, or torch's sqrt(clamp(x, 0)): torch's CPU sqrt is not
    the correctly rounded one), into dn[o0 + j], up[o0 + j]; y, dl: scratch rows (n, the
    normalised value; delta, its block's). Only the absmax and n = y / delta loop per block:
    every other loop runs over the whole chunk, so its setup (LLVM's alias checks and
    remainder) is paid once per chunk, not per block (68 -> ~35 us on the demo's 25,344
    elements of int4). binade: a minifloat's gaps are its binade average lim[3] |n|
    (windows(binade_average=True)); rows: the scratch rows (code, bucket pair) of a searched
    code book's search (search.floor_code_row). Compiled as a function of its own, not
    inlined by numba: its two inlined copies were ~10 of model_pass's ~23 s first-use compile,
    and one call per chunk costs nothing measurable (docs/cpu.md, "Compile time")."""
    i0 = np.uint64(start)
    lo, hi = lim[0], lim[1]
    o = np.uint64(o0)
    for b in range(0, cnt, B):
        ib = i0 + np.uint64(b)
        amax = lim[2]  # an unscaled state: delta = 1, n = y
        if prm[P_SCALED]:  # amax(|y|) as the running max of |y|'s bit patterns (codec.abs_bits: a
            ab = np.uint32(0)  # NaN's are above inf's, so a NaN propagates as in torch's amax; it vectorizes)
            for j in range(B):
                ab = max(ab, c.abs_bits(src[ib + np.uint64(j)]))
            amax = c.f32_from_bits(ab)
        delta = amax / lim[2]
        bb = np.uint64(b)  # an unsigned index: with b + j (int64) LLVM kept numba's negative-index
        for j in range(B):  # fix-up per lane and stored through a scatter (vscatterqps: 27% of the pass)
            dl[bb + np.uint64(j)] = delta
    for j in range(cnt):  # n = y / delta (else 0: torch.where(delta > 0, ...))
        d = dl[j]
        y[j] = src[i0 + np.uint64(j)] / d if d > c.ZERO else c.ZERO
    if prm[P_KIND] == LINEAR:
        for j in range(cnt):
            k = np.rint(y[j])  # clamp(lo, hi) then k > lo, k < hi: the same tests (NaN: both false)
            dn[o + np.uint64(j)] = (c.ONE if k > lo else c.INF) * dl[j] * frac
            up[o + np.uint64(j)] = (c.ONE if k < hi else c.INF) * dl[j] * frac
    elif prm[P_KIND] == FLOAT:
        float_gaps(y, cnt, prm, lim[3], binade, dn, up, o)
        for j in range(cnt):
            i = o + np.uint64(j)
            dn[i] = dn[i] * dl[j] * frac
            up[i] = up[i] * dl[j] * frac
    elif prm[P_UNIT]:  # {1, ..., UNIT} / UNIT: the code book branch below in closed form, the same values
        unit_windows(y, cnt, prm[P_UNIT], prm[P_NT], dl, frac, dn, up, o)
    elif prm[P_NT] == 16:  # a 4-bit book: the branch below by a scan, the same values
        book16_windows(y, cnt, table, dl, frac, dn, up, o)
    else:  # a searched code book: the code from its thresholds' buckets (thresholds.nearest_thresholds)
        nt = prm[P_NT]
        gaps = np.uint64(prm[OFF] + 4 * prm[NM])  # replay_model.code_gaps, past the search buckets' pairs
        kq, w = rows
        floor_code_row(table, prm, nt + 1, y, cnt, kq, w)  # #(thresholds <= n) - 1: the nearest code
        top = np.int32(nt - 2)
        for j in range(cnt):  # a NaN n (inf / inf) sorts last: floor code nt - 2, and f >= 0.5 is False
            kq[j] = kq[j] if y[j] == y[j] else top
        for j in range(cnt):  # the gaps below and above, one pair load (scalar: no gather here)
            w[j] = nv.pair_at(table, gaps + np.uint64(2) * np.uint64(kq[j]))
        for j in range(cnt):
            p = w[j]
            dn[o + np.uint64(j)] = c.f32_from_bits(np.uint32(p & LOW)) * dl[j] * frac
            up[o + np.uint64(j)] = c.f32_from_bits(np.uint32(p >> HIGH)) * dl[j] * frac
    if prm[P_SQRT]:  # gaps on y = sqrt(x) -> gaps on x around the same point
        for j in range(cnt):
            y0 = abs(src[i0 + np.uint64(j)])
            i = o + np.uint64(j)
            t = y0 + up[i]
            up[i] = t * t - y0 * y0
            r = y0 - dn[i]
            r = c.ZERO if r < c.ZERO else r
            dn[i] = y0 * y0 - r * r


@njit(cache=True, forceinline=True, error_model="numpy")
def unit_windows(y, cnt, unit, nt, dl, frac, dn, up, o):
    """chunk_windows' code book case for the book {1, ..., unit} / unit (nt = unit entries),
    without loads: table[k] = (k + 1) / unit, each gap 1 / unit (inf below code 0 and above
    code nt - 1), all exact in fp32 (power-of-two scalings of small integers), and the floor
    code #(table <= n) - 1 = clamp(floor(n * unit), 0, nt) - 1 clamped to [0, nt - 2], n * unit
    exact (the codec's round_unit); a NaN n takes code nt - 2, as searchsorted sorts it last.
    The rounding test f >= 1/2, f = (n - table[k]) / (1 / unit), takes the product by unit.
    Each gap g is written as g * delta * frac (delta = dl[j], the element's block's), the same
    two products in the same order."""
    uf, top_k, last = np.float32(unit), np.float32(nt - 2), np.float32(nt - 1)
    step = c.ONE / uf
    for j in range(cnt):
        n = y[j]
        kf = min(max(min(max(np.floor(n * uf), c.ZERO), np.float32(nt)) - c.ONE, c.ZERO), top_k)
        kf = kf if n == n else top_k
        tlo = (kf + c.ONE) * step
        # f = (n - tlo) / (thi - tlo), thi - tlo = step exactly: a division by the power of two
        # 1 / unit, which is the (exact) product by unit, the same value without the divider
        # (clamp(0, 1) does not change f >= 0.5; NaN: False)
        f = (n - tlo) * uf
        k = kf + (c.ONE if f >= c.HALF else c.ZERO)
        dn[o + np.uint64(j)] = (c.INF if k == c.ZERO else step) * dl[j] * frac
        up[o + np.uint64(j)] = (c.INF if k == last else step) * dl[j] * frac


@njit(cache=True, forceinline=True, error_model="numpy")
def book16_windows(y, cnt, table, dl, frac, dn, up, o):
    """chunk_windows' code book case for a book of 16 entries (de4, de4u, de4unz) without the
    search's dependent loads, so the loop vectorizes: the floor code k0 = #(table[1 .. 14] <= n)
    (search.scan_code's scan) also selects table[k0 - 1] and table[k0 + 2], and each gap is the
    fp32 difference code_gaps holds (inf below code 0 and above code 15); a NaN n takes k0 =
    14, as the search's caller sets it. table[16] is the search table's +inf padding."""
    lo0, hi0, nx0 = c.bits_of_f32(table[0]), c.bits_of_f32(table[1]), c.bits_of_f32(table[2])
    lo14, hi14, pv14 = c.bits_of_f32(table[14]), c.bits_of_f32(table[15]), c.bits_of_f32(table[13])
    for j in range(cnt):
        n = y[j]
        pv, lo, hi, nx = lo0, lo0, hi0, nx0
        k0 = np.int32(0)
        for i in range(1, 15):  # unrolled: selects as bit masks (scan_code's reason)
            m = np.uint32(0) - np.uint32(table[i] <= n)
            pv = np.uint32(pv ^ ((pv ^ c.bits_of_f32(table[i - 1])) & m))
            lo = np.uint32(lo ^ ((lo ^ c.bits_of_f32(table[i])) & m))
            hi = np.uint32(hi ^ ((hi ^ c.bits_of_f32(table[i + 1])) & m))
            nx = np.uint32(nx ^ ((nx ^ c.bits_of_f32(table[i + 2])) & m))
            k0 += np.int32(table[i] <= n)
        bad = np.uint32(0) - np.uint32(n != n)  # NaN: code 14 and its neighbours
        pv = np.uint32(pv ^ ((pv ^ pv14) & bad))
        lo = np.uint32(lo ^ ((lo ^ lo14) & bad))
        hi = np.uint32(hi ^ ((hi ^ hi14) & bad))
        k0 = np.int32(k0 | (np.int32(14) & np.int32(bad)))  # k0 is 0 where n is NaN
        tp, tlo, thi, tnx = c.f32_from_bits(pv), c.f32_from_bits(lo), c.f32_from_bits(hi), c.f32_from_bits(nx)
        f = (n - tlo) / (thi - tlo)  # clamp(0, 1) does not change f >= 0.5 (NaN: False)
        mu = np.uint32(0) - np.uint32(f >= c.HALF)
        k = k0 + np.int32(mu & np.uint32(1))
        width = c.bits_of_f32(thi - tlo)
        below = np.uint32(c.bits_of_f32(tlo - tp) ^ ((c.bits_of_f32(tlo - tp) ^ width) & mu))
        above = np.uint32(width ^ ((width ^ c.bits_of_f32(tnx - thi)) & mu))
        below = np.uint32(below ^ ((below ^ INF_BITS) & (np.uint32(0) - np.uint32(k == 0))))  # inf below code 0
        above = np.uint32(above ^ ((above ^ INF_BITS) & (np.uint32(0) - np.uint32(k == 15))))  # and above code 15
        dn[o + np.uint64(j)] = c.f32_from_bits(below) * dl[j] * frac
        up[o + np.uint64(j)] = c.f32_from_bits(above) * dl[j] * frac


@njit(cache=True, forceinline=True, error_model="numpy")
def float_gaps(y, cnt, prm, avg_per_mag, binade, dn, up, o):
    """staleness._grid_gaps of a minifloat (then the binade average if asked) for n = y[j]:
    the gaps below and above the ordinal nearest to |n| (a signed format's 0 has +-value(1)
    as neighbours; an unsigned one's nothing below), swapped for negative n. A NaN n takes
    ordinal 0, as torch's NaN -> int32 (INT_MIN) clamped does, unless emin <= -126 (bf16:
    the ordinal from the bits, NaN's too, as formats._float_floor_frac)."""
    top, signed = prm[c.MAXORD], prm[P_SIGNED] != 0
    bits_only = prm[c.EMIN] <= -126
    v1 = c.float_value(np.int32(1), prm)
    for j in range(cnt):
        n = y[j]
        mag = abs(n)
        k = np.int32(0)
        if (mag == mag) | bits_only:
            k0, f = c.float_floor_frac(mag, prm[c.MAN], prm[c.EMIN])
            k = min(max(np.int32(k0 + np.int32(f >= c.HALF)), np.int32(0)), np.int32(top))
        val = c.float_value(k, prm)
        above = c.float_value(np.int32(k + 1), prm) - val if k < top else c.INF
        below = val - c.float_value(np.int32(k - 1), prm) if k > 0 else (v1 if signed else c.INF)
        neg = n < c.ZERO
        gd = above if neg else below
        gu = below if neg else above
        if binade:
            avg = avg_per_mag * mag
            gd = gd if (abs(gd) == c.INF) | (avg == c.ZERO) else avg
            gu = gu if (abs(gu) == c.INF) | (avg == c.ZERO) else avg
        dn[o + np.uint64(j)] = gd
        up[o + np.uint64(j)] = gu


@njit(nogil=True, cache=True, error_model="numpy")
def model_pass(b0, b1, part, x_hat, x_new, yx, ys, valid, emp, nominal, down, up, counts, prm, lim, table, B, numel):
    """Blocks b0 .. b1 - 1 (of B elements), CHUNK elements (whole blocks) at a time:
    emp / nominal from x_hat, x_new (staleness.predict's empirical part, padding masked;
    windows on yx = x_hat or its sqrt), down / up = the windows on ys (s or its sqrt) if
    prm[P_GAUSS]; counts[part] += the nominal updates of recorded elements."""
    per = max(1, CHUNK // B)  # blocks per chunk
    W = per * B
    rdn = np.empty(W, np.float32)
    rup = np.empty(W, np.float32)
    y = np.empty(W, np.float32)
    dl = np.empty(W, np.float32)
    rows = np.empty(W, np.int32), np.empty(W, np.uint64)
    rounding = prm[P_ROUND]
    sr = rounding == c.STOCHASTIC
    frac = c.ONE if sr else c.HALF
    has_valid = prm[P_VALID] != 0
    total = 0
    for b in range(b0, b1, per):
        start = b * B
        cnt = min(min(b + per, b1) * B, numel) - start  # whole blocks: B divides numel (StalenessModel)
        i0 = np.uint64(start)
        if rounding != c.BRED:
            chunk_windows(yx, start, cnt, B, prm, lim, table, frac, nv.YES, y, dl, rdn, rup, nv.ROW0, rows)
        if has_valid:  # nominal (recorded elements only); two loops: a test inside kept it scalar
            for j in range(cnt):
                i = i0 + np.uint64(j)
                nominal[i] = ((x_new[i] - x_hat[i]) != c.ZERO) & valid[i]
        else:
            for j in range(cnt):
                i = i0 + np.uint64(j)
                nominal[i] = (x_new[i] - x_hat[i]) != c.ZERO
        if rounding == c.BRED:
            for j in range(cnt):
                emp[i0 + np.uint64(j)] = c.ZERO
        elif sr:
            for j in range(cnt):
                i = i0 + np.uint64(j)
                d = x_new[i] - x_hat[i]
                # both gaps loaded, the one divided by picked as a bit mask (a select of the two
                # loads became a select of their addresses, loaded through vgatherqps)
                w = pick(d > c.ZERO, rdn[j], rup[j])
                p = c.ONE - abs(d) / w
                p = c.ZERO if p < c.ZERO else p  # clamp(min=0): NaN stays
                emp[i] = p if nominal[i] else c.ZERO
        else:
            for j in range(cnt):
                i = i0 + np.uint64(j)
                d = x_new[i] - x_hat[i]
                p = c.ONE if (d > -rdn[j]) & (d < rup[j]) else c.ZERO
                emp[i] = p if nominal[i] else c.ZERO
        for j in range(cnt):
            total += np.int64(nominal[i0 + np.uint64(j)])
        if prm[P_GAUSS]:
            chunk_windows(ys, start, cnt, B, prm, lim, table, frac, nv.NO, y, dl, down, up, start, rows)
    counts[part] += total
    return 0


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def model_team(kernel, nparts, nblocks, x_hat, x_new, yx, ys, valid, emp, nominal, down, up, counts, prm, lim, table,
               B, numel):
    """model_pass over blocks 0 .. nblocks - 1 split into nparts contiguous ranges, one per
    thread of numba's team (team.py; part p: counts[p]), model_pass called by its address
    `kernel` (replay_step_kernel's team launches say why): the same values as one call."""
    (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12) = prm
    for p in prange(nparts):
        nv.call_compiled(kernel, (nblocks * p // nparts, nblocks * (p + 1) // nparts, p, x_hat, x_new, yx, ys, valid,
                                  emp, nominal, down, up, counts,
                                  (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12), lim, table, B, numel))
    return 0
