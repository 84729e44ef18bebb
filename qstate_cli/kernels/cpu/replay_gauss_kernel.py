"""numba kernels of the replay's fused Gaussian staleness model (replay_gauss.py says what they
compute): one pass over a range of elements, each element's G from its own inputs. Every fp32
op is the one diagnose/staleness.py's torch code makes, in its order (fastmath off: no FMA),
with torch's rules for a Python scalar c: t * c, t + c, c - t and t / c take fp32(c); c / t
is torch's reciprocal(t) * fp32(c). sqrt, erf and exp are fp32_math's, which staleness.py
takes on CPU (fp32_math_kernel.py: the same bits). Clamps keep NaN and -0.0 as torch's do.
Each kernel steps elements [b0 B, min(b1 B, n)) (host.run_parts).

Rows: v_gauss and m_gauss step ROW (32) elements at a time, in three loops that vectorize:
the arguments of the row's erfs, then each erf over the row (fp32_math_kernel.erf_row), then
the rest. A vector loop computes both of erf32's branches in every lane; a row whose
arguments all lie outside [1, 4) skips the tail's branch (exp, a division, a degree-9
polynomial), the same bits. On the 1 M synthetic trace's states the erf argument z / sqrt 2
(z = m / sigma) is below 1 throughout, v's sqrt(a / 2) below 1 and its sqrt(b / 2) mostly 4 or
more (b >= 32), and a 16-bit float's m arguments all below 1; 4-bit m's a and b mostly need
the tail, and there rows cost a little (m_nearest at AVX2 5.1 against 4.6 ns per element;
docs/diagnose.md, "Replay throughput"). The last row of a range ends
at its end (row_at); a range of fewer than ROW elements is copied into a row padded with
zeros (padded_row)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import codec as c  # sets numba's cache folder before anything here compiles
from . import native as nv
from .fp32_math_kernel import ROW, erf32, erf_row, erf_tail_lane, exp_tail32, sqrt32


@njit(cache=True, inline="always", error_model="numpy")
def columns(cst):
    """cst's fp32 columns (replay_gauss.constants): 1 - beta, c, 1e30, pi, sqrt 2, sqrt(2 pi).
    The kernels read them once: an array handed to an inlined helper inside a loop costs a
    reference count increment and decrement (atomic) per element (~50 ns)."""
    return cst[0], cst[1], cst[2], cst[3], cst[4], cst[5]


@njit(cache=True, inline="always", error_model="numpy")
def clamp0(x):
    """torch's clamp(min=0): NaN and -0.0 stay."""
    return c.ZERO if x < c.ZERO else x


@njit(cache=True, inline="always", error_model="numpy")
def clamp01(p):
    """torch's clamp(0, 1): NaN and -0.0 stay."""
    p = clamp0(p)
    return c.ONE if p > c.ONE else p


@njit(cache=True, inline="always", error_model="numpy")
def clamp_big(x, big):
    """torch's clamp(max=big): NaN stays."""
    return big if x > big else x


@njit(cache=True, inline="always", error_model="numpy")
def padded_row(a, i0, i1, fill):
    """fp32 [ROW]: a[i0:i1] (fewer than ROW elements), then `fill` (a short range's row)."""
    row = np.full(ROW, fill, np.float32)
    for k in range(i1 - i0):
        row[k] = a[i0 + k]
    return row


@njit(cache=True, inline="always", error_model="numpy")
def padded_mask(a, i0, i1):
    """bool [ROW]: a[i0:i1] (fewer than ROW elements), then False."""
    row = np.zeros(ROW, np.bool_)
    for k in range(i1 - i0):
        row[k] = a[i0 + k]
    return row


@njit(cache=True, inline="always", error_model="numpy")
def row_count(j0, j1):
    """Rows of the range [j0, j1) (at least ROW elements): ceil((j1 - j0) / ROW)."""
    return (j1 - j0 + np.uint64(ROW - 1)) // np.uint64(ROW)


@njit(cache=True, inline="always", error_model="numpy")
def row_at(j0, r, j1):
    """Where row r starts: j0 + r ROW, the last one moved back to end at j1 (it may cover
    elements of the row before again: the same values)."""
    return min(j0 + np.uint64(r) * np.uint64(ROW), j1 - np.uint64(ROW))


@njit(cache=True, inline="always", error_model="numpy")
def v_cell(s, down, up, kb, cf, big, sr):
    """gaussian_v's (ok, w_lo, w_hi): scale = (1 - beta) s, where(ok, scale, 1), the window
    half-widths c down / scale and c up / scale (clamped to 1e30 under stochastic rounding)."""
    scale = kb * s
    ok = scale > c.ZERO
    scale = scale if ok else c.ONE
    w_lo = (cf * down) / scale
    w_hi = (cf * up) / scale
    if sr:
        w_lo, w_hi = clamp_big(w_lo, big), clamp_big(w_hi, big)
    return ok, w_lo, w_hi


