"""numba kernels of the replay's fused Gaussian staleness model (replay_gauss.py says what they
compute and why torch keeps the sqrt, erf and exp; imports numba). Every other fp32 op is the
one diagnose/staleness.py's torch code makes, in its order (fastmath off: no FMA), with
torch's rules for a Python scalar c: t * c, t + c, c - t and t / c take fp32(c); c / t is
torch's reciprocal(t) * fp32(c). Clamps keep NaN and -0.0 as torch's do.

Scratch rows (replay_gauss.Rows): T takes the arguments of torch's sqrt_ and erf_, X those
of its exp_, W the values the args pass computes that the finishing pass needs again (its
divisions, done once: the divider is what both passes wait on, and the two threads of a core
share it), SIG sigma's; row j of T, X or W (T[j] below) is its elements [j (n + 1), j (n + 1) + n)
and a slot after them, where the stochastic v puts its per-tensor arguments (c / 2, 2 c / pi,
-c / 2: chi2_1(c) and chi2_3(c) by torch's own functions, as staleness.py's full_like(s, c)
gets them). Each kernel steps elements [b0 B, min(b1 B, n)) (host.run_parts)."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c  # sets numba's cache folder before anything here compiles
from .native import bits_of_f32


@njit(cache=True, inline="always", error_model="numpy")
def columns(cst):
    """cst's first 10 fp32 columns (replay_gauss.constants): 1 - beta, c, 1e30, pi, sqrt 2,
    sqrt(2 pi), erf(sqrt(+0)), sqrt(+0), exp's value below the floor, the floor. The kernels
    read them once: an array handed to an inlined helper inside a loop costs a reference count
    increment and decrement (atomic) per element (~50 ns)."""
    return (cst[0], cst[1], cst[2], cst[3], cst[4], cst[5], cst[6], cst[7], cst[8], cst[9])


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
def root_in(x):
    """What v_args writes for torch's sqrt of x: 1 in place of +0.0 (torch's sqrt takes ~20x
    longer on 0; its value there, and its erf's, are the constants sqrt0, erf0)."""
    return c.ONE if bits_of_f32(x) == np.uint32(0) else x


@njit(cache=True, inline="always", error_model="numpy")
def root_out(t, x, zero_value):
    """torch's result for the argument x, t where root_in passed x on."""
    return zero_value if bits_of_f32(x) == np.uint32(0) else t


@njit(cache=True, inline="always", error_model="numpy")
def exp_in(x, floor):
    """What the args passes write for torch's exp of x: 0 in place of x < floor (exp
    underflows there: ~100x longer, and gives one value, low; replay_gauss.probe)."""
    return c.ZERO if x < floor else x


@njit(cache=True, inline="always", error_model="numpy")
def exp_out(t, x, floor, low):
    """torch's exp of the argument x, t where exp_in passed x on."""
    return low if x < floor else t


