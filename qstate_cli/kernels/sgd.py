"""Fused SGD-with-momentum step on a quantized momentum buffer (torch.optim.SGD semantics).

Bytes moved per element (one state): 2p + g + 2 * (bits/8) + 8 / B
    4-bit, B=128: bf16 p and g 7.06 B/elem; fp32 p and g 13.06 B/elem

The rule is optim/rules.sgd, op for op (coupled weight decay first, as torch does):

    g = g + p * wd;  buf = g (first step) or buf_hat * mu + g * (1 - dampening)
    d = g + buf * mu (Nesterov) or buf;  p = p - d * lr
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import common as c
from .launch import LAUNCH_OPTIONS, NCOL, Batch, StateLayout, as_int32, tile_shape


@triton.jit
def _sgd_tile(p_ptr, g_ptr, mc_ptr, ms_ptr, table_ptr, scal_ptr, rem, row0, key, step, written, fresh,
              momentum, one_minus_dampening, wd, P_KIND: tl.constexpr, G_KIND: tl.constexpr,
              WD: tl.constexpr, NESTEROV: tl.constexpr,
              KIND: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, TOP: tl.constexpr,
              NT: tl.constexpr, ROUND: tl.constexpr, SQRT: tl.constexpr, SBF16: tl.constexpr,
              B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr):
    p = c.load_values(p_ptr, rem, P_KIND, B, BP, ROWS, MASKED)
    g, nonfinite = c.load_grad(g_ptr, rem, G_KIND, B, BP, ROWS, MASKED)
    if WD:
        g = g + p * wd
    buf_hat = c.decode_state(mc_ptr, ms_ptr, table_ptr, rem, row0, key, written, fresh,
                             KIND, BITS, SIGNED, TOP, NT, ROUND, SQRT, SBF16, B, BP, ROWS, MASKED)
    buf = tl.where(fresh != 0, g, buf_hat * momentum + g * one_minus_dampening)
    if NESTEROV:
        d = g + buf * momentum
    else:
        d = buf
    p = p - d * tl.load(scal_ptr + 0)
    c.store_values(p_ptr, p, rem, P_KIND, B, BP, ROWS, MASKED)
    c.encode_state(buf, mc_ptr, ms_ptr, table_ptr, rem, row0, key, step,
                   KIND, BITS, SIGNED, TOP, NT, ROUND, SQRT, SBF16, B, BP, ROWS, MASKED)
    return nonfinite


@triton.jit(do_not_specialize=["seed", "step", "written", "fresh"])
def _sgd_kernel(
    meta_ptr,  # int64 [T, NCOL]: addresses and sizes of each tensor (launch.META_COLUMNS)
    prog_ptr,  # int32 [grid]: the tensor each program works on
    scal_ptr,  # fp32 [4]: lr, (unused) x 3
    table_ptr,  # fp32 code book of the buffer (table formats only)
    seed, step, written, fresh,  # int32 bit patterns of the uint32 seed and steps; fresh: first step
    momentum, one_minus_dampening, wd,  # fp32 hyper-parameters
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, WD: tl.constexpr, NESTEROV: tl.constexpr,
    M_KIND: tl.constexpr, M_BITS: tl.constexpr, M_SIGNED: tl.constexpr, M_TOP: tl.constexpr,
    M_NT: tl.constexpr, M_ROUND: tl.constexpr, M_SQRT: tl.constexpr, M_SBF16: tl.constexpr,
    B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, ALIGNED: tl.constexpr, NC: tl.constexpr,
):
    meta, row0, base, rem, full = c.program_tile(meta_ptr, prog_ptr, NC, B, BP, ROWS)
    key = c.stream_key(seed.to(tl.uint32, bitcast=True), tl.load(meta + c.TENSOR_ID).to(tl.uint32), 0)
    p_ptr = c.value_ptr(tl.load(meta + c.PARAM), P_KIND, ALIGNED) + base
    g_ptr = c.value_ptr(tl.load(meta + c.GRAD), G_KIND, ALIGNED) + base
    mc_ptr = c.codes_ptr_at(tl.load(meta + c.M_CODES), ALIGNED) + base * M_BITS // 8
    ms_ptr = c.scales_ptr_at(tl.load(meta + c.M_SCALES), M_SBF16) + row0
    stp = step.to(tl.uint32, bitcast=True)
    wm = written.to(tl.uint32, bitcast=True)
    if full:  # every element of the tile exists: no masks
        nonfinite = _sgd_tile(p_ptr, g_ptr, mc_ptr, ms_ptr, table_ptr, scal_ptr, rem, row0, key, stp, wm, fresh,
                              momentum, one_minus_dampening, wd, P_KIND, G_KIND, WD, NESTEROV,
                              M_KIND, M_BITS, M_SIGNED, M_TOP, M_NT, M_ROUND, M_SQRT, M_SBF16, B, BP, ROWS, False)
    else:
        nonfinite = _sgd_tile(p_ptr, g_ptr, mc_ptr, ms_ptr, table_ptr, scal_ptr, rem, row0, key, stp, wm, fresh,
                              momentum, one_minus_dampening, wd, P_KIND, G_KIND, WD, NESTEROV,
                              M_KIND, M_BITS, M_SIGNED, M_TOP, M_NT, M_ROUND, M_SQRT, M_SBF16, B, BP, ROWS, True)
    c.count_nonfinite(meta, nonfinite)


def sgd_step(batch: Batch, scalars, m: StateLayout, *, p_kind: int, g_kind: int, seed: int, step: int,
             written: int, fresh: bool, momentum: float, dampening: float, weight_decay: float,
             nesterov: bool, table=None) -> None:
    """Launch one fused SGD-momentum step over every tensor of `batch` (launch.build_batch)."""
    bp, rows, warps = tile_shape(m.block, batch.value_bytes)
    _sgd_kernel[(batch.grid,)](
        batch.meta, batch.programs, scalars, table if table is not None else scalars,
        as_int32(seed), as_int32(step), as_int32(written), int(fresh),
        float(momentum), 1.0 - float(dampening), float(weight_decay),
        P_KIND=p_kind, G_KIND=g_kind, WD=int(weight_decay != 0.0), NESTEROV=int(bool(nesterov)),
        **m.constexprs("M_"), B=m.block, BP=bp, ROWS=rows, ALIGNED=batch.aligned, NC=NCOL,
        num_warps=warps, **LAUNCH_OPTIONS)