@njit(cache=True, inline="always", error_model="numpy")
def v_terms(s, down, up, kb, cf, big, sr):
    """(ok, w_lo, w_hi, a, b): v_cell's, a = clamp(c - w_lo, 0), b = clamp(c + w_hi, 0) (chi2_1
    and chi2_3 clamp their argument: x' = clamp(x, 0))."""
    ok, w_lo, w_hi = v_cell(s, down, up, kb, cf, big, sr)
    return ok, w_lo, w_hi, clamp0(cf - w_lo), clamp0(cf + w_hi)


@njit(cache=True, inline="always", error_model="numpy")
def chi2_1(x):
    """staleness._chi2_1 of x >= 0 (or NaN): erf(sqrt(x / 2))."""
    return erf32(sqrt32(x / c.TWO))


@njit(cache=True, inline="always", error_model="numpy")
def chi2_3(x, f1, pi):
    """staleness._chi2_3 of x >= 0 (or NaN), f1 = chi2_1(x): f1 - sqrt(2 x / pi) exp(-x / 2),
    the exp +0 below e^-80 (exp_tail32)."""
    return f1 - sqrt32((c.TWO * x) / pi) * exp_tail32((-x) / c.TWO)


@njit(cache=True, forceinline=True, error_model="numpy")
def v_gauss(b0, b1, sr, s, down, up, nominal, cst, G, B, n):
    """G = where(nominal, gaussian_v(s, down, up), 0) (c > 0: replay_gauss writes the zeros
    of c <= 0). Nearest: chi2_1(c + w_hi) - chi2_1(c - w_lo); stochastic: the tent's
    expectation from chi2_1 and chi2_3 at a, b and c (c's once per call). sr is a constant
    of each caller (v_nearest, v_stochastic): a run-time sr left both bodies in the one
    vector loop, selected per lane (nearest 4.5 instead of 2.5 ns per element on the Zen 4).
    By rows (module docstring): a row's sqrt(a / 2) is mostly below 1 and its sqrt(b / 2) 4 or more."""
    kb, cf, big, pi, sq2, sq2pi = columns(cst)  # once: no refcounts in the loop
    cc = clamp0(cf)
    f1c = chi2_1(cc)
    f3c = chi2_3(cc, f1c, pi)
    i0, i1 = np.uint64(b0 * B), np.uint64(min(b1 * B, n))
    if i1 <= i0:
        return 0
    out, tiny = G, i1 - i0 < np.uint64(ROW)
    if tiny:  # fewer than ROW elements: a row of copies, padded with zeros
        s, down, up = padded_row(s, i0, i1, c.ZERO), padded_row(down, i0, i1, c.ZERO), padded_row(up, i0, i1, c.ZERO)
        nominal, G = padded_mask(nominal, i0, i1), np.zeros(ROW, np.float32)
        j0, j1 = np.uint64(0), np.uint64(ROW)
    else:
        j0, j1 = i0, i1
    wl, wh, ra, rb = nv.scratch_f32(ROW), nv.scratch_f32(ROW), nv.scratch_f32(ROW), nv.scratch_f32(ROW)
    xa, xb, fa, fb = nv.scratch_f32(ROW), nv.scratch_f32(ROW), nv.scratch_f32(ROW), nv.scratch_f32(ROW)
    for r in range(row_count(j0, j1)):
        r0 = row_at(j0, r, j1)
        ta, tb = np.int32(0), np.int32(0)
        for k in range(ROW):  # the cells and chi2_1's erf arguments sqrt(x / 2)
            i = r0 + np.uint64(k)
            _, w_lo, w_hi, a, b = v_terms(s[i], down[i], up[i], kb, cf, big, sr)
            wl[k], wh[k], ra[k], rb[k] = w_lo, w_hi, a, b
            xa[k] = sqrt32(a / c.TWO)
            xb[k] = sqrt32(b / c.TWO)
            ta |= erf_tail_lane(xa[k])
            tb |= erf_tail_lane(xb[k])
        erf_row(xa, fa, ta)
        erf_row(xb, fb, tb)
        for k in range(ROW):
            i = r0 + np.uint64(k)
            ok = kb * s[i] > c.ZERO  # v_cell's
            f1a, f1b = fa[k], fb[k]
            if sr:
                w_lo, w_hi = wl[k], wh[k]
                f3a, f3b = chi2_3(ra[k], f1a, pi), chi2_3(rb[k], f1b, pi)
                p = ((c.ONE - (c.ONE / w_lo) * cf) * (f1c - f1a) + (f3c - f3a) / w_lo
                     + (c.ONE + (c.ONE / w_hi) * cf) * (f1b - f1c) - (f3b - f3c) / w_hi)
                p = clamp01(p)
                p = p if ok & (w_lo > c.ZERO) & (w_hi > c.ZERO) else c.ZERO
            else:
                p = f1b - f1a
                p = p if ok else c.ZERO
            G[i] = p if nominal[i] else c.ZERO
    if tiny:
        out[i0:i1] = G[:i1 - i0]
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def v_nearest(b0, b1, part, s, down, up, nominal, cst, G, B, n):
    """v_gauss under nearest rounding."""
    return v_gauss(b0, b1, False, s, down, up, nominal, cst, G, B, n)


