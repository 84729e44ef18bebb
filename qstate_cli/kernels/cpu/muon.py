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

from . import codec as c
from . import native as nv
from . import pairs as pc
from .host import CpuBatch, array, keys, layout_arrays, numpy_views, run_blocks


@lru_cache(maxsize=None)
def kernel_for(mlay: tuple, B: int):
    """The kernel compiled for this layout (codec.py: lay tuple) and block size B, both
    compile-time constants of it (one compilation per key, cached on disk). A 4-bit state
    that pairs.by_pairs takes is encoded by pairs (pairs.encode_row4; m4: a closure bool)."""
    m4 = pc.by_pairs(mlay)

    @njit(nogil=True, cache=True, error_model="numpy")
    def _muon_kernel(b0, b1_, g, out, mc, ms, mlim, mtab, numel, ks, beta, omb, nesterov, fresh):
        """ks: uint32 [4] = keys of this step (0, 1) and of the step the buffer was written at
        (2, 3); out: fp32 update. Returns the non-finite count."""
        b, ob = np.float32(beta), np.float32(omb)
        msb = mlay[c.SBF16] != 0
        g, out, mc, ms, mlim, mtab, ks = nv.borrowed(  # no reference counts (native.py)
            (g, out, mc, ms, mlim, mtab, ks))
        mrow = nv.scratch_f32(B)
        grow = nv.scratch_f32(B)
        urow = nv.scratch_f32(B)
        q = nv.scratch_i32(B)
        nbad = 0
        for blk in range(b0, b1_):
            start = blk * B
            cnt = min(B, numel - start)
            c.read_state(fresh, mc, ms, msb, mlay, mlim, mtab, blk, start, cnt, ks[2], ks[3], q, mrow)
            nbad += c.load_grad(g, start, cnt, grow)
            for j in range(cnt):
                mrow[j] = mrow[j] * b + grow[j] * ob
            if nesterov:
                for j in range(cnt):
                    urow[j] = grow[j] * ob + mrow[j] * b
                c.store_row(urow, start, cnt, out)
            else:
                c.store_row(mrow, start, cnt, out)
            if m4:
                c.store_scale(ms, blk, pc.encode_row4(mrow, cnt, mlay, mlim, mtab, blk, start, ks[0], ks[1], mc), msb)
            else:
                c.store_scale(ms, blk, c.encode_block(mrow, cnt, mlay, mlim, mtab, blk, start, ks[0], ks[1], False, q),
                              msb)
                c.pack_codes(q, mlay[c.BITS], start, cnt, mc)
        return nbad

    return _muon_kernel


def muon_momentum_step(batch: CpuBatch, m, *, g_kind: int, step: int, written: int, fresh: bool,
                       momentum: float, nesterov: bool, table=None) -> None:
    """The fused momentum update over every tensor of `batch` (kernels/muon.muon_momentum_step's
    signature); each member's `out` (fp32, the parameter's shape) receives its update."""
    mlay, mlim, mtab = layout_arrays(m, table)
    kernel = kernel_for(mlay, int(m.block))
    for member in batch.members:
        _, g, (mc, ms) = numpy_views(member, ("m",))
        out = array(member.out)
        km = batch.stream_key(member, 0)
        ks = np.array(keys(km, step) + keys(km, written), np.uint32)
        bad = run_blocks(kernel, g.size, m.block,
                         (g, out, mc, ms, mlim, mtab, g.size, ks, float(momentum),
                          1.0 - float(momentum), bool(nesterov), bool(fresh)))
        if bad:
            member.nonfinite += int(bad)
