"""Fused Muon momentum update on a quantized buffer: the new buffer is requantized in place
and the fp32 update written out for the Newton-Schulz orthogonalization (torch, per matrix).

Bytes moved per element (one state): g + 2 * (bits/8) + 4 (fp32 update out) + 8 / B
    4-bit, B=128: bf16 g 7.06 B/elem (fp32 buffer: 14 B/elem)

The rule is optim/rules.muon_momentum, op for op:

    buf = buf_hat * b + g * (1 - b);  update = g * (1 - b) + buf * b (Nesterov) or buf

The parameter itself is updated in torch after the orthogonalization
(p = p * decay - orth(update) * lr), exactly as the reference does.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import common as c
from .launch import LAUNCH_OPTIONS, NCOL, Batch, StateLayout, as_int32, tile_shape


@triton.jit
def _muon_tile(g_ptr, out_ptr, mc_ptr, ms_ptr, table_ptr, rem, row0, key, step, written, fresh,
               beta, omb, G_KIND: tl.constexpr, NESTEROV: tl.constexpr,
               KIND: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, TOP: tl.constexpr,
               NT: tl.constexpr, ROUND: tl.constexpr, SQRT: tl.constexpr, SBF16: tl.constexpr,
               B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr):
    g, nonfinite = c.load_grad(g_ptr, rem, G_KIND, B, BP, ROWS, MASKED)
    buf_hat = c.decode_state(mc_ptr, ms_ptr, table_ptr, rem, row0, key, written, fresh,
                             KIND, BITS, SIGNED, TOP, NT, ROUND, SQRT, SBF16, B, BP, ROWS, MASKED)
    buf = buf_hat * beta + g * omb
    if NESTEROV:
        upd = g * omb + buf * beta
    else:
        upd = buf
    c.store_values(out_ptr, upd, rem, 0, B, BP, ROWS, MASKED)
    c.encode_state(buf, mc_ptr, ms_ptr, table_ptr, rem, row0, key, step,
                   KIND, BITS, SIGNED, TOP, NT, ROUND, SQRT, SBF16, B, BP, ROWS, MASKED)
    return nonfinite


@triton.jit(do_not_specialize=["seed", "step", "written", "fresh"])
def _muon_kernel(
    meta_ptr,  # int64 [T, NCOL]: addresses and sizes of each tensor (launch.META_COLUMNS)
    prog_ptr,  # int32 [grid]: the tensor each program works on
    table_ptr,  # fp32 code book of the buffer (table formats only)
    seed, step, written, fresh,  # int32 bit patterns of the uint32 seed and steps; fresh: buffer reads 0
    beta, omb,  # fp32 momentum and 1 - momentum (from float64)
    G_KIND: tl.constexpr, NESTEROV: tl.constexpr,
    M_KIND: tl.constexpr, M_BITS: tl.constexpr, M_SIGNED: tl.constexpr, M_TOP: tl.constexpr,
    M_NT: tl.constexpr, M_ROUND: tl.constexpr, M_SQRT: tl.constexpr, M_SBF16: tl.constexpr,
    B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, ALIGNED: tl.constexpr, NC: tl.constexpr,
):
    meta, row0, base, rem, full = c.program_tile(meta_ptr, prog_ptr, NC, B, BP, ROWS)
    key = c.stream_key(seed.to(tl.uint32, bitcast=True), tl.load(meta + c.TENSOR_ID).to(tl.uint32), 0)
    g_ptr = c.value_ptr(tl.load(meta + c.GRAD), G_KIND, ALIGNED) + base
    out_ptr = c.value_ptr(tl.load(meta + c.OUT), 0, ALIGNED) + base
    mc_ptr = c.codes_ptr_at(tl.load(meta + c.M_CODES), ALIGNED) + base * M_BITS // 8
    ms_ptr = c.scales_ptr_at(tl.load(meta + c.M_SCALES), M_SBF16) + row0
    stp = step.to(tl.uint32, bitcast=True)
    wm = written.to(tl.uint32, bitcast=True)
    if full:  # every element of the tile exists: no masks
        nonfinite = _muon_tile(g_ptr, out_ptr, mc_ptr, ms_ptr, table_ptr, rem, row0, key, stp, wm, fresh,
                               beta, omb, G_KIND, NESTEROV,
                               M_KIND, M_BITS, M_SIGNED, M_TOP, M_NT, M_ROUND, M_SQRT, M_SBF16, B, BP, ROWS, False)
    else:
        nonfinite = _muon_tile(g_ptr, out_ptr, mc_ptr, ms_ptr, table_ptr, rem, row0, key, stp, wm, fresh,
                               beta, omb, G_KIND, NESTEROV,
                               M_KIND, M_BITS, M_SIGNED, M_TOP, M_NT, M_ROUND, M_SQRT, M_SBF16, B, BP, ROWS, True)
    c.count_nonfinite(meta, nonfinite)


def muon_momentum_step(batch: Batch, m: StateLayout, *, g_kind: int, seed: int, step: int, written: int,
                       fresh: bool, momentum: float, nesterov: bool, table=None) -> None:
    """Launch the fused momentum update over every tensor of `batch`; each member's `out`
    (fp32, the parameter's shape) receives its update."""
    bp, rows, warps = tile_shape(m.block, batch.value_bytes)
    _muon_kernel[(batch.grid,)](
        batch.meta, batch.programs, table if table is not None else batch.meta,
        as_int32(seed), as_int32(step), as_int32(written), int(fresh),
        float(momentum), 1.0 - float(momentum),
        G_KIND=g_kind, NESTEROV=int(bool(nesterov)), **m.constexprs("M_"),
        B=m.block, BP=bp, ROWS=rows, ALIGNED=batch.aligned, NC=NCOL, num_warps=warps, **LAUNCH_OPTIONS)