@njit(nogil=True, cache=True, error_model="numpy")
def v_stochastic(b0, b1, part, s, down, up, nominal, cst, G, B, n):
    """v_gauss under stochastic rounding."""
    return v_gauss(b0, b1, True, s, down, up, nominal, cst, G, B, n)


@njit(nogil=True, cache=True, error_model="numpy")
def m_sigma(b0, b1, part, sigma2, SIG, B, n):
    """SIG = sigma = sqrt(where(sigma2 > 0, sigma2, 1))."""
    for i in range(np.uint64(b0 * B), np.uint64(min(b1 * B, n))):
        v = sigma2[i]
        SIG[i] = sqrt32(v if v > c.ZERO else c.ONE)
    return 0


@njit(cache=True, inline="always", error_model="numpy")
def Phi_of(e):
    """staleness._Phi(x) = 1/2 (1 + erf(x / sqrt 2)), given e = erf(x / sqrt 2)."""
    return c.HALF * (c.ONE + e)


@njit(cache=True, inline="always", error_model="numpy")
def phi(x, sq2pi):
    """staleness._phi: exp(-x x / 2) / sqrt(2 pi), the exp +0 below e^-80 (exp_tail32)."""
    return exp_tail32(((-x) * x) / c.TWO) / sq2pi


@njit(cache=True, inline="always", error_model="numpy")
def m_cell(down, up, kb, big, sr):
    """gaussian_m's window in g around m: lo = down / (1 - beta), hi = up / (1 - beta)."""
    lo = down / kb
    hi = up / kb
    if sr:
        lo, hi = clamp_big(lo, big), clamp_big(hi, big)
    return lo, hi


@njit(cache=True, inline="always", error_model="numpy")
def m_tent(mi, sigma, lo, hi, cz, ca, cb, dz, da, db):
    """gaussian_m's stochastic left + right (before its clamp), fp32 op for op."""
    left = (c.ONE - mi / lo) * (cz - ca) + (sigma * (da - dz)) / lo
    right = (c.ONE + mi / hi) * (cb - cz) - (sigma * (dz - db)) / hi
    return left + right


