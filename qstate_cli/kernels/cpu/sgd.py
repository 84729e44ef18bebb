"""Fused SGD-with-momentum step on a quantized momentum buffer for CPU tensors (torch.optim.SGD
semantics), one pass over memory in parallel over chunks of blocks (as adamw.py).

Bytes moved per element (one state), as kernels/sgd.py: 2p + g + 2 * (bits/8) + 8 / B.
The rule is optim/rules.sgd, op for op (coupled weight decay first, as torch does):

    g = g + p * wd;  buf = g (first step) or buf_hat * mu + g * (1 - dampening)
    d = g + buf * mu (Nesterov) or buf;  p = p - d * lr
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
    def _sgd_kernel(b0, b1_, p, g, mc, ms, mlim, mtab, numel, ks, scal, momentum, omd, wd, use_wd, nesterov,
                    fresh):
        """ks: uint32 [4] = keys of this step (0, 1) and of the step the buffer was written at
        (2, 3); scal: fp32 [lr, ...]; omd = 1 - dampening; use_wd: weight_decay != 0 (as
        kernels/sgd.py's WD). Returns the non-finite count."""
        mu, om, wd32 = np.float32(momentum), np.float32(omd), np.float32(wd)
        lr = scal[0]
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
            nbad += c.load_grad(g, start, cnt, grow)
            c.load_row(p, start, cnt, prow)
            if use_wd:
                for j in range(cnt):
                    grow[j] = grow[j] + prow[j] * wd32
            if fresh:  # first step (or after a reset): the buffer starts as the gradient
                for j in range(cnt):
                    mrow[j] = grow[j]
            else:
                c.decode_block(mc, c.scale_at(ms, b, msb), mlay, mlim, mtab, b, start, cnt, ks[2], ks[3], q, mrow)
                for j in range(cnt):
                    mrow[j] = mrow[j] * mu + grow[j] * om
            if nesterov:
                for j in range(cnt):
                    prow[j] = prow[j] - (grow[j] + mrow[j] * mu) * lr
            else:
                for j in range(cnt):
                    prow[j] = prow[j] - mrow[j] * lr
            c.store_row(prow, start, cnt, p)
            if m4:
                c.store_scale(ms, b, pc.encode_row4(mrow, cnt, mlay, mlim, mtab, b, start, ks[0], ks[1], mc), msb)
            else:
                c.store_scale(ms, b, c.encode_block(mrow, cnt, mlay, mlim, mtab, b, start, ks[0], ks[1], False, q),
                              msb)
                c.pack_codes(q, mlay[c.BITS], start, cnt, mc)
        return nbad

    return _sgd_kernel


def sgd_step(batch: CpuBatch, scalars, m, *, p_kind: int, g_kind: int, step: int, written: int, fresh: bool,
             momentum: float, dampening: float, weight_decay: float, nesterov: bool, table=None) -> None:
    """One fused SGD-momentum step over every tensor of `batch`, with kernels/sgd.sgd_step's signature."""
    mlay, mlim, mtab = layout_arrays(m, table)
    kernel = kernel_for(mlay, int(m.block))
    scal = scalars.detach().cpu().numpy()
    for member in batch.members:
        p, g, (mc, ms) = numpy_views(member, ("m",))
        km = batch.stream_key(member, 0)
        ks = np.array(keys(km, step) + keys(km, written), np.uint32)
        bad = run_blocks(kernel, p.size, m.block,
                         (p, g, mc, ms, mlim, mtab, p.size, ks, scal, float(momentum),
                          1.0 - float(dampening), float(weight_decay), weight_decay != 0.0, bool(nesterov),
                          bool(fresh)))
        if bad:
            member.nonfinite += int(bad)
