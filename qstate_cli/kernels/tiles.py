"""The tile of the one-state kernels (Lion, SGD, Muon), written once: step the tile with the
optimizer's part function, then requantize its state (state_tile); a program's tiles, the
full ones in one loop and the short last one after it (step_tiles).

A tile is ROWS quantization blocks held as PARTS (1 or 2) parts of W = BP / PARTS columns:
each thread holds the same block row in every part, so the per-row work (block scale, BReD
hashes, scale divisions) is done once for all of them (adamw._adamw_tile). The optimizer
supplies PART, a @triton.jit function (passed as an argument: Triton >= 3.3) with

    PART(ptrs, hyper, mc_ptr, ms_ptr, table_ptr, rem, row0, w1, w2, OPTS, M, FRESH,
         B, W, ROWS, MASKED, C0, ALIGNED) -> (the new state, the gradient as loaded)

for columns C0 .. C0 + W - 1: ptrs and hyper are tuples of the op's own pointers and fp32
scalars (unpacked at the top of PART), OPTS a namedtuple of its own constexprs (the op
module's _Opts) and M the state's format (common.Format), both read by field (OPTS.P_KIND,
M.BITS): unpacking a tuple of constexprs by assignment (`A, B = OPTS`) makes tensors of
them in Triton 3.9, so it is never done. (w1, w2) are the keys of the step the state was
written at, (k1, k2) those of this step. Tuples, fields and the function argument are
resolved at compile time: the SASS is the same, byte for byte, as with every value passed
by name (the variants of scripts/sass_budget.py, Triton 3.6 and 3.9).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import codes as cd
from . import memory as mem


@triton.jit
def _tile_parts(seen, PART: tl.constexpr, ptrs, hyper, mc_ptr, ms_ptr, table_ptr, rem, row0, k1, k2, w1, w2,
                OPTS: tl.constexpr, M: tl.constexpr, FRESH: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
                ROWS: tl.constexpr, MASKED: tl.constexpr, PARTS: tl.constexpr, ALIGNED: tl.constexpr):
    W: tl.constexpr = BP // PARTS
    x0, g0 = PART(ptrs, hyper, mc_ptr, ms_ptr, table_ptr, rem, row0, w1, w2, OPTS, M, FRESH,
                  B, W, ROWS, MASKED, 0, ALIGNED)
    seen = mem.track_nonfinite(seen, g0)
    x1 = x0
    if PARTS == 2:
        x1, g1 = PART(ptrs, hyper, mc_ptr, ms_ptr, table_ptr, rem, row0, w1, w2, OPTS, M, FRESH,
                      B, W, ROWS, MASKED, W, ALIGNED)
        seen = mem.track_nonfinite(seen, g1)
    cd.encode_parts(x0, x1, mc_ptr, ms_ptr, table_ptr, rem, row0, k1, k2, M, False, B, W, ROWS, MASKED, PARTS)
    return seen


@triton.jit
def state_tile(seen, full, PART: tl.constexpr, ptrs, hyper, mc_ptr, ms_ptr, table_ptr, rem, row0, k1, k2, w1, w2,
               OPTS: tl.constexpr, M: tl.constexpr, FRESH: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
               ROWS: tl.constexpr, PARTS: tl.constexpr, ALIGNED: tl.constexpr):
    """Step one tile with PART and store its state requantized; full: every element of the
    tile exists (memory.tile_origin), so no masks are built. Returns `seen` updated with the
    tile's gradient (memory.track_nonfinite)."""
    if full:
        seen = _tile_parts(seen, PART, ptrs, hyper, mc_ptr, ms_ptr, table_ptr, rem, row0, k1, k2, w1, w2,
                           OPTS, M, FRESH, B, BP, ROWS, False, PARTS, ALIGNED)
    else:
        seen = _tile_parts(seen, PART, ptrs, hyper, mc_ptr, ms_ptr, table_ptr, rem, row0, k1, k2, w1, w2,
                           OPTS, M, FRESH, B, BP, ROWS, True, PARTS, ALIGNED)
    return seen


@triton.jit
def step_tiles(seen, PART: tl.constexpr, bases, hyper, mc_base, ms_base, table_ptr, numel, tile0, ntiles, k1, k2,
               w1, w2, OPTS: tl.constexpr, M: tl.constexpr, FRESH: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
               ROWS: tl.constexpr, PARTS: tl.constexpr, ALIGNED: tl.constexpr):
    """Step the program's tiles tile0 .. tile0 + ntiles - 1 with state_tile: the full ones in one
    loop, then the rest (the tensor's short last tile; every tile if B < BP) in a second one, so
    the first carries neither the masked path nor its addresses (memory.full_tiles). bases:
    PART's two value pointers (ptrs) at the tensor's first element, moved to each tile's."""
    nfull = mem.full_tiles(numel, tile0, ntiles, B, BP, ROWS)
    for i in range(0, nfull):
        seen = _state_tile_at(seen, tile0 + i, True, PART, bases, hyper, mc_base, ms_base, table_ptr, numel, k1, k2,
                              w1, w2, OPTS, M, FRESH, B, BP, ROWS, PARTS, ALIGNED)
    for i in range(nfull, ntiles):
        seen = _state_tile_at(seen, tile0 + i, False, PART, bases, hyper, mc_base, ms_base, table_ptr, numel, k1, k2,
                              w1, w2, OPTS, M, FRESH, B, BP, ROWS, PARTS, ALIGNED)
    return seen


@triton.jit
def _state_tile_at(seen, tile, FULL: tl.constexpr, PART: tl.constexpr, bases, hyper, mc_base, ms_base, table_ptr,
                   numel, k1, k2, w1, w2, OPTS: tl.constexpr, M: tl.constexpr, FRESH: tl.constexpr, B: tl.constexpr,
                   BP: tl.constexpr, ROWS: tl.constexpr, PARTS: tl.constexpr, ALIGNED: tl.constexpr):
    """state_tile of the program's tile number `tile`, its pointers moved there from the bases."""
    a_base, b_base = bases
    row0, base, rem, _ = mem.tile_origin(numel, tile, B, BP, ROWS)
    return state_tile(seen, FULL, PART, (a_base + base, b_base + base), hyper, mc_base + base * M.BITS // 8,
                      ms_base + row0, table_ptr, rem, row0, k1, k2, w1, w2, OPTS, M, FRESH, B, BP, ROWS, PARTS,
                      ALIGNED)
