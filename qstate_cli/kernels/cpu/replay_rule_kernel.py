"""numba kernel of the replay's fused AdamW rule (replay_rule.py says what it computes;
imports numba)."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c  # noqa: F401 - sets numba's cache folder before anything here compiles
from . import native as nv
from . import torch_sum_kernel as ts

ACC = ts.ACC_SIZE  # torch-order sums' scratch (constants: on the stack)
STREAM = ts.STREAM8


@njit(nogil=True, cache=True, error_model="numpy")
def adamw_rule(b0, b1, g, m_hat, v_hat, u, m, v, sc, B, numel):
    """Elements [b0 * B, min(b1 * B, numel)): optim.rules.adamw with p = 0 (recursions.py),
    op for op in fp32 (fastmath off: no FMA), sc = fp32 [b1, 1 - b1, b2, 1 - b2,
    inv_bc2_sqrt, eps, step_size, decay]:
        m = m_hat * b1 + g * (1 - b1);  v = v_hat * b2 + (g * g) * (1 - b2)
        denom = fp32(sqrt(fp64(v))) * inv_bc2_sqrt + eps   (rules.sqrt_rn)
        u = -(0 * decay - (m / denom) * step_size)          (the direction: minus the new p)"""
    c_b1, c_1b1, c_b2, c_1b2 = sc[0], sc[1], sc[2], sc[3]
    inv, eps, step_size = sc[4], sc[5], sc[6]
    p0 = np.float32(0.0) * sc[7]
    lo = np.uint64(b0 * B)
    hi = np.uint64(min(b1 * B, numel))
    for i in range(lo, hi):
        gi = g[i]
        mi = m_hat[i] * c_b1 + gi * c_1b1
        vi = v_hat[i] * c_b2 + (gi * gi) * c_1b2
        den = np.float32(np.sqrt(np.float64(vi))) * inv + eps
        u[i] = -(p0 - (mi / den) * step_size)
        m[i] = mi
        v[i] = vi
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def update_products(b0, b1, u, ref, out, B, numel):
    """Elements [b0 * B, min(b1 * B, numel)) of UpdateStats' products, each one fp32 op as
    torch does them: out[0] = u * ref, out[1] = u * u, out[2] = (u - ref) * (u - ref)."""
    lo = np.uint64(b0 * B)
    hi = np.uint64(min(b1 * B, numel))
    for i in range(lo, hi):
        a, r = u[i], ref[i]
        d = a - r
        out[0, i] = a * r
        out[1, i] = a * a
        out[2, i] = d * d
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def update_sums(u0, u1, u, ref, sums, unit, lanes):
    """Units u0 .. u1 - 1 (of `unit` elements) of UpdateStats' per-unit sums, in one pass:
    sums[0 / 1 / 2, k] = the sum over unit k of u * ref, u * u, (u - ref) * (u - ref) (each
    product one fp32 op as torch's; summed in torch's order, lanes = torch's fp32 lanes:
    torch_sum.py). sums[3] (the reference's) is the caller's."""
    u, ref, sums = nv.borrowed((u, ref, sums))
    pa = np.empty(unit, np.float32)
    pb = np.empty(unit, np.float32)
    pc = np.empty(unit, np.float32)
    acc = nv.scratch_f32(ACC)
    sa = nv.scratch_f32(STREAM)
    sb = nv.scratch_f32(STREAM)
    sc = nv.scratch_f32(STREAM)
    streamed = ts.streams8(lanes, unit)
    for k in range(u0, u1):
        i0 = np.uint64(k * unit)
        if streamed:  # the sums as the products are computed (torch_sum_kernel.stream8_*)
            ts.stream8_start(sa)
            ts.stream8_start(sb)
            ts.stream8_start(sc)
            for g in range(unit // ts.GROUP8):
                b = i0 + np.uint64(g * ts.GROUP8)
                for e in range(np.uint64(ts.GROUP8)):
                    a, r = u[b + e], ref[b + e]
                    d = a - r
                    sa[e] += a * r
                    sb[e] += a * a
                    sc[e] += d * d
                ts.stream8_group_done(sa, g)
                ts.stream8_group_done(sb, g)
                ts.stream8_group_done(sc, g)
            sums[0, k] = ts.stream8_sum(sa)
            sums[1, k] = ts.stream8_sum(sb)
            sums[2, k] = ts.stream8_sum(sc)
            continue
        for j in range(unit):
            i = i0 + np.uint64(j)
            a, r = u[i], ref[i]
            d = a - r
            pa[j] = a * r
            pb[j] = a * a
            pc[j] = d * d
        sums[0, k] = ts.row_sum(pa, nv.ROW0, unit, lanes, acc)
        sums[1, k] = ts.row_sum(pb, nv.ROW0, unit, lanes, acc)
        sums[2, k] = ts.row_sum(pc, nv.ROW0, unit, lanes, acc)
    return 0


@njit(cache=True, forceinline=True, error_model="numpy")
def _square_sums3(a, b, d, i0, unit, lanes, ra, rb, rc, acc, sa, sb, sc):
    """(sum of a * a, of b * b, of d * d) over a unit of elements i0 .., each square one fp32 op
    and each sum in torch's fp32 order (update_sums' two ways: streamed, else rows ra, rb, rc)."""
    if ts.streams8(lanes, unit):
        ts.stream8_start(sa)
        ts.stream8_start(sb)
        ts.stream8_start(sc)
        for g in range(unit // ts.GROUP8):
            base = i0 + np.uint64(g * ts.GROUP8)
            for e in range(np.uint64(ts.GROUP8)):
                x, y, z = a[base + e], b[base + e], d[base + e]
                sa[e] += x * x
                sb[e] += y * y
                sc[e] += z * z
            ts.stream8_group_done(sa, g)
            ts.stream8_group_done(sb, g)
            ts.stream8_group_done(sc, g)
        return ts.stream8_sum(sa), ts.stream8_sum(sb), ts.stream8_sum(sc)
    for j in range(np.uint64(unit)):
        x, y, z = a[i0 + j], b[i0 + j], d[i0 + j]
        ra[j] = x * x
        rb[j] = y * y
        rc[j] = z * z
    return (ts.row_sum(ra, nv.ROW0, unit, lanes, acc), ts.row_sum(rb, nv.ROW0, unit, lanes, acc),
            ts.row_sum(rc, nv.ROW0, unit, lanes, acc))


@njit(nogil=True, cache=True, error_model="numpy")
def adamw_shadow(u0, u1, g, m_hat, v_hat, u, m, v, sc, unit, lanes, sums):
    """Units u0 .. u1 - 1 of the fp32 shadow's step: adamw_rule (u, m, v), then per unit k
    sums[0 / 1 / 2, k] = the sum of m * m, v * v, u * u over the unit (one fp32 product each,
    summed in torch's fp32 order, lanes = torch's: the bits of torch's x.view(-1, unit).sum(1)),
    unit by unit, so each unit's rows are summed while in cache."""
    g, m_hat, v_hat, u, m, v, sums = nv.borrowed((g, m_hat, v_hat, u, m, v, sums))
    ra = np.empty(unit, np.float32)
    rb = np.empty(unit, np.float32)
    rc = np.empty(unit, np.float32)
    acc = nv.scratch_f32(ACC)
    sa = nv.scratch_f32(STREAM)
    sb = nv.scratch_f32(STREAM)
    s2 = nv.scratch_f32(STREAM)
    n = g.size
    for k in range(u0, u1):
        adamw_rule(k, k + 1, g, m_hat, v_hat, u, m, v, sc, unit, n)
        sums[0, k], sums[1, k], sums[2, k] = _square_sums3(m, v, u, np.uint64(k * unit), unit, lanes, ra, rb, rc,
                                                           acc, sa, sb, s2)
    return 0
