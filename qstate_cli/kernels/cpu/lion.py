"""Fused Lion step on a quantized momentum m for CPU tensors: one pass over memory, in
parallel over chunks of quantization blocks (as adamw.py).

Bytes moved per element (one state), as kernels/lion.py: 2p + g + 2 * (bits/8) + 8 / B
(4-bit, B=128, fp32 p and g: 13.06 B/elem). The rule is optim/rules.lion, op for op:

    c = m_hat * b1 + g * (1 - b1);  p = p * decay - sign(c) * lr;  m = m_hat * b2 + g * (1 - b2)

(sign(NaN) = 0, as the Triton kernel's where-chain.)
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

from . import book_rows as br
from . import codec as c
from . import members as mb
from . import native as nv
from . import pairs as pc
from .host import (CpuBatch, add_nonfinite, layout_arrays, like, member_table, run_members,
                   step_words)


@njit(cache=True, inline="always", error_model="numpy")
def lion_rows(prow, grow, mrow, cnt, b1, ob1, b2, ob2, lr, decay):
    """rules.lion over one row, op for op: prow (p) and mrow (m_hat in, the new m out) from
    grow (g, finite); sign(0) = 0. Shared with the 16-bit states' pass (elementwise_kernel.py)."""
    for j in range(cnt):
        gj = grow[j]
        mh = mrow[j]
        cm = mh * b1 + gj * ob1
        sgn = c.ONE if cm > c.ZERO else (-c.ONE if cm < c.ZERO else c.ZERO)
        prow[j] = prow[j] * decay - sgn * lr
        mrow[j] = mh * b2 + gj * ob2


@lru_cache(maxsize=None)
def kernel_for(mlay: tuple, B: int):
    """The kernel compiled for this layout (codec.py: lay tuple) and block size B, both
    compile-time constants of it (one compilation per key, cached on disk). A 4-bit state
    that pairs.by_pairs takes is encoded by pairs (pairs.encode_row4; m4: a closure bool)."""
    m4 = pc.by_pairs(mlay)
    mbook = br.searched(mlay)  # encoded a stage at a time (book_rows.py)
    BS = B if mbook else 1  # its scratch rows' size

    @njit(nogil=True, cache=True, error_model="numpy")
    def _lion_kernel(b0, b1_, part, arrays, first, skeys, bad, like_p, like_g, mlim, mtab, steps, scal, beta1,
                     omb1, beta2, omb2, fresh):
        """Steps blocks b0 .. b1_ - 1 of a launch (host.run_members; host.MemberTable's columns:
        p, g, m codes, m scales) and adds each member's count of non-finite gradient elements (zeroed)
        to bad[part, member]. steps: uint32 [2] = this step and the step m was written at (the
        random streams' keys: codec.step_keys); scal: fp32 [lr, decay, ...]."""
        b1, ob1, b2, ob2 = np.float32(beta1), np.float32(omb1), np.float32(beta2), np.float32(omb2)
        lr, decay = scal[0], scal[1]
        msb = mlay[c.SBF16] != 0
        arrays, first, skeys, bad, mlim, mtab, steps = nv.borrowed(  # no reference counts (native.py)
            (arrays, first, skeys, bad, mlim, mtab, steps))
        mrow = nv.scratch_f32(B)
        prow = nv.scratch_f32(B)
        grow = nv.scratch_f32(B)
        q = nv.scratch_i32(B)
        rows = br.scratch_rows(BS)
        i0, i1 = mb.member_span(first, b0, b1_)
        for i in range(i0, i1):
            a = arrays[i]
            numel = a[1]
            p, g = nv.view_like(like_p, a[0], a[1]), nv.view_like(like_g, a[2], a[3])
            mc, ms = mb.state_at(a, 4)
            k1, k2 = c.step_keys(skeys[i, 0], steps[0])
            r1, r2 = c.step_keys(skeys[i, 0], steps[1])  # the codes were written with these
            nbad = 0
            lo, hi = mb.member_blocks(first, i, b0, b1_)
            for b in range(lo, hi):
                start = b * B
                cnt = min(B, numel - start)
                c.read_state(fresh, mc, ms, msb, mlay, mlim, mtab, b, start, cnt, r1, r2, q, mrow)
                nbad += c.load_grad(g, start, cnt, grow)
                c.load_row(p, start, cnt, prow)
                lion_rows(prow, grow, mrow, cnt, b1, ob1, b2, ob2, lr, decay)
                c.store_row(prow, start, cnt, p)
                if m4:
                    c.store_scale(ms, b, pc.encode_row4(mrow, cnt, mlay, mlim, mtab, b, start, k1, k2, mc), msb)
                elif mbook:
                    c.store_scale(ms, b, br.encode_block_searched(mrow, cnt, mlay, mlim, mtab, b, start, k1, k2,
                                                                     False, q, rows), msb)
                    c.pack_codes(q, mlay[c.BITS], start, cnt, mc)
                else:
                    c.store_scale(ms, b, c.encode_block(mrow, cnt, mlay, mlim, mtab, b, start, k1, k2, False, q),
                                  msb)
                    c.pack_codes(q, mlay[c.BITS], start, cnt, mc)
            bad[part, i] += nbad
        return 0

    return _lion_kernel


def _columns(member):
    """A member's arrays for the kernel (host.member_table): p, g, m's codes and scale words."""
    mc, ms = member.states["m"]
    return ((member.param, member.param.element_size()), (member.grad, member.grad.element_size()), (mc, 1), (ms, 2))


def lion_step(batch: CpuBatch, scalars, m, *, p_kind: int, g_kind: int, step: int, written: int, fresh: bool,
              beta1: float, beta2: float, table=None) -> None:
    """One fused Lion step over every tensor of `batch` in one kernel call (host.run_members),
    with kernels/lion.lion_step's signature."""
    mlay, mlim, mtab = layout_arrays(m, table)
    kernel = kernel_for(mlay, int(m.block))
    first = batch.members[0]
    bad = run_members(kernel, member_table(batch, _columns, int(m.block), 1), int(m.block),
                      (like(first.param), like(first.grad), mlim, mtab, step_words(step, written),
                       scalars.detach().cpu().numpy(), float(beta1), 1.0 - float(beta1), float(beta2),
                       1.0 - float(beta2), bool(fresh)))
    add_nonfinite(batch, bad)