@njit(nogil=True, cache=True, error_model="numpy")
def v_args(b0, b1, part, sr, s, down, up, cst, T, X, W, B, n):
    """T[0], T[1] = a / 2, b / 2 (chi2_1's sqrt then erf arguments, c - w_lo and c + w_hi's);
    stochastic also T[2], T[3] = 2 a / pi, 2 b / pi (sqrt) and X[0], X[1] = -a / 2, -b / 2
    (exp): chi2_3's terms (root_in, exp_in: the slow arguments replaced, exp's below cst[10],
    v_finish's band); and the slots of T[0], T[2], X[0] for c (part 0 writes them); W[0], W[1]
    = w_lo, w_hi (v_cell's, for v_finish)."""
    kb, cf, big, pi, sq2, sq2pi, erf0, sqrt0, low, floor = columns(cst)  # once: no refcounts in the loop
    floor = cst[10]
    nn = np.uint64(n + 1)  # the rows' stride: n elements and a slot
    for i in range(np.uint64(b0 * B), np.uint64(min(b1 * B, n))):
        _, w_lo, w_hi, a, b = v_terms(s[i], down[i], up[i], kb, cf, big, sr)
        W[i] = w_lo
        W[nn + i] = w_hi
        T[i] = root_in(a / c.TWO)
        T[nn + i] = root_in(b / c.TWO)
        if sr:
            T[np.uint64(2) * nn + i] = root_in((c.TWO * a) / pi)
            T[np.uint64(3) * nn + i] = root_in((c.TWO * b) / pi)
            X[i] = exp_in((-a) / c.TWO, floor)
            X[nn + i] = exp_in((-b) / c.TWO, floor)
    if sr and part == 0:  # the slots: chi2_1(c) and chi2_3(c)'s terms, c' = clamp(c, 0)
        cc = clamp0(cf)
        T[n] = cc / c.TWO
        T[np.uint64(2) * nn + np.uint64(n)] = (c.TWO * cc) / pi
        X[n] = (-cc) / c.TWO
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def v_finish(b0, b1, part, sr, s, nominal, cst, T, X, W, G, B, n):
    """G = where(nominal, gaussian_v, 0), T and X holding torch's sqrt / erf / exp of v_args',
    W its w_lo, w_hi (the same values v_cell gives: v_args computed them).
    Returns how many exp arguments in the band [floor, cst[10]) had chi2_1 below 1/2 (then the
    caller computes again without the band). The band: -x / 2 there, torch's exp is below
    2**-126 (subnormal; ~12x its usual time, the other lanes of its vector waiting), and its
    only use is chi2_3 = chi2_1 - sqrt(2 x / pi) exp(-x / 2), whose product is then below
    11.5 * 2**-126 < 2**-122 (x <= 208 in the band): subtracted from a chi2_1 >= 1/2 it rounds
    to chi2_1 itself, which is what exp's +0 below the floor (low) gives too; so low stands
    in for exp in the band, with the same bits wherever chi2_1 >= 1/2 (there it is 1: the
    erf of sqrt(x / 2) >= 9.3)."""
    kb, cf, big, pi, sq2, sq2pi, erf0, sqrt0, low, floor = columns(cst)  # once: no refcounts in the loop
    edge = cst[10]
    nn = np.uint64(n + 1)  # the rows' stride: n elements and a slot
    f1c = T[n]  # chi2_1(c), and chi2_3(c) = chi2_1(c) - sqrt(2 c' / pi) exp(-c' / 2) (stochastic only)
    f3c = f1c - T[np.uint64(2) * nn + np.uint64(n)] * X[n]
    unproven = 0
    for i in range(np.uint64(b0 * B), np.uint64(min(b1 * B, n))):
        ok = kb * s[i] > c.ZERO  # v_cell's
        w_lo, w_hi = W[i], W[nn + i]
        a, b = clamp0(cf - w_lo), clamp0(cf + w_hi)  # v_terms'
        f1a = root_out(T[i], a / c.TWO, erf0)
        f1b = root_out(T[nn + i], b / c.TWO, erf0)
        if sr:
            xa, xb = (-a) / c.TWO, (-b) / c.TWO
            unproven += np.int64((xa >= floor) & (xa < edge) & ~(f1a >= c.HALF))
            unproven += np.int64((xb >= floor) & (xb < edge) & ~(f1b >= c.HALF))
            f3a = f1a - root_out(T[np.uint64(2) * nn + i], (c.TWO * a) / pi, sqrt0) * exp_out(X[i], xa, edge, low)
            f3b = f1b - root_out(T[np.uint64(3) * nn + i], (c.TWO * b) / pi, sqrt0) * exp_out(X[nn + i], xb, edge, low)
            p = ((c.ONE - (c.ONE / w_lo) * cf) * (f1c - f1a) + (f3c - f3a) / w_lo
                 + (c.ONE + (c.ONE / w_hi) * cf) * (f1b - f1c) - (f3b - f3c) / w_hi)
            p = clamp01(p)
            p = p if ok & (w_lo > c.ZERO) & (w_hi > c.ZERO) else c.ZERO
        else:  # chi2_1(c + w_hi) - chi2_1(c - w_lo)
            p = f1b - f1a
            p = p if ok else c.ZERO
        G[i] = p if nominal[i] else c.ZERO
    return unproven