@njit(cache=True, forceinline=True, error_model="numpy")
def m_gauss(b0, b1, sr, m, down, up, sigma2, SIG, nominal, cst, G, B, n):
    """G = where(nominal, gaussian_m(m, sigma2, down, up), 0), SIG holding sigma (m_sigma).
    Nearest: Phi(b) - Phi(a), a = (m - lo) / sigma, b = (m + hi) / sigma; stochastic: the
    tent's expectation from Phi and phi at a, b and z = m / sigma. sr: a constant of each
    caller (m_nearest, m_stochastic; v_gauss says why). By rows (module docstring): a row's
    z is mostly below sqrt 2, and a 16-bit float's a and b too."""
    kb, cf, big, pi, sq2, sq2pi = columns(cst)  # once: no refcounts in the loop
    i0, i1 = np.uint64(b0 * B), np.uint64(min(b1 * B, n))
    if i1 <= i0:
        return 0
    out, tiny = G, i1 - i0 < np.uint64(ROW)
    if tiny:  # fewer than ROW elements: a row of copies, padded with zeros (sigma 1)
        m, down, up = padded_row(m, i0, i1, c.ZERO), padded_row(down, i0, i1, c.ZERO), padded_row(up, i0, i1, c.ZERO)
        sigma2, SIG = padded_row(sigma2, i0, i1, c.ZERO), padded_row(SIG, i0, i1, c.ONE)
        nominal, G = padded_mask(nominal, i0, i1), np.zeros(ROW, np.float32)
        j0, j1 = np.uint64(0), np.uint64(ROW)
    else:
        j0, j1 = i0, i1
    rl, rh, ra, rb, rz = nv.scratch_f32(ROW), nv.scratch_f32(ROW), nv.scratch_f32(ROW), nv.scratch_f32(ROW), \
        nv.scratch_f32(ROW)
    xa, xb, xz = nv.scratch_f32(ROW), nv.scratch_f32(ROW), nv.scratch_f32(ROW)
    fa, fb, fz = nv.scratch_f32(ROW), nv.scratch_f32(ROW), nv.scratch_f32(ROW)
    for r in range(row_count(j0, j1)):
        r0 = row_at(j0, r, j1)
        ta, tb, tz = np.int32(0), np.int32(0), np.int32(0)
        for k in range(ROW):  # the window, a, b (and z) and Phi's erf arguments x / sqrt 2
            i = r0 + np.uint64(k)
            lo, hi = m_cell(down[i], up[i], kb, big, sr)
            sigma, mi = SIG[i], m[i]
            b = (mi + hi) / sigma
            a = (mi - lo) / sigma
            rl[k], rh[k], ra[k], rb[k] = lo, hi, a, b
            xa[k] = a / sq2
            xb[k] = b / sq2
            ta |= erf_tail_lane(xa[k])
            tb |= erf_tail_lane(xb[k])
            if sr:
                z = mi / sigma
                rz[k] = z
                xz[k] = z / sq2
                tz |= erf_tail_lane(xz[k])
        erf_row(xa, fa, ta)
        erf_row(xb, fb, tb)
        if sr:
            erf_row(xz, fz, tz)
        for k in range(ROW):
            i = r0 + np.uint64(k)
            ok = sigma2[i] > c.ZERO
            ca, cb = Phi_of(fa[k]), Phi_of(fb[k])
            if sr:
                lo, hi, sigma, mi = rl[k], rh[k], SIG[i], m[i]
                dz, da, db = phi(rz[k], sq2pi), phi(ra[k], sq2pi), phi(rb[k], sq2pi)
                p = clamp01(m_tent(mi, sigma, lo, hi, Phi_of(fz[k]), ca, cb, dz, da, db))
                p = p if ok & (lo > c.ZERO) & (hi > c.ZERO) else c.ZERO
            else:
                p = cb - ca
                p = p if ok else c.ZERO
            G[i] = p if nominal[i] else c.ZERO
    if tiny:
        out[i0:i1] = G[:i1 - i0]
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def m_nearest(b0, b1, part, m, down, up, sigma2, SIG, nominal, cst, G, B, n):
    """m_gauss under nearest rounding."""
    return m_gauss(b0, b1, False, m, down, up, sigma2, SIG, nominal, cst, G, B, n)


@njit(nogil=True, cache=True, error_model="numpy")
def m_stochastic(b0, b1, part, m, down, up, sigma2, SIG, nominal, cst, G, B, n):
    """m_gauss under stochastic rounding."""
    return m_gauss(b0, b1, True, m, down, up, sigma2, SIG, nominal, cst, G, B, n)


# ---- team launches: a small layout's pass split over numba's OpenMP threads (team.py) -----------
# Each kernel is called by its address (native.call_compiled: the one compiled for these argument
# types, as run_parts calls it), not linked in: linking would compile its code again.

@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def v_team(kernel, nparts, nblocks, s, down, up, nominal, cst, G, B, n):
    """v_nearest or v_stochastic (`kernel`, by its address) over blocks 0 .. nblocks - 1 in
    nparts contiguous ranges, one per thread: the same values as one call."""
    for p in prange(nparts):
        nv.call_compiled(kernel, (nblocks * p // nparts, nblocks * (p + 1) // nparts, p, s, down, up, nominal, cst,
                                  G, B, n))
    return 0


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def m_team(sigma_kernel, kernel, with_sigma, nparts, nblocks, m, down, up, sigma2, SIG, nominal, cst, G, B, n):
    """m_nearest or m_stochastic (`kernel`) over blocks 0 .. nblocks - 1 in nparts contiguous
    ranges, one per thread, each range's sigma first (m_sigma, `sigma_kernel`) where with_sigma:
    the same values as one call of each."""
    for p in prange(nparts):
        b0, b1 = nblocks * p // nparts, nblocks * (p + 1) // nparts
        if with_sigma:
            nv.call_compiled(sigma_kernel, (b0, b1, p, sigma2, SIG, B, n))
        nv.call_compiled(kernel, (b0, b1, p, m, down, up, sigma2, SIG, nominal, cst, G, B, n))
    return 0
