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

from . import codec as c
from . import native as nv
from . import pairs as pc
from .host import CpuBatch, keys, layout_arrays, numpy_views, run_blocks


@lru_cache(maxsize=None)
def kernel_for(mlay: tuple, B: int):
    """The kernel compiled for this layout (codec.py: lay tuple) and block size B, both
    compile-time constants of it (one compilation per key, cached on disk). A 4-bit state
    that pairs.by_pairs takes is encoded by pairs (pairs.encode_row4; m4: a closure bool)."""
    m4 = pc.by_pairs(mlay)

    @njit(nogil=True, cache=True, error_model="numpy")
    def _lion_kernel(b0, b1_, p, g, mc, ms, mlim, mtab, numel, ks, scal, beta1, omb1, beta2, omb2, fresh):
        """ks: uint32 [4] = keys of this step (0, 1) and of the step m was written at (2, 3);
        scal: fp32 [lr, decay, ...]. Steps blocks b0 .. b1_ - 1; returns the non-finite count."""
        b1, ob1, b2, ob2 = np.float32(beta1), np.float32(omb1), np.float32(beta2), np.float32(omb2)
        lr, decay = scal[0], scal[1]
        msb = mlay[c.SBF16] != 0
        p, g, mc, ms, mlim, mtab, ks = nv.borrowed(  # no reference counts (native.py)
            (p, g, mc, ms, mlim, mtab, ks))
        mrow = nv.scratch_f32(B)
        prow = nv.scratch_f32(B)
        grow = nv.scratch_f32(B)
        q = nv.scratch_i32(B)
        nbad = 0
        for b in range(b0, b1_):
            start = b * B
            cnt = min(B, numel - start)
            c.read_state(fresh, mc, ms, msb, mlay, mlim, mtab, b, start, cnt, ks[2], ks[3], q, mrow)
            nbad += c.load_grad(g, start, cnt, grow)
            c.load_row(p, start, cnt, prow)
            for j in range(cnt):
                gj = grow[j]
                mh = mrow[j]
                cm = mh * b1 + gj * ob1
                sgn = c.ONE if cm > c.ZERO else (-c.ONE if cm < c.ZERO else c.ZERO)
                prow[j] = prow[j] * decay - sgn * lr
                mrow[j] = mh * b2 + gj * ob2
            c.store_row(prow, start, cnt, p)
            if m4:
                c.store_scale(ms, b, pc.encode_row4(mrow, cnt, mlay, mlim, mtab, b, start, ks[0], ks[1], mc), msb)
            else:
                c.store_scale(ms, b, c.encode_block(mrow, cnt, mlay, mlim, mtab, b, start, ks[0], ks[1], False, q),
                              msb)
                c.pack_codes(q, mlay[c.BITS], start, cnt, mc)
        return nbad

    return _lion_kernel


def lion_step(batch: CpuBatch, scalars, m, *, p_kind: int, g_kind: int, step: int, written: int, fresh: bool,
              beta1: float, beta2: float, table=None) -> None:
    """One fused Lion step over every tensor of `batch`, with kernels/lion.lion_step's signature."""
    mlay, mlim, mtab = layout_arrays(m, table)
    kernel = kernel_for(mlay, int(m.block))
    scal = scalars.detach().cpu().numpy()
    for member in batch.members:
        p, g, (mc, ms) = numpy_views(member, ("m",))
        km = batch.stream_key(member, 0)
        ks = np.array(keys(km, step) + keys(km, written), np.uint32)
        bad = run_blocks(kernel, p.size, m.block,
                         (p, g, mc, ms, mlim, mtab, p.size, ks, scal, float(beta1),
                          1.0 - float(beta1), float(beta2), 1.0 - float(beta2), bool(fresh)))
        if bad:
            member.nonfinite += int(bad)