@njit(nogil=True, cache=True, error_model="numpy")
def m_sigma(b0, b1, part, sigma2, SIG, B, n):
    """SIG = where(sigma2 > 0, sigma2, 1) (torch then takes its sqrt: sigma)."""
    for i in range(np.uint64(b0 * B), np.uint64(min(b1 * B, n))):
        v = sigma2[i]
        SIG[i] = v if v > c.ZERO else c.ONE
    return 0


@njit(cache=True, inline="always", error_model="numpy")
def m_cell(down, up, kb, big, sr):
    """gaussian_m's window in g around m: lo = down / (1 - beta), hi = up / (1 - beta)."""
    lo = down / kb
    hi = up / kb
    if sr:
        lo, hi = clamp_big(lo, big), clamp_big(hi, big)
    return lo, hi


@njit(nogil=True, cache=True, error_model="numpy")
def m_args(b0, b1, part, sr, m, down, up, SIG, cst, T, X, W, B, n):
    """Nearest: T[0], T[1] = ((m + hi) / sigma) / sqrt2, ((m - lo) / sigma) / sqrt2 (Phi's erf
    arguments). Stochastic, z = m / sigma, a = (m - lo) / sigma, b = (m + hi) / sigma:
    T[0..2] = z / sqrt2, a / sqrt2, b / sqrt2 (erf), X[0..2] = -z z / 2, -a a / 2, -b b / 2 (exp;
    exp_in: the arguments below cst[10] replaced, m_finish's band), and W[0..4] = lo, hi, z,
    a, b (for m_finish)."""
    kb, cf, big, pi, sq2, sq2pi, erf0, sqrt0, low, floor = columns(cst)  # once: no refcounts in the loop
    floor = cst[10]
    nn = np.uint64(n + 1)  # the rows' stride: n elements and a slot
    for i in range(np.uint64(b0 * B), np.uint64(min(b1 * B, n))):
        lo, hi = m_cell(down[i], up[i], kb, big, sr)
        sigma, mi = SIG[i], m[i]
        b = (mi + hi) / sigma
        a = (mi - lo) / sigma
        if sr:
            z = mi / sigma
            W[i] = lo
            W[nn + i] = hi
            W[np.uint64(2) * nn + i] = z
            W[np.uint64(3) * nn + i] = a
            W[np.uint64(4) * nn + i] = b
            T[i] = z / sq2
            T[nn + i] = a / sq2
            T[np.uint64(2) * nn + i] = b / sq2
            X[i] = exp_in(((-z) * z) / c.TWO, floor)
            X[nn + i] = exp_in(((-a) * a) / c.TWO, floor)
            X[np.uint64(2) * nn + i] = exp_in(((-b) * b) / c.TWO, floor)
        else:
            T[i] = b / sq2
            T[nn + i] = a / sq2
    return 0


TINY = np.float32(2.0 ** -126)  # above torch's exp of any argument in the band (replay_gauss.band_below)


@njit(cache=True, inline="always", error_model="numpy")
def m_tent(mi, sigma, lo, hi, cz, ca, cb, dz, da, db):
    """gaussian_m's stochastic left + right (before its clamp), fp32 op for op: increasing in
    da and db, decreasing in dz (sigma, lo, hi > 0), each op weakly monotone in each operand."""
    left = (c.ONE - mi / lo) * (cz - ca) + (sigma * (da - dz)) / lo
    right = (c.ONE + mi / hi) * (cb - cz) - (sigma * (dz - db)) / hi
    return left + right


