"""The state codec in Triton: a quantized state's tile decoded to fp32 and encoded back
(quantizer.decode / quantizer.encode, with packing.unpack / pack), bit for bit.

A state of format FMT (common.Format) is stored per block of B elements as BITS-bit codes
(BITS / 8 bytes an element; 4-bit codes two a byte, memory.tile_bytes) and one block scale,
the block's absmax: fp32 (4 bytes) or, SBF16, rounded up to a bf16 value and stored as its
16 bits (2 bytes). With delta = absmax / top (common.step_of):

    decode   x_hat = value(q) * delta, squared if SQRT; value(q) = q (linear; two's complement
             if signed), table[q] (code book), (q + 1) / NT (no-zero map); BReD reads at
             ordinal q - d, d = u - 1/2 the block's dither of the step the codes were written
             at (linear: q - d; code books: interpolated between neighbouring entries)
    encode   x -> stored domain (non-finite -> 0, sqrt if SQRT, >= 0 unless signed), absmax
             per block (rounded up to bf16 if SBF16), n = x * top / absmax, and
             q = rint(n + d) (linear; d = 0 nearest, u - 1/2 per element SR or per block
             BReD, clamped to the top code), or the code book's floor k plus the rounding's
             step up (nearest: ties up; SR: u < frac; BReD: u >= 1 - frac)

    decode_state = loads + decode_codes        encode_state = encode_parts = stored_domain
                                               + encode_scaled (store_codes, store_scales)
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from .common import (BRED, INT_BASE, INT_BASE_BITS, LINEAR, NEAREST, NOZERO, STOCHASTIC, code_to_float,
                     inverse_step, nozero_entry, one_plus_uniform16, round_half_even, step_of, table_floor,
                     table_interp, uniform)
from .memory import tile, tile_bytes

# Triton's interpreter runs no PTX (set before the kernels are imported, as launch.interpreting)
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


# ---- the state codec -------------------------------------------------------------------------------
@triton.jit
def decode_state(codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT: tl.constexpr,
                 FRESH: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
                 MASKED: tl.constexpr, C0: tl.constexpr = 0):
    """The stored state of format FMT (a Format) as an fp32 [ROWS, BP] tile
    (quantizer.decode); zeros if FRESH (never written, or just reset). BReD subtracts the
    dither of the step it was written at (k1, k2 are that step's keys). C0: a part of the
    tile (tile()); the block scales and dithers are the same loads and hashes for every
    part, computed once."""
    if FRESH:
        return tl.zeros([ROWS, BP], tl.float32)
    r = tl.arange(0, ROWS)
    if FMT.BITS == 4:
        bloc, bmask = tile_bytes(rem, B, BP, ROWS, C0)
        if MASKED:
            byte = tl.load(codes_ptr + bloc, mask=bmask, other=0).to(tl.int32)
        else:
            byte = tl.load(codes_ptr + bloc).to(tl.int32)
        q = tl.reshape(tl.join(byte & 0xF, byte >> 4), [ROWS, BP])
    else:
        loc, mask = tile(rem, B, BP, ROWS, C0)
        if MASKED:
            q = tl.load(codes_ptr + loc, mask=mask, other=0).to(tl.int32)
        else:
            q = tl.load(codes_ptr + loc).to(tl.int32)
    if MASKED:
        s = tl.load(scales_ptr + r, mask=r * B < rem, other=0)
    else:
        s = tl.load(scales_ptr + r)
    if FMT.SBF16:
        absmax = (s.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        absmax = s
    return decode_codes(q, absmax, table_ptr, row0, k1, k2, FMT.KIND, FMT.BITS, FMT.SIGNED, FMT.TOP, FMT.NT,
                        FMT.ROUND, FMT.SQRT, ROWS)


@triton.jit
def decode_codes(q, absmax, table_ptr, row0, k1, k2, KIND: tl.constexpr, BITS: tl.constexpr,
                 SIGNED: tl.constexpr, TOP: tl.constexpr, NT: tl.constexpr, ROUND: tl.constexpr,
                 SQRT: tl.constexpr, ROWS: tl.constexpr):
    """fp32 values of int32 codes q [ROWS, W] as stored (unsigned, two's complement for
    signed linear formats; store_codes returns them) in blocks of the fp32 block absmax
    [ROWS] (quantizer.decode; decode_state's second half)."""
    r = tl.arange(0, ROWS)
    delta = step_of(absmax, TOP)
    if KIND == LINEAR:
        val = code_to_float(q, BITS, SIGNED)
        if ROUND == BRED:  # one dither per block: x_hat = (q - d) * delta, d = u - 1/2
            val = val - (uniform((row0 + r).to(tl.uint32), k1, k2) - 0.5)[:, None]
    elif ROUND == BRED:  # read at ordinal q - d as (k, f) = (q - 1, 1 - d) if d > 0 else (q, -d)
        d = uniform((row0 + r).to(tl.uint32), k1, k2) - 0.5
        pos = d > 0
        f = tl.where(pos, 1.0 - d, -d)
        if KIND == NOZERO:
            # formats.interp of a no-zero linear map: rn((k + 1) + f) / NT, k + 1 = q + [d <= 0]
            # an exact integer: as_float(2**23 | q) - (2**23 - [d <= 0]), both exact
            a = (q | INT_BASE_BITS).to(tl.float32, bitcast=True) - tl.where(pos, INT_BASE, INT_BASE - 1.0)[:, None]
            val = (a + f[:, None]) * (1.0 / NT)
        else:
            val = table_interp(table_ptr, tl.where(pos[:, None], q - 1, q), f[:, None], NT)
    elif KIND == NOZERO:
        val = nozero_entry(q, NT)
    else:
        val = tl.load(table_ptr + q)
    val = val * delta[:, None]
    if SQRT:
        val = val * val
    return val


@triton.jit
def stored_domain(x, rem, SIGNED: tl.constexpr, SQRT: tl.constexpr, PREPARED: tl.constexpr, B: tl.constexpr,
                  BP: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr, C0: tl.constexpr = 0):
    """x as stored before scaling: non-finite -> 0, sqrt / clamp at 0 unless PREPARED
    (already in the stored domain), and 0 beyond the tensor (the short last block)."""
    x = tl.where(tl.abs(x) < float("inf"), x, 0.0)  # non-finite values are stored as 0
    if PREPARED == 0:
        if SQRT:
            x = tl.sqrt_rn(tl.where(x < 0.0, 0.0, x))
        if SIGNED == 0:
            x = tl.where(x < 0.0, 0.0, x)
    if MASKED:
        _, mask = tile(rem, B, BP, ROWS, C0)
        x = tl.where(mask, x, 0.0)  # the short last block is zero padded
    return x


@triton.jit
def _up(frac, row0, k1, k2, ROUND: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
        C0: tl.constexpr):
    """1 where a value a fraction frac of the way from its lower grid point to the next is
    rounded up, else 0 (int32 [ROWS, BP]): stochastic, u < frac with u per element
    (one_plus_uniform16); BReD, d >= 1 - frac with d per block row (uniform)."""
    if ROUND == STOCHASTIC:
        u = one_plus_uniform16(row0, k1, k2, B, BP, ROWS, C0) - 1.0
        return (u < frac).to(tl.int32)
    d = uniform((row0 + tl.arange(0, ROWS)).to(tl.uint32), k1, k2)
    return (d[:, None] >= 1.0 - frac).to(tl.int32)


@triton.jit
def store_codes(x, inv, codes_ptr, table_ptr, rem, row0, k1, k2,
                KIND: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, TOP: tl.constexpr,
                NT: tl.constexpr, ROUND: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
                MASKED: tl.constexpr, C0: tl.constexpr = 0, G: tl.constexpr = 0):
    """Quantize x (stored domain) with n = x * inv (inv = top / absmax per row) and store the
    codes; returns them as int32 [ROWS, BP] (decode_codes reads them back; 0 beyond rem).
    G = 8 (4-bit codes of a full tile, codes_ptr 4-byte aligned, 8 columns a thread): stored
    as words of G codes (store_words); 0: bytes."""
    loc, mask = tile(rem, B, BP, ROWS, C0)
    r = tl.arange(0, ROWS)
    n = x * inv[:, None]  # one division per block row (inverse_step)
    if KIND == LINEAR:  # q = rint(n + d): d = 0 (nearest), u - 1/2 per element (SR) or per block (BReD)
        if ROUND == STOCHASTIC:
            n = n + (one_plus_uniform16(row0, k1, k2, B, BP, ROWS, C0) - 1.5)  # u - 1/2, exact
        elif ROUND == BRED:
            n = n + (uniform((row0 + r).to(tl.uint32), k1, k2) - 0.5)[:, None]
        _, q = round_half_even(n)
        # |n| <= top (1 + 3 ulp): n + d lies in [lowest code - 1/2, top + 1/2], so only the
        # top can be exceeded (by one code)
        if SIGNED:
            q = tl.minimum(q, (1 << (BITS - 1)) - 1) & ((1 << BITS) - 1)  # two's complement
        else:
            q = tl.minimum(q, (1 << BITS) - 1)
    elif KIND == NOZERO:
        # The code book {(j + 1) / NT} without it: t = n * NT (exact; n >= 0), fl = floor(t).
        # The table's k = clamp(fl - 1, 0, NT - 2) and frac = clamp(t - (k + 1), 0, 1) are
        # exact, and for 1 <= t < NT the rules below are the table's op for op
        # (frac = t - fl); for t < 1 the table gives 0 and these give -1 or 0, for t >= NT
        # it gives NT - 1 and these NT - 1 or NT: the final clamp makes them equal.
        t = n * NT
        # t >= 0, so floor is a truncating conversion (one F2I; at <= 2 per element the
        # 1/8-rate conversion pipe keeps pace, common.py docstring)
        if ROUND == NEAREST:  # ties up: q = floor(t + 1/2) - 1 (rn(t + 1/2) crosses no integer)
            q = (t + 0.5).to(tl.int32) - 1
        else:
            fl = t.to(tl.int32)  # (tl.floor would flush subnormals: cvt.rmi.ftz)
            frac = t - fl.to(tl.float32)  # exact
            q = fl - 1 + _up(frac, row0, k1, k2, ROUND, B, BP, ROWS, C0)
        q = tl.minimum(tl.maximum(q, 0), NT - 1)
    else:  # code book: k in [0, NT-2], so k + up needs no clamp
        k = table_floor(table_ptr, n, NT, BITS)
        lo = tl.load(table_ptr + k)
        step = tl.load(table_ptr + k + 1) - lo
        if ROUND == NEAREST:  # ties up, as torchao
            q = k + ((n - lo) >= step * 0.5).to(tl.int32)
        else:
            frac = tl.minimum(tl.maximum(tl.math.div_rn(n - lo, step), 0.0), 1.0)
            q = k + _up(frac, row0, k1, k2, ROUND, B, BP, ROWS, C0)
    if MASKED:
        q = tl.where(mask, q, 0)  # the high nibble after an odd tail stays 0
    if BITS == 4 and G > 0 and not MASKED:
        store_words(q, codes_ptr, B, BP, ROWS, C0, G)
    elif BITS == 4:
        bloc, bmask = tile_bytes(rem, B, BP, ROWS, C0)
        lo4, hi4 = tl.split(tl.reshape(q, [ROWS, BP // 2, 2]))
        byte = (lo4 | (hi4 << 4)).to(tl.uint8)
        if MASKED:
            tl.store(codes_ptr + bloc, byte, mask=bmask)
        else:
            tl.store(codes_ptr + bloc, byte)
    else:
        if MASKED:
            tl.store(codes_ptr + loc, q.to(tl.uint8), mask=mask)
        else:
            tl.store(codes_ptr + loc, q.to(tl.uint8))
    return q


# word = q0 + (q1 << 4) + ... + (q7 << 28) of eight codes in [0, 15] (nibbles never carry):
# bytes, then halves, then the word, one shift-and-add (LEA) each
_WORD8 = tl.constexpr("{ .reg .b32 t<4>; shl.b32 t0, $2, 4; add.u32 t0, t0, $1; shl.b32 t1, $4, 4; "
                      "add.u32 t1, t1, $3; shl.b32 t2, $6, 4; add.u32 t2, t2, $5; shl.b32 t3, $8, 4; "
                      "add.u32 t3, t3, $7; shl.b32 t1, t1, 8; add.u32 t0, t0, t1; shl.b32 t3, t3, 8; "
                      "add.u32 t2, t2, t3; shl.b32 t2, t2, 16; add.u32 $0, t0, t2; }")


@triton.jit
def _halves(x):
    """[R, N, K] -> elements 0, 2, 4, ... and 1, 3, 5, ... of the last axis (K even)."""
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2] // 2, 2]))


@triton.jit
def store_words(q, codes_ptr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, C0: tl.constexpr,
                G: tl.constexpr):
    """Store 4-bit codes q (int32 in [0, 15], [ROWS, BP]; columns C0 .. C0 + BP - 1) as uint32
    words of G = 8 codes, code k of a word at bits 4k .. 4k + 3: the bytes tile_bytes stores
    (element 2j in the low nibble of byte j), little-endian, one store per word, where
    nibbles.decode_words reads them. G must be the columns a thread holds (8: its 16 bytes
    of bf16 values), so a word is built in a thread's registers: on the GPU by _WORD8
    (inline PTX, seven shift-and-adds; from Triton's shifts and adds LLVM made masks and
    PRMTs, more instructions than the byte stores), in the interpreter by the same sum."""
    tl.static_assert(G == 8, "store_words packs 8 codes a word")
    r = tl.arange(0, ROWS)
    j = tl.arange(0, BP // G) + C0 // G
    loc = r[:, None] * (B // G) + j[None, :]
    ev, od = _halves(tl.reshape(q, [ROWS, BP // G, G]))  # codes 0, 2, .. and 1, 3, .. of each word
    e04, e26 = _halves(ev)
    q0, q4 = tl.split(e04)
    q2, q6 = tl.split(e26)
    o15, o37 = _halves(od)
    q1, q5 = tl.split(o15)
    q3, q7 = tl.split(o37)
    if _INTERPRET:
        w = (q0 + (q1 << 4) + (q2 << 8) + (q3 << 12) + (q4 << 16) + (q5 << 20) + (q6 << 24)).to(tl.uint32) \
            + (q7.to(tl.uint32) << 28)
    else:
        w = tl.inline_asm_elementwise(_WORD8, "=r,r,r,r,r,r,r,r,r", [q0, q1, q2, q3, q4, q5, q6, q7],
                                      dtype=tl.uint32, is_pure=True, pack=1)
    tl.store(codes_ptr.to(tl.pointer_type(tl.uint32)) + loc, w)


@triton.jit
def bf16_round_up(absmax):
    """The smallest bf16 value >= absmax (>= 0), in fp32 (quantizer.bf16_round_up)."""
    bits = absmax.to(tl.uint32, bitcast=True)
    down = bits & 0xFFFF0000
    return tl.where((bits & 0xFFFF) != 0, down + 0x10000, down).to(tl.float32, bitcast=True)


@triton.jit
def encode_parts(x0, x1, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT: tl.constexpr,
                 PREPARED: tl.constexpr, B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
                 MASKED: tl.constexpr, PARTS: tl.constexpr, G: tl.constexpr = 0):
    """Quantize a tile held as PARTS (1 or 2) parts of W columns (x0: columns 0..W-1, x1:
    W..2W-1; x1 is ignored when PARTS == 1) to format FMT (a Format) and store codes and
    block absmax (quantizer.encode); k1, k2 are the keys of this step. PREPARED: x is
    already in the stored domain (sqrt taken) and >= 0 where the format is unsigned or SQRT."""
    x0 = stored_domain(x0, rem, FMT.SIGNED, FMT.SQRT, PREPARED, B, W, ROWS, MASKED, 0)
    a = tl.abs(x0)
    if PARTS == 2:  # the parts' elementwise max first (finite, >= +0): one row reduction, not two
        x1 = stored_domain(x1, rem, FMT.SIGNED, FMT.SQRT, PREPARED, B, W, ROWS, MASKED, W)
        a = tl.maximum(a, tl.abs(x1))
    absmax = tl.max(a, axis=1)
    encode_scaled(x0, x1, absmax, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT, B, W, ROWS, MASKED,
                  PARTS, G)


@triton.jit
def encode_scaled(x0, x1, absmax, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT: tl.constexpr,
                  B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr, PARTS: tl.constexpr,
                  G: tl.constexpr = 0):
    """encode_parts after the block absmax [ROWS] of x0, x1 (in the stored domain): round
    it up to bf16 (SBF16), quantize and store codes and scales."""
    if FMT.SBF16:  # round the scale up to a bf16 value, so no element overflows the grid
        absmax = bf16_round_up(absmax)
    inv = inverse_step(absmax, FMT.TOP)
    store_codes(x0, inv, codes_ptr, table_ptr, rem, row0, k1, k2, FMT.KIND, FMT.BITS, FMT.SIGNED, FMT.TOP, FMT.NT,
                FMT.ROUND, B, W, ROWS, MASKED, 0, G)
    if PARTS == 2:
        store_codes(x1, inv, codes_ptr, table_ptr, rem, row0, k1, k2, FMT.KIND, FMT.BITS, FMT.SIGNED, FMT.TOP,
                    FMT.NT, FMT.ROUND, B, W, ROWS, MASKED, W, G)
    store_scales(scales_ptr, absmax, rem, FMT.SBF16, B, ROWS, MASKED)


@triton.jit
def store_scales(scales_ptr, absmax, rem, SBF16: tl.constexpr, B: tl.constexpr, ROWS: tl.constexpr,
                 MASKED: tl.constexpr):
    """Store the [ROWS] block absmax: fp32, or (SBF16) its top 16 bits, the bf16 it was
    rounded up to, as int16 bits.

    A full tile (compiled, not interpreted) stores it with one st.global per thread from the
    row reduction's layout, where each of the threads holding a block row holds its scale:
    they all write the same bits to the same address. tl.store would first move the vector
    to a layout with one thread per row (BAR, STS, BAR, LDS, then a predicated store). The
    address is the tensor of pointers the scales were loaded from (a pointer operand, so
    LLVM keeps one address for both; as ptrtoint it made a second induction variable), the
    fp32 scale passes as its int32 bits (Triton 3.6 refuses a pointer beside a float
    operand)."""
    r = tl.arange(0, ROWS)
    if SBF16:
        scale = (absmax.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        scale = absmax
    if MASKED:
        tl.store(scales_ptr + r, scale, mask=r * B < rem)
    elif _INTERPRET:
        tl.store(scales_ptr + r, scale)
    else:  # every thread holding a row stores its scale: no layout conversion
        addr = scales_ptr + r
        if SBF16:
            tl.inline_asm_elementwise("st.global.b16 [$1], $2; mov.b32 $0, 0;", "=r,l,h", [addr, scale],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("st.global.b32 [$1], $2; mov.b32 $0, 0;", "=r,l,r",
                                      [addr, scale.to(tl.int32, bitcast=True)],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def encode_state(x, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT: tl.constexpr,
                 PREPARED: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
                 MASKED: tl.constexpr):
    """Quantize the fp32 [ROWS, BP] tile x to format FMT (a Format) and store codes and
    block absmax (encode_parts)."""
    encode_parts(x, x, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT, PREPARED, B, BP, ROWS, MASKED, 1)
