"""Where a kernel's tiles are and how values move: addresses, tile geometry, exact loads and
stores of parameters and gradients, non-finite gradient tracking.

A program works on tiles of ROWS quantization blocks of one tensor (program_tiles: its
tensor's row of the address table and up to TILES consecutive tiles), fp32 tiles of
[ROWS, BP] values, BP = the block size B rounded up to a power of two (columns >= B are
masked; only non-power-of-two blocks have them). `rem` is how many of the tile's elements
exist (the tensor's tail); with MASKED=False the whole tile exists and no mask is built.

Bytes, per element: a parameter or gradient is 4 (fp32) or 2 (bf16, fp16) bytes, read
exactly widened to fp32 (bf16: bits << 16) and written back rounded to nearest even;
4-bit codes are packed two a byte (tile_bytes: byte j holds element 2j in its low nibble,
2j + 1 in its high one), 8-bit codes one a byte; block scales are 4 (fp32) or 2 (bf16
bits, SBF16) bytes a block. A tensor's non-finite gradient count is one int64, added to
only by programs that saw a NaN or Inf (count_nonfinite).

    value_ptr, codes_ptr_at, scales_ptr_at   typed pointers from int64 addresses
    program_tiles, tile_origin               a program's tiles; a tile's first block/element
    tile, tile_bytes                         element / packed-byte offsets and masks
    load_values / store_values               torch's exact casts fp32 <-> bf16/fp16
    load_grad                                optim/base.py: a non-finite element counts as 0
    track_nonfinite, count_nonfinite         the per-tensor NaN/Inf count, off the hot path
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import BF16, F16, F32, FIRST_PROGRAM, NONFINITE, NUMEL


# ---- addresses and program geometry --------------------------------------------------------------
@triton.jit
def value_ptr(addr, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to a parameter/gradient from its int64 address: fp32, bf16 (as uint16 bits), fp16."""
    if KIND == F32:
        ptr = addr.to(tl.pointer_type(tl.float32))
    elif KIND == BF16:
        ptr = addr.to(tl.pointer_type(tl.uint16))
    else:
        ptr = addr.to(tl.pointer_type(tl.float16))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def codes_ptr_at(addr, ALIGNED: tl.constexpr):
    ptr = addr.to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def scales_ptr_at(addr, SBF16: tl.constexpr):
    if SBF16:  # one return: an early one makes Triton (3.6, 3.9) type both ("Return type mismatch")
        ptr = addr.to(tl.pointer_type(tl.uint16))
    else:
        ptr = addr.to(tl.pointer_type(tl.float32))
    return ptr


