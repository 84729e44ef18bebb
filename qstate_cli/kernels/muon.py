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

from collections import namedtuple

import triton
import triton.language as tl

from . import codes as cd
from . import common as c
from . import memory as mem
from . import tiles
from .launch import LAUNCH_OPTIONS, NCOL, Batch, StateLayout, as_int32, tile_parts, tile_shape

# Muon's own compile-time constants, one argument through the tile (OPTS.G_KIND, ...)
_Opts = namedtuple("_Opts", ["G_KIND", "NESTEROV"])

@triton.jit
def _muon_part(ptrs, hyper, mc_ptr, ms_ptr, table_ptr, rem, row0, w1, w2, OPTS: tl.constexpr, M: tl.constexpr,
               FRESH: tl.constexpr, B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
               C0: tl.constexpr, ALIGNED: tl.constexpr):
    """Columns C0 .. C0 + W - 1 of every block row of the tile (tiles.step_tiles): load,
    decode, update, write the update out. Returns (the new buffer, the gradient as loaded)."""
    g_ptr, out_ptr = ptrs
    beta, omb = hyper
    g, g_raw = mem.load_grad(g_ptr, rem, OPTS.G_KIND, B, W, ROWS, MASKED, C0, ALIGNED)
    buf_hat = cd.decode_state(mc_ptr, ms_ptr, table_ptr, rem, row0, w1, w2, M, FRESH, B, W, ROWS, MASKED, C0)
    buf = buf_hat * beta + g * omb
    if OPTS.NESTEROV:
        upd = g * omb + buf * beta
    else:
        upd = buf
    mem.store_values(out_ptr, upd, rem, 0, False, B, W, ROWS, MASKED, C0)
    return buf, g_raw


@triton.jit(do_not_specialize=["step", "written"])
def _muon_kernel(
    meta_ptr,  # int64 [T, NCOL]: addresses, sizes and stream keys of each tensor (launch.META_COLUMNS)
    prog_ptr,  # int32 [grid]: the tensor each program works on
    table_ptr,  # fp32 code book of the buffer (table formats only)
    step, written,  # int32 bit patterns of uint32 steps: this one, and when the buffer was written
    beta, omb,  # fp32 momentum and 1 - momentum (from float64)
    G_KIND: tl.constexpr, NESTEROV: tl.constexpr,
    M_KIND: tl.constexpr, M_BITS: tl.constexpr, M_SIGNED: tl.constexpr, M_TOP: tl.constexpr,
    M_NT: tl.constexpr, M_ROUND: tl.constexpr, M_SQRT: tl.constexpr, M_SBF16: tl.constexpr, FRESH: tl.constexpr,
    B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, ALIGNED: tl.constexpr,
    NC: tl.constexpr, PARTS: tl.constexpr,  # a thread holds PARTS 16-byte vectors of one block row
):
    meta, numel, tile0, ntiles = mem.program_tiles(meta_ptr, prog_ptr, NC, B, ROWS, TILES)
    key = tl.load(meta + c.M_KEY).to(tl.uint32)
    k1, k2 = c.step_keys(key, step.to(tl.uint32, bitcast=True))
    w1, w2 = c.step_keys(key, written.to(tl.uint32, bitcast=True))
    g_base = mem.value_ptr(tl.load(meta + c.GRAD), G_KIND, ALIGNED)
    out_base = mem.value_ptr(tl.load(meta + c.OUT), 0, ALIGNED)
    mc_base = mem.codes_ptr_at(tl.load(meta + c.M_CODES), ALIGNED)
    ms_base = mem.scales_ptr_at(tl.load(meta + c.M_SCALES), M_SBF16)
    OPTS: tl.constexpr = _Opts(G_KIND, NESTEROV)
    M: tl.constexpr = c.Format(M_KIND, M_BITS, M_SIGNED, M_TOP, M_NT, M_ROUND, M_SQRT, M_SBF16)
    seen = tl.zeros([ROWS, BP // PARTS], tl.float32)
    seen = tiles.step_tiles(seen, _muon_part, (g_base, out_base), (beta, omb), mc_base, ms_base, table_ptr, numel,
                            tile0, ntiles, k1, k2, w1, w2, OPTS, M, FRESH, B, BP, ROWS, PARTS, ALIGNED)
    mem.count_nonfinite(meta, seen, g_base, numel, tile0, ntiles, G_KIND, B, BP, ROWS)


def muon_momentum_step(batch: Batch, m: StateLayout, *, g_kind: int, step: int, written: int,
                       fresh: bool, momentum: float, nesterov: bool, table=None) -> None:
    """Launch the fused momentum update over every tensor of `batch`; each member's `out`
    (fp32, the parameter's shape) receives its update."""
    bp, rows, warps = tile_shape(m.block, batch.value_bytes)
    parts = tile_parts(m.block, batch.value_bytes)
    _muon_kernel[(batch.grid,)](
        batch.meta, batch.programs, table if table is not None else batch.meta,
        as_int32(step), as_int32(written), float(momentum), 1.0 - float(momentum),
        G_KIND=g_kind, NESTEROV=int(bool(nesterov)), **m.constexprs("M_"), FRESH=int(bool(fresh)),
        B=m.block, BP=bp, ROWS=rows, TILES=batch.tiles, ALIGNED=batch.aligned, NC=NCOL, PARTS=parts,
        num_warps=warps, **LAUNCH_OPTIONS)
