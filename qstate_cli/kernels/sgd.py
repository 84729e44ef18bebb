"""Fused SGD-with-momentum step on a quantized momentum buffer (torch.optim.SGD semantics).

Bytes moved per element (one state): 2p + g + 2 * (bits/8) + 8 / B
    4-bit, B=128: bf16 p and g 7.06 B/elem; fp32 p and g 13.06 B/elem

The rule is optim/rules.sgd, op for op (coupled weight decay first, as torch does):

    g = g + p * wd;  buf = g (first step) or buf_hat * mu + g * (1 - dampening)
    d = g + buf * mu (Nesterov) or buf;  p = p - d * lr
"""
from __future__ import annotations

from collections import namedtuple

import triton
import triton.language as tl

from . import common as c
from . import memory as mem
from . import nibbles as nb
from . import tiles
from .launch import LAUNCH_OPTIONS, NCOL, Batch, StateLayout, as_int32, interpreting, tile_parts, tile_shape

# SGD's own compile-time constants, one argument through the tile (OPTS.P_KIND, ...)
_Opts = namedtuple("_Opts", ["P_KIND", "G_KIND", "INTERPRET", "WD", "NESTEROV"])

@triton.jit
def _sgd_part(ptrs, hyper, mc_ptr, ms_ptr, table_ptr, rem, row0, w1, w2, OPTS: tl.constexpr, M: tl.constexpr,
              FRESH: tl.constexpr, B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
              C0: tl.constexpr, ALIGNED: tl.constexpr):
    """Columns C0 .. C0 + W - 1 of every block row of the tile (tiles.step_tiles): load,
    decode, update, store the parameter. Returns (the new buffer, the gradient as loaded)."""
    p_ptr, g_ptr = ptrs
    lr, momentum, one_minus_dampening, wd = hyper
    G: tl.constexpr = 4 if OPTS.P_KIND == c.F32 or OPTS.G_KIND == c.F32 else 8  # columns per thread (launch.tile_shape)
    p = mem.load_values(p_ptr, rem, OPTS.P_KIND, B, W, ROWS, MASKED, C0, ALIGNED)
    g, g_raw = mem.load_grad(g_ptr, rem, OPTS.G_KIND, B, W, ROWS, MASKED, C0, ALIGNED)
    if OPTS.WD:
        g = g + p * wd
    if FRESH:  # first step (or after a reset): the buffer starts as the gradient
        buf = g
    else:
        buf_hat = nb.decode_state(mc_ptr, ms_ptr, table_ptr, rem, row0, w1, w2, M, False, B, W, ROWS, MASKED, C0,
                                  ALIGNED, G)
        buf = buf_hat * momentum + g * one_minus_dampening
    if OPTS.NESTEROV:
        d = g + buf * momentum
    else:
        d = buf
    p = p - d * lr
    mem.store_values(p_ptr, p, rem, OPTS.P_KIND, OPTS.INTERPRET, B, W, ROWS, MASKED, C0, ALIGNED)
    return buf, g_raw


@triton.jit(do_not_specialize=["step", "written"])
def _sgd_kernel(
    meta_ptr,  # int64 [T, NCOL]: addresses, sizes and stream keys of each tensor (launch.META_COLUMNS)
    prog_ptr,  # int32 [grid]: the tensor each program works on
    scal_ptr,  # fp32 [4]: lr, (unused) x 3
    table_ptr,  # fp32 code book of the buffer (table formats only)
    step, written,  # int32 bit patterns of uint32 steps: this one, and when the buffer was written
    momentum, one_minus_dampening, wd,  # fp32 hyper-parameters
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, INTERPRET: tl.constexpr, WD: tl.constexpr,
    NESTEROV: tl.constexpr,
    M_KIND: tl.constexpr, M_BITS: tl.constexpr, M_SIGNED: tl.constexpr, M_TOP: tl.constexpr,
    M_NT: tl.constexpr, M_ROUND: tl.constexpr, M_SQRT: tl.constexpr, M_SBF16: tl.constexpr, FRESH: tl.constexpr,
    B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, ALIGNED: tl.constexpr,
    NC: tl.constexpr, PARTS: tl.constexpr,  # a thread holds PARTS 16-byte vectors of one block row
):
    meta, numel, tile0, ntiles = mem.program_tiles(meta_ptr, prog_ptr, NC, B, ROWS, TILES)
    key = tl.load(meta + c.M_KEY).to(tl.uint32)
    k1, k2 = c.step_keys(key, step.to(tl.uint32, bitcast=True))
    w1, w2 = c.step_keys(key, written.to(tl.uint32, bitcast=True))
    lr = tl.load(scal_ptr + 0)
    p_base = mem.value_ptr(tl.load(meta + c.PARAM), P_KIND, ALIGNED)
    g_base = mem.value_ptr(tl.load(meta + c.GRAD), G_KIND, ALIGNED)
    mc_base = mem.codes_ptr_at(tl.load(meta + c.M_CODES), ALIGNED)
    ms_base = mem.scales_ptr_at(tl.load(meta + c.M_SCALES), M_SBF16)
    hyper = (lr, momentum, one_minus_dampening, wd)
    OPTS: tl.constexpr = _Opts(P_KIND, G_KIND, INTERPRET, WD, NESTEROV)
    M: tl.constexpr = c.Format(M_KIND, M_BITS, M_SIGNED, M_TOP, M_NT, M_ROUND, M_SQRT, M_SBF16)
    seen = tl.zeros([ROWS, BP // PARTS], tl.float32)
    seen = tiles.step_tiles(seen, _sgd_part, (p_base, g_base), hyper, mc_base, ms_base, table_ptr, numel, tile0,
                            ntiles, k1, k2, w1, w2, OPTS, M, FRESH, B, BP, ROWS, PARTS, ALIGNED)
    mem.count_nonfinite(meta, seen, g_base, numel, tile0, ntiles, G_KIND, B, BP, ROWS)


def sgd_step(batch: Batch, scalars, m: StateLayout, *, p_kind: int, g_kind: int, step: int,
             written: int, fresh: bool, momentum: float, dampening: float, weight_decay: float,
             nesterov: bool, table=None) -> None:
    """Launch one fused SGD-momentum step over every tensor of `batch` (launch.build_batch)."""
    bp, rows, warps = tile_shape(m.block, batch.value_bytes)
    parts = tile_parts(m.block, batch.value_bytes)
    _sgd_kernel[(batch.grid,)](
        batch.meta, batch.programs, scalars, table if table is not None else scalars,
        as_int32(step), as_int32(written), float(momentum), 1.0 - float(dampening), float(weight_decay),
        P_KIND=p_kind, G_KIND=g_kind, INTERPRET=interpreting(), WD=int(weight_decay != 0.0),
        NESTEROV=int(bool(nesterov)), **m.constexprs("M_"), FRESH=int(bool(fresh)),
        B=m.block, BP=bp, ROWS=rows, TILES=batch.tiles, ALIGNED=batch.aligned, NC=NCOL, PARTS=parts,
        num_warps=warps, **LAUNCH_OPTIONS)
