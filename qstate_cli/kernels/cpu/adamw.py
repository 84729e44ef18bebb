"""Fused AdamW / Adam step on quantized m and v for CPU tensors: one pass over memory, in
parallel over chunks of quantization blocks (numba prange).

Bytes moved per element, as kernels/adamw.py: 2p + g + 2 * (bits/8) * 2 + 8 * 2 / B
(4-bit, B=128, fp32 p and g: 14.125 B/elem against torch fused AdamW's 28). Per block of
B elements: decode m and v into two fp32 rows, update (rows and parameter), absmax,
encode; the rows (B * 4 bytes each) stay in L1, so memory sees each byte once. The kernel
steps a range of blocks without the GIL; host.run_blocks splits a tensor's blocks over
threads.

The rule is optim/rules.adamw, op for op (see kernels/adamw.py for the formula):

    m = m_hat * b1 + g * (1 - b1);   v = v_hat * b2 + (g * g) * (1 - b2)
    p = p * decay - (m / (sqrt(v) * inv_bc2_sqrt + eps)) * step_size
    (Adam: g = g + p * wd first, decay = 1)
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
from .host import CpuBatch, add_nonfinite, layout_arrays, like, member_table, run_members, step_words


@lru_cache(maxsize=None)
def kernel_for(mlay: tuple, vlay: tuple, B: int):
    """The AdamW kernel compiled for these layouts (codec.py: lay tuples) and block size B,
    all compile-time constants of it (one compilation per key, cached on disk). m4 and v4
    are plain closure bools, not `lay[...]` tests: numba prunes a branch on a closure bool
    before it inlines the calls in it, and only LLVM prunes one on `lay[...]` (docs/cpu.md,
    "Encode by pairs: kept": compile time). A state encodes by pairs (pairs.py) when it is
    4-bit and not a searched code book: torchao-4bit's scanned books ran 10% slower that way
    (raw kernel 16.0 against 14.3 ms), so they keep codec's loop, then pack_codes."""
    m4, v4 = pc.by_pairs(mlay), pc.by_pairs(vlay)
    mbook, vbook = br.searched(mlay), br.searched(vlay)  # encoded a stage at a time (book_rows.py)
    BS = B if mbook or vbook else 1  # its scratch rows' size

    @njit(nogil=True, cache=True, error_model="numpy")
    def _adamw_kernel(b0, b1_, part, arrays, first, skeys, bad, like_p, like_g, mlim, mtab, vlim, vtab,
                      steps, scal, beta1, omb1, beta2, omb2, eps, l2_wd, fresh_m, fresh_v):
        """Steps blocks b0 .. b1_ - 1 of a launch (host.run_members; host.MemberTable's columns:
        p, g, m codes, m scales, v codes, v scales) and adds each member's count of non-finite
        gradient elements (zeroed) to bad[part, member]. steps: uint32 [3] = this step and the
        steps m and v were written at (the random streams' keys: codec.step_keys).
        scal: fp32 [lr, decay, step_size, inv_bc2_sqrt]."""
        b1, ob1, b2, ob2 = np.float32(beta1), np.float32(omb1), np.float32(beta2), np.float32(omb2)
        eps32, l2 = np.float32(eps), np.float32(l2_wd)
        decay, step_size, ibc2 = scal[1], scal[2], scal[3]
        msb, vsb = mlay[c.SBF16] != 0, vlay[c.SBF16] != 0
        arrays, first, skeys, bad, mlim, mtab, vlim, vtab, steps = nv.borrowed(  # no reference counts (native.py)
            (arrays, first, skeys, bad, mlim, mtab, vlim, vtab, steps))
        mrow = nv.scratch_f32(B)
        vrow = nv.scratch_f32(B)
        qm = nv.scratch_i32(B)  # m's codes: read, then written
        qv = nv.scratch_i32(B)
        rows = br.scratch_rows(BS)
        has_l2 = l2 != c.ZERO  # Adam: coupled weight decay
        i0, i1 = mb.member_span(first, b0, b1_)
        for i in range(i0, i1):
            a = arrays[i]
            numel = a[1]
            p, g = nv.view_like(like_p, a[0], a[1]), nv.view_like(like_g, a[2], a[3])
            mc, ms = mb.state_at(a, 4)
            vc, vs = mb.state_at(a, 8)
            km1, km2 = c.step_keys(skeys[i, 0], steps[0])
            kv1, kv2 = c.step_keys(skeys[i, 1], steps[0])
            rm1, rm2 = c.step_keys(skeys[i, 0], steps[1])  # m's codes were written with these
            rv1, rv2 = c.step_keys(skeys[i, 1], steps[2])
            nbad = 0
            lo, hi = mb.member_blocks(first, i, b0, b1_)
            for b in range(lo, hi):
                start = b * B
                cnt = min(B, numel - start)
                c.read_state(fresh_m, mc, ms, msb, mlay, mlim, mtab, b, start, cnt, rm1, rm2, qm, mrow)
                c.read_state(fresh_v, vc, vs, vsb, vlay, vlim, vtab, b, start, cnt, rv1, rv2, qv, vrow)
                if has_l2:  # unswitched by hand: each copy of the update loop is straight-line code
                    nb, mbits, vbits = _update(p, g, mrow, vrow, start, cnt, b1, ob1, b2, ob2, eps32, l2, decay,
                                               step_size, ibc2, mlay, vlay, True)
                else:
                    nb, mbits, vbits = _update(p, g, mrow, vrow, start, cnt, b1, ob1, b2, ob2, eps32, l2, decay,
                                               step_size, ibc2, mlay, vlay, False)
                nbad += nb
                if m4 and v4:
                    mscale, vscale = pc.encode_pack4_two(mrow, vrow, cnt, mbits, vbits, mlay, vlay, mlim,
                                                         vlim, mtab, vtab, b, start, km1, km2, kv1, kv2,
                                                         c.STORED, mc, vc)
                    c.store_scale(ms, b, mscale, msb)
                    c.store_scale(vs, b, vscale, vsb)
                    continue
                if m4:
                    c.store_scale(ms, b, pc.encode_pack4(mrow, cnt, mbits, mlay, mlim, mtab, b, start, km1,
                                                         km2, c.STORED, mc), msb)
                elif mbook:
                    c.store_scale(ms, b, br.encode_searched(mrow, cnt, mbits, mlay, mlim, mtab, b, start, km1, km2,
                                                            c.STORED, qm, rows), msb)
                    c.pack_codes(qm, mlay[c.BITS], start, cnt, mc)
                else:
                    c.store_scale(ms, b, c.encode_with_absmax(mrow, cnt, mbits, mlay, mlim, mtab, b, start, km1,
                                                              km2, c.STORED, qm), msb)
                    c.pack_codes(qm, mlay[c.BITS], start, cnt, mc)
                if v4:
                    c.store_scale(vs, b, pc.encode_pack4(vrow, cnt, vbits, vlay, vlim, vtab, b, start, kv1,
                                                         kv2, c.STORED, vc), vsb)
                elif vbook:
                    c.store_scale(vs, b, br.encode_searched(vrow, cnt, vbits, vlay, vlim, vtab, b, start, kv1, kv2,
                                                            c.STORED, qv, rows), vsb)
                    c.pack_codes(qv, vlay[c.BITS], start, cnt, vc)
                else:
                    c.store_scale(vs, b, c.encode_with_absmax(vrow, cnt, vbits, vlay, vlim, vtab, b, start, kv1,
                                                              kv2, c.STORED, qv), vsb)
                    c.pack_codes(qv, vlay[c.BITS], start, cnt, vc)
            bad[part, i] += nbad
        return 0

    return _adamw_kernel