@njit(cache=True, inline="always", error_model="numpy")
def band_d(d, x, floor, edge, dtop):
    """(least, most) phi an exp argument x may give: (d, d) outside the band [floor, edge),
    (0, dtop) in it, where torch's exp is in [0, 2**-126) and m_args passed it 0 instead."""
    if (x >= floor) & (x < edge):
        return c.ZERO, dtop
    return d, d


@njit(nogil=True, cache=True, error_model="numpy")
def m_finish(b0, b1, part, sr, m, sigma2, nominal, SIG, cst, T, X, W, G, B, n):
    """G = where(nominal, gaussian_m, 0), T and X holding torch's erf / exp of m_args', W its
    lo, hi, z, a, b (stochastic: the same values m_cell and the divisions give). Returns
    how many elements had an exp argument in the band [floor, cst[10]) that m_args left out
    (0 in place of torch's subnormal exp, ~30 ns each) and whose p it does not pin down (then
    the caller computes again without the band). p = clamp(left + right, 0, 1) is weakly
    monotone in each phi (m_tent), so with every band phi at 0 or at TINY / sqrt(2 pi) the
    right way, the sums s_min <= s_max bound every value torch's exp could lead to: where
    both are finite (then so is every sum between), p is pinned where clamp(s_min) and
    clamp(s_max) are the same value above 0 (one bit pattern), or where s_max < 0 (+0)."""
    kb, cf, big, pi, sq2, sq2pi, erf0, sqrt0, low, floor = columns(cst)  # once: no refcounts in the loop
    edge = cst[10]
    dtop = TINY / sq2pi  # a band phi's most
    nn = np.uint64(n + 1)  # the rows' stride: n elements and a slot
    unpinned = 0
    for i in range(np.uint64(b0 * B), np.uint64(min(b1 * B, n))):
        ok = sigma2[i] > c.ZERO
        if sr:
            lo, hi = W[i], W[nn + i]
            sigma, mi = SIG[i], m[i]
            z, a, b = W[np.uint64(2) * nn + i], W[np.uint64(3) * nn + i], W[np.uint64(4) * nn + i]
            cz = c.HALF * (c.ONE + T[i])
            ca = c.HALF * (c.ONE + T[nn + i])
            cb = c.HALF * (c.ONE + T[np.uint64(2) * nn + i])
            xz, xa, xb = ((-z) * z) / c.TWO, ((-a) * a) / c.TWO, ((-b) * b) / c.TWO
            dz = exp_out(X[i], xz, floor, low) / sq2pi
            da = exp_out(X[nn + i], xa, floor, low) / sq2pi
            db = exp_out(X[np.uint64(2) * nn + i], xb, floor, low) / sq2pi
            counted = ok & (lo > c.ZERO) & (hi > c.ZERO) & nominal[i]
            band = ((xz >= floor) & (xz < edge)) | ((xa >= floor) & (xa < edge)) | ((xb >= floor) & (xb < edge))
            if counted & band:
                dz0, dz1 = band_d(dz, xz, floor, edge, dtop)
                da0, da1 = band_d(da, xa, floor, edge, dtop)
                db0, db1 = band_d(db, xb, floor, edge, dtop)
                s_min = m_tent(mi, sigma, lo, hi, cz, ca, cb, dz1, da0, db0)
                s_max = m_tent(mi, sigma, lo, hi, cz, ca, cb, dz0, da1, db1)
                p, p_min = clamp01(s_max), clamp01(s_min)
                finite = (abs(s_min) < c.INF) & (abs(s_max) < c.INF)
                unpinned += np.int64(~(finite & (((p == p_min) & (p > c.ZERO)) | (s_max < c.ZERO))))
            else:
                p = clamp01(m_tent(mi, sigma, lo, hi, cz, ca, cb, dz, da, db))
            p = p if ok & (lo > c.ZERO) & (hi > c.ZERO) else c.ZERO
        else:
            p = c.HALF * (c.ONE + T[i]) - c.HALF * (c.ONE + T[nn + i])
            p = p if ok else c.ZERO
        G[i] = p if nominal[i] else c.ZERO
    return unpinned
