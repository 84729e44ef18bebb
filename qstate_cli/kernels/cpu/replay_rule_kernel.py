"""numba kernel of the replay's fused AdamW rule (replay_rule.py says what it computes;
imports numba)."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c  # noqa: F401 - sets numba's cache folder before anything here compiles


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