@triton.jit
def program_tiles(meta_ptr, prog_ptr, NC: tl.constexpr, B: tl.constexpr, ROWS: tl.constexpr,
                  TILES: tl.constexpr):
    """This program's tensor (its meta row), numel, first tile and number of tiles (<= TILES).
    A tile is ROWS quantization blocks; a program steps consecutive tiles of one tensor."""
    pid = tl.program_id(0)
    t = tl.load(prog_ptr + pid)
    meta = meta_ptr + t.to(tl.int64) * NC
    numel = tl.load(meta + NUMEL)
    tile0 = (pid - tl.load(meta + FIRST_PROGRAM)) * TILES
    # numel >= 0, divided as uint64: a shift for a power-of-two ROWS * B, without the signed
    # division's fix-up toward zero (3 instructions fewer per program with full_tiles's)
    ntiles = ((numel.to(tl.uint64) + ROWS * B - 1) // (ROWS * B)).to(tl.int32)
    return meta, numel, tile0, tl.minimum(ntiles - tile0, TILES)


@triton.jit
def tile_origin(numel, tile, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr):
    """row0 = first block of the tile, base = its first element (int64: tensors may exceed
    2**31 elements), rem = how many of its elements exist, full = all exist and B == BP."""
    row0 = tile.to(tl.int64) * ROWS
    base = row0 * B
    rem = tl.minimum(numel - base, ROWS * B).to(tl.int32)
    return row0, base, rem, (base + ROWS * B <= numel) & (BP == B)


@triton.jit
def full_tiles(numel, tile0, ntiles, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr):
    """How many of the program's tiles tile0 .. tile0 + ntiles - 1 are full (tile_origin's
    `full`): all but the tensor's short last tile, none if B < BP. A program steps them in
    one loop and the rest after it, so its loop over full tiles carries no masked path (nor
    its addresses)."""
    if BP != B:
        return tl.zeros_like(ntiles)
    return tl.minimum(ntiles, (numel.to(tl.uint64) // (ROWS * B)).to(tl.int32) - tile0)  # as program_tiles


@triton.jit
def track_nonfinite(seen, g):
    """max(seen, |g|), NaN-propagating: one instruction per element (FMNMX.NAN), and
    non-finite (count_nonfinite) iff some gradient element was NaN or Inf."""
    return tl.maximum(seen, tl.abs(g), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_nan(a, b):
    """max(a, b), NaN if either is NaN (a reduction's combine function: tl.reduce(x, axis, max_nan))."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def count_nonfinite(meta, seen, g_base, numel, tile0, ntiles, KIND: tl.constexpr, B: tl.constexpr,
                    BP: tl.constexpr, ROWS: tl.constexpr):
    """Add the program's count of NaN/Inf gradient elements to the tensor's int64 counter.
    seen: track_nonfinite over the program's tiles; only when it is NaN or Inf (rare) are
    the program's gradient tiles read again and their non-finite elements counted."""
    # a row's NaN-propagating max of seen is NaN or Inf iff one of its elements is, so it is
    # compared once per row, not per element (NaN < Inf is false); then an int max over rows
    # (a float max of the rows, compared once, made Triton 3.9's AdamW sr fp32 loop 2 longer)
    if tl.max(((tl.reduce(seen, 1, max_nan) < float("inf")) == 0).to(tl.int32), axis=0) > 0:
        n = tl.zeros([ROWS, BP], tl.int32)
        for i in range(0, ntiles):
            _, base, rem, _ = tile_origin(numel, tile0 + i, B, BP, ROWS)
            g = load_values(g_base + base, rem, KIND, B, BP, ROWS, True)
            n += (tl.abs(g) < float("inf")) == 0
        total = tl.sum(tl.sum(n, axis=1), axis=0)
        tl.atomic_add(tl.load(meta + NONFINITE).to(tl.pointer_type(tl.int64)), total.to(tl.int64))


@triton.jit
def tile(rem, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, C0: tl.constexpr = 0):
    """Element offsets [ROWS, BP] from the tile's first element, and which of them exist.
    C0 > 0: a part of the tile, columns C0 .. C0 + BP - 1 of each block (a thread holding
    several parts holds them from the same block row: its per-row work is done once)."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, BP) + C0
    loc = r[:, None] * B + c[None, :]
    return loc, (c[None, :] < B) & (loc < rem)


@triton.jit
def tile_bytes(rem, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, C0: tl.constexpr = 0):
    """Byte offsets [ROWS, BP/2] of packed 4-bit codes, and which bytes exist
    (byte j holds elements 2j (low nibble) and 2j+1 (high nibble)); C0 as tile()."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, BP // 2) + C0 // 2
    loc = r[:, None] * (B // 2) + c[None, :]
    return loc, (c[None, :] < B // 2) & (loc * 2 < rem)


# ---- parameters and gradients ---------------------------------------------------------------------
@triton.jit
def load_values(ptr, rem, KIND: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
                MASKED: tl.constexpr, C0: tl.constexpr = 0, ALIGNED: tl.constexpr = False):
    """[ROWS, BP] fp32 (exact widening; missing elements read 0). ALIGNED (ptr 4-byte
    aligned) and not MASKED: bf16 is read as 32-bit words of two elements, widened as
    w << 16 and w & 0xFFFF0000 (one instruction each; from 16-bit loads ptxas spends a
    PRMT and a shift on the odd element)."""
    loc, mask = tile(rem, B, BP, ROWS, C0)
    if KIND == BF16 and ALIGNED and not MASKED:
        r = tl.arange(0, ROWS)
        c = tl.arange(0, BP // 2) + C0 // 2
        w = tl.load(ptr.to(tl.pointer_type(tl.uint32)) + (r[:, None] * (B // 2) + c[None, :]))
        lo = w << 16
        hi = w & 0xFFFF0000
        return tl.reshape(tl.join(lo, hi), [ROWS, BP]).to(tl.float32, bitcast=True)
    if MASKED:
        x = tl.load(ptr + loc, mask=mask, other=0)
    else:
        x = tl.load(ptr + loc)
    if KIND == BF16:
        x = (x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def store_values(ptr, x, rem, KIND: tl.constexpr, INTERPRET: tl.constexpr, B: tl.constexpr,
                 BP: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr, C0: tl.constexpr = 0,
                 ALIGNED: tl.constexpr = False):
    """Write fp32 x as the tensor's dtype, rounding to nearest even as torch's copy_ does on
    the same device (bf16 on GPU: cvt.rn, NaN -> 0x7FFF; the interpreter's cast truncates,
    so there it is done with integer ops, NaN -> 0x7FC0 as torch's scalar CPU cast; its
    vectorized one gives 0xFFFF on x86, kernels/cpu.bf16_nan: a NaN parameter's bits differ
    from the CPU reference's under the interpreter). ALIGNED, bf16, a
    full tile, on the GPU: written as the 32-bit words load_values(..., ALIGNED) reads, each
    two elements rounded by one cvt.rn.bf16x2.f32 (the F2FP ptxas makes of two cvt.rn.bf16),
    through the same tensor of pointers as that load (one address and induction variable
    for both; from 16-bit stores LLVM kept a second one)."""
    if KIND == BF16 and ALIGNED and not MASKED and not INTERPRET:
        r = tl.arange(0, ROWS)
        c = tl.arange(0, BP // 2) + C0 // 2
        lo, hi = tl.split(tl.reshape(x, [ROWS, BP // 2, 2]))
        w = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.uint32,
                                      is_pure=True, pack=1)
        tl.store(ptr.to(tl.pointer_type(tl.uint32)) + (r[:, None] * (B // 2) + c[None, :]), w)
        return
    loc, mask = tile(rem, B, BP, ROWS, C0)
    if KIND == BF16:
        if INTERPRET:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            y = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)
        else:
            y = x.to(tl.bfloat16).to(tl.uint16, bitcast=True)
    elif KIND == F16:
        y = x.to(tl.float16)
    else:
        y = x
    if MASKED:
        tl.store(ptr + loc, y, mask=mask)
    else:
        tl.store(ptr + loc, y)


@triton.jit
def load_grad(ptr, rem, KIND: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
              MASKED: tl.constexpr, C0: tl.constexpr = 0, ALIGNED: tl.constexpr = False):
    """Gradient tile in fp32 with NaN/Inf elements set to 0, and the tile as loaded (for
    track_nonfinite)."""
    g = load_values(ptr, rem, KIND, B, BP, ROWS, MASKED, C0, ALIGNED)
    return tl.where(tl.abs(g) < float("inf"), g, 0.0), g

