"""Fused Muon momentum update on a quantized buffer for CPU tensors: the buffer is
requantized in place and the fp32 update written to each member's `out` for the
Newton-Schulz orthogonalization, which stays in torch (per matrix), as kernels/muon.py.

Bytes moved per element (one state): g + 2 * (bits/8) + 4 (fp32 update out) + 8 / B.
The rule is optim/rules.muon_momentum, op for op:

    buf = buf_hat * b + g * (1 - b);  update = g * (1 - b) + buf * b (Nesterov) or buf
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
def muon_rows(grow, mrow, urow, cnt, b, ob, nesterov):
    """rules.muon_momentum over one row, op for op: mrow = buf (buf_hat in), and for Nesterov
    urow = the update (without Nesterov the update is buf itself). Shared with the 16-bit
    states' pass (elementwise_kernel.py)."""
    for j in range(cnt):
        mrow[j] = mrow[j] * b + grow[j] * ob
    if nesterov:
        for j in range(cnt):
            urow[j] = grow[j] * ob + mrow[j] * b


@lru_cache(maxsize=None)
def kernel_for(mlay: tuple, B: int):
    """The kernel compiled for this layout (codec.py: lay tuple) and block size B, both
    compile-time constants of it (one compilation per key, cached on disk). A 4-bit state
    that pairs.by_pairs takes is encoded by pairs (pairs.encode_row4; m4: a closure bool)."""
    m4 = pc.by_pairs(mlay)
    mbook = br.searched(mlay)  # encoded a stage at a time (book_rows.py)
    BS = B if mbook else 1  # its scratch rows' size

    @njit(nogil=True, cache=True, error_model="numpy")
    def _muon_kernel(b0, b1_, part, arrays, first, skeys, bad, like_g, mlim, mtab, steps, beta, omb, nesterov, fresh):
        """Steps blocks b0 .. b1_ - 1 of a launch (host.run_members; host.MemberTable's columns:
        g, out (fp32: the update), m codes, m scales) and adds each member's count of
        non-finite gradient elements (zeroed) to bad[part, member]. steps: uint32 [2] = this
        step and the step m was written at (the random streams' keys: codec.step_keys)."""
        b, ob = np.float32(beta), np.float32(omb)
        msb = mlay[c.SBF16] != 0
        arrays, first, skeys, bad, mlim, mtab, steps = nv.borrowed(  # no reference counts (native.py)
            (arrays, first, skeys, bad, mlim, mtab, steps))
        mrow = nv.scratch_f32(B)
        grow = nv.scratch_f32(B)
        urow = nv.scratch_f32(B)
        q = nv.scratch_i32(B)
        rows = br.scratch_rows(BS)
        i0, i1 = mb.member_span(first, b0, b1_)
        for i in range(i0, i1):
            a = arrays[i]
            numel = a[1]
            g, out = nv.view_like(like_g, a[0], a[1]), nv.view_f32(0, a[2], a[3])
            mc, ms = mb.state_at(a, 4)
            k1, k2 = c.step_keys(skeys[i, 0], steps[0])
            r1, r2 = c.step_keys(skeys[i, 0], steps[1])  # the codes were written with these
            nbad = 0
            lo, hi = mb.member_blocks(first, i, b0, b1_)
            for blk in range(lo, hi):
                start = blk * B
                cnt = min(B, numel - start)
                c.read_state(fresh, mc, ms, msb, mlay, mlim, mtab, blk, start, cnt, r1, r2, q, mrow)
                nbad += c.load_grad(g, start, cnt, grow)
                muon_rows(grow, mrow, urow, cnt, b, ob, nesterov)
                c.store_row(urow if nesterov else mrow, start, cnt, out)
                if m4:
                    c.store_scale(ms, blk, pc.encode_row4(mrow, cnt, mlay, mlim, mtab, blk, start, k1, k2, mc), msb)
                elif mbook:
                    c.store_scale(ms, blk, br.encode_block_searched(mrow, cnt, mlay, mlim, mtab, blk, start, k1, k2,
                                                                     False, q, rows), msb)
                    c.pack_codes(q, mlay[c.BITS], start, cnt, mc)
                else:
                    c.store_scale(ms, blk, c.encode_block(mrow, cnt, mlay, mlim, mtab, blk, start, k1, k2, False, q),
                                  msb)
                    c.pack_codes(q, mlay[c.BITS], start, cnt, mc)
            bad[part, i] += nbad
        return 0

    return _muon_kernel


def _columns(member):
    """A member's arrays for the kernel (host.member_table): g, out (fp32), m's codes and scale words."""
    mc, ms = member.states["m"]
    return ((member.grad, member.grad.element_size()), (member.out, 4), (mc, 1), (ms, 2))


def muon_momentum_step(batch: CpuBatch, m, *, g_kind: int, step: int, written: int, fresh: bool,
                       momentum: float, nesterov: bool, table=None) -> None:
    """The fused momentum update over every tensor of `batch` in one kernel call
    (host.run_members; kernels/muon.muon_momentum_step's signature); each member's `out`
    (fp32, the parameter's shape) receives its update."""
    mlay, mlim, mtab = layout_arrays(m, table)
    kernel = kernel_for(mlay, int(m.block))
    bad = run_members(kernel, member_table(batch, _columns, int(m.block), 1, grad_column=0), int(m.block),
                      (like(batch.members[0].grad), mlim, mtab, step_words(step, written), float(momentum),
                       1.0 - float(momentum), bool(nesterov), bool(fresh)))
    add_nonfinite(batch, bad)