@njit(cache=True, inline="always", error_model="numpy")
def _update(p, g, mrow, vrow, start, cnt, b1, ob1, b2, ob2, eps32, l2, decay, step_size, ibc2, mlay, vlay, has_l2):
    """The rule over one block, the gradient's and parameter's I/O, the absmaxes: one pass.
    mrow, vrow: the decoded m and v in, their values as stored (codec.STORED) out. Returns
    (non-finite gradients, abs_bits max of m, of v). A dithered v read back below 0 counts
    as 0 (a fresh v is all +0, which the clamp leaves as is)."""
    v_sqrt = vlay[c.SQRT] != 0
    i0 = np.uint64(start)
    bad = np.int32(0)
    mbits = np.uint32(0)  # running max of |m| and |v| as stored (codec.encode_with_absmax)
    vbits = np.uint32(0)
    for j in range(cnt):
        i = i0 + np.uint64(j)
        gj = c.value_at(g, i)
        ok = abs(gj) < c.INF
        gj = gj if ok else c.ZERO
        bad = np.int32(bad + np.int32(not ok))
        pj = c.value_at(p, i)
        if has_l2:
            gj = gj + pj * l2
        vh = vrow[j]
        if not v_sqrt:
            vh = c.ZERO if vh < c.ZERO else vh
        m = mrow[j] * b1 + gj * ob1
        v = vh * b2 + (gj * gj) * ob2
        sqrt_v = np.sqrt(v)
        c.store_value(p, i, pj * decay - (m / (sqrt_v * ibc2 + eps32)) * step_size)
        ms_ = c.stored_value(m, mlay, False)  # the values encode quantizes (codec.STORED)
        vs_ = c.stored_value(sqrt_v if v_sqrt else v, vlay, True)
        mrow[j] = ms_
        vrow[j] = vs_
        mbits = max(mbits, c.abs_bits(ms_))
        vbits = max(vbits, c.abs_bits(vs_))
    return bad, mbits, vbits


def _columns(member):
    """A member's arrays for the kernel (host.member_table): p, g, then codes and scale words of m and v."""
    (mc, ms), (vc, vs) = member.states["m"], member.states["v"]
    return ((member.param, member.param.element_size()), (member.grad, member.grad.element_size()),
            (mc, 1), (ms, 2), (vc, 1), (vs, 2))


def adamw_step(batch: CpuBatch, scalars, m, v, *, p_kind: int, g_kind: int, step: int,
               written: tuple[int, int], fresh: tuple[bool, bool], beta1: float, beta2: float, eps: float,
               l2_wd: float = 0.0, tables=(None, None)) -> None:
    """One fused AdamW step over every tensor of `batch` in one kernel call (host.run_members),
    with kernels/adamw.adamw_step's signature (m, v: launch.StateLayout; scalars: rules.pack_scalars)."""
    if m.block != v.block:
        raise ValueError("m and v must share a block size to be stepped by one kernel")
    mlay, mlim, mtab = layout_arrays(m, tables[0])
    vlay, vlim, vtab = layout_arrays(v, tables[1])
    kernel = kernel_for(mlay, vlay, int(m.block))
    table = member_table(batch, _columns, int(m.block), 2)
    first = batch.members[0]
    bad = run_members(kernel, table, int(m.block),
                      (like(first.param), like(first.grad), mlim, mtab, vlim, vtab, step_words(step, *written),
                       scalars.detach().cpu().numpy(), float(beta1), 1.0 - float(beta1), float(beta2),
                       1.0 - float(beta2), float(eps), float(l2_wd), bool(fresh[0]), bool(fresh[1])))
    add_nonfinite(batch, bad)
