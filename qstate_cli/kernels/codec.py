"""Fused state codec: quantize a flat fp32 vector and read it back, in one pass.

For every quantization block of x the kernel writes the packed codes, the block scale and
the value read back, decode(encode(x)), computed from the codes still in registers: what
quant.encode then quant.decode give, bit for bit (the replay's QuantizedState.encode and
decode, diagnose/codec_triton.py). One launch covers the whole vector; a program works on
one tile of ROWS blocks (launch.tile_shape with one 16-byte vector per thread).

Bytes moved per element: 4 (x) + 4 (value read back) + bits/8 (codes) + 12 / B (the fp32
block scale, and the block's stream key and counter base, two int32)
    4-bit, B=128: 8.59 B/elem;  8-bit, B=256: 9.05 B/elem
(the reference's encode + decode: 40-60 torch ops, each a pass over memory).

Random bits. x may hold blocks of several tensors, and a tensor's blocks need not be
consecutive (the replay's layout: sampled trace blocks, padded segments). Block b carries
its own stream: key[b] = launch.stream_key(seed, tensor id, state id) of its tensor and
ctr[b], the counter of its first element in its own tensor:
    BReD        ctr[b] = (flat index of the block's first element) / B, one dither per block:
                u = uniform(ctr[b]) with the keys k1, k2 = step_keys(key[b], step)
    stochastic  ctr[b] = (flat index of the block's first element) >> 1 (even): element j
                of the block takes half (j & 1) of hash counter ctr[b] + (j >> 1)
    nearest     unused
The common.py helpers hash counters of the vector's own blocks and pairs (row0 + r,
row0 * B/2 + ...); handing them k1' = k1 ^ (own counter) ^ (tensor counter) per block or
pair makes them hash exactly the tensor's counter (x ^ x = 0), the trick of
diagnose/layout.LayoutStream. Elements that are padding (no element of any tensor) must
hold 0: a zero's code then depends on no random bits but the block's dither, except under
stochastic rounding of a code book without a code for 0 (de4nz, de8nz), where the replay
keeps the reference (diagnose/codec_triton.zero_takes_bits).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import codes as cd
from . import common as c
from . import memory as mem
from .launch import LAUNCH_OPTIONS, StateLayout, as_int32, tile_shape


@triton.jit
def _block_keys(key_ptr, ctr_ptr, rem, row0, step, ROUND: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
                ROWS: tl.constexpr, MASKED: tl.constexpr):
    """(k1', k2') to hand common.py's hashes so they draw each tensor's own bits (module
    docstring): [ROWS] per block (BReD), [ROWS, BP/2] per pair with k2 [ROWS, 1] (stochastic)."""
    r = tl.arange(0, ROWS)
    if MASKED:
        key = tl.load(key_ptr + r, mask=r * B < rem, other=0)
        ctr = tl.load(ctr_ptr + r, mask=r * B < rem, other=0)
    else:
        key = tl.load(key_ptr + r)
        ctr = tl.load(ctr_ptr + r)
    k1, k2 = c.step_keys(key.to(tl.uint32, bitcast=True), step)
    ctr = ctr.to(tl.uint32, bitcast=True)
    if ROUND == c.STOCHASTIC:
        # the pair counter one_plus_uniform16 hashes, folded into the tensor's: ctr + j/2
        j = tl.arange(0, BP // 2)
        own = (row0 * (B // 2)).to(tl.uint32) + (r[:, None] * (B // 2) + j[None, :]).to(tl.uint32)
        k1 = k1[:, None] ^ own ^ (ctr[:, None] + j[None, :].to(tl.uint32))
        k2 = k2[:, None]
    else:  # the block counter row0 + r the BReD dither hashes, folded into the tensor's
        k1 = k1 ^ (row0 + r).to(tl.uint32) ^ ctr
    return k1, k2  # (one return: the compiler wants one type per function)


@triton.jit
def _codec_tile(x_ptr, out_ptr, codes_ptr, scales_ptr, table_ptr, key_ptr, ctr_ptr, rem, row0, step,
                INTERPRET: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr,
                TOP: tl.constexpr, NT: tl.constexpr, ROUND: tl.constexpr, SQRT: tl.constexpr,
                SBF16: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
                MASKED: tl.constexpr):
    if ROUND == c.NEAREST:  # no random bits
        k1 = 0
        k2 = 0
    else:
        k1, k2 = _block_keys(key_ptr, ctr_ptr, rem, row0, step, ROUND, B, BP, ROWS, MASKED)
    x = mem.load_values(x_ptr, rem, c.F32, B, BP, ROWS, MASKED)
    x = cd.stored_domain(x, rem, SIGNED, SQRT, 0, B, BP, ROWS, MASKED)
    absmax = tl.max(tl.abs(x), axis=1)
    if SBF16:  # rounded up to a bf16 value (exact in the stored bf16)
        absmax = cd.bf16_round_up(absmax)
    q = cd.store_codes(x, c.inverse_step(absmax, TOP), codes_ptr, table_ptr, rem, row0, k1, k2, KIND, BITS,
                      SIGNED, TOP, NT, ROUND, B, BP, ROWS, MASKED)
    cd.store_scales(scales_ptr, absmax, rem, SBF16, B, ROWS, MASKED)
    val = cd.decode_codes(q, absmax, table_ptr, row0, k1, k2, KIND, BITS, SIGNED, TOP, NT, ROUND, SQRT, ROWS)
    mem.store_values(out_ptr, val, rem, c.F32, INTERPRET, B, BP, ROWS, MASKED)


@triton.jit(do_not_specialize=["step"])
def _codec_kernel(
    x_ptr,  # fp32 [numel]: the values to store
    out_ptr,  # fp32 [numel]: the values read back (written)
    codes_ptr,  # uint8 [numel * BITS / 8]: packed codes (written)
    scales_ptr,  # fp32, or int16 holding bf16 bits, [numel / B]: block absmax (written)
    table_ptr,  # fp32 code book (table formats only)
    key_ptr,  # int32 [numel / B]: stream key of each block's tensor (uint32 bits; unused when nearest)
    ctr_ptr,  # int32 [numel / B]: counter base of each block in its tensor (module docstring)
    numel,  # elements of x (a multiple of B)
    step,  # int32 bit pattern of the uint32 optimizer step the codes are written at
    INTERPRET: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr,
    TOP: tl.constexpr, NT: tl.constexpr, ROUND: tl.constexpr, SQRT: tl.constexpr, SBF16: tl.constexpr,
    B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
):
    row0, base, rem, full = mem.tile_origin(numel, tl.program_id(0), B, BP, ROWS)
    step = step.to(tl.uint32, bitcast=True)
    x_p, out_p = x_ptr + base, out_ptr + base
    codes_p, scales_p = codes_ptr + base * BITS // 8, scales_ptr + row0
    key_p, ctr_p = key_ptr + row0, ctr_ptr + row0
    if full:  # every element of the tile exists: no masks
        _codec_tile(x_p, out_p, codes_p, scales_p, table_ptr, key_p, ctr_p, rem, row0, step, INTERPRET, KIND,
                    BITS, SIGNED, TOP, NT, ROUND, SQRT, SBF16, B, BP, ROWS, False)
    else:
        _codec_tile(x_p, out_p, codes_p, scales_p, table_ptr, key_p, ctr_p, rem, row0, step, INTERPRET, KIND,
                    BITS, SIGNED, TOP, NT, ROUND, SQRT, SBF16, B, BP, ROWS, True)


def geometry(block: int) -> tuple[int, int, int]:
    """(BP, ROWS, num_warps): one 16-byte fp32 vector per thread (launch.tile_shape)."""
    return tile_shape(block, 4, parts=1)


def encode_decode(x, out, codes, scales, keys, counters, lay: StateLayout, step: int, *, interpret: bool,
                  table=None) -> None:
    """Launch the codec over flat fp32 x (numel a multiple of lay.block): codes, scales and
    out (the value read back) are written in place; keys / counters: int32 per block."""
    bp, rows, warps = geometry(lay.block)
    numel = x.numel()
    if numel == 0:
        return
    grid = (triton.cdiv(numel // lay.block, rows),)
    _codec_kernel[grid](
        x, out, codes, scales, table if table is not None else x, keys, counters, numel, as_int32(step),
        INTERPRET=int(interpret), KIND=lay.kind, BITS=lay.bits, SIGNED=int(lay.signed), TOP=lay.top,
        NT=lay.table_len, ROUND=lay.rounding, SQRT=int(lay.sqrt), SBF16=int(lay.sbf16),
        B=lay.block, BP=bp, ROWS=rows, num_warps=warps, **LAUNCH_OPTIONS)
