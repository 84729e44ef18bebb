"""Decoding 4-bit codes of a full, aligned tile from the word that holds a thread's eight
(uint32; bf16 values) or four (uint16; fp32 values) codes, without moving each nibble down.

codes.decode_state extracts each code as an integer (a byte PRMT, a shift, a zero-extend)
and then turns it into a float with the 2**23 trick: as_float(q | bits(2**23)) - 2**23 = q.
The same trick works with the nibble where it lies: code k of the word sits at bits
4k .. 4k+3, and a float of exponent 23 - 4k has an ulp of 2**-4k there, so

    as_float((w & (0xF << 4k)) | bits(2**(23 - 4k))) - 2**(23 - 4k) = code k    (k <= 3)

exactly (w >> 16 serves codes 4..7 as 0..3): one LOP3 a code before the FADD that
decode_codes spends too (ptxas keeps the masks in registers it reloads, about one more
instruction a code: AdamW bf16 saves about one instruction per element in all). Every value
equals decode_codes's, op for op (the offsets subtracted are exact, the differences exact
by Sterbenz): signed linear codes (u ^ 8) - 8, the no-zero map's entries (k + 1) / NT,
BReD's no-zero ordinal k + [d <= 0].
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import codes as cd
from . import common as c


@triton.jit
def _code_value(src, KK: tl.constexpr, KIND: tl.constexpr, SIGNED: tl.constexpr, NT: tl.constexpr,
                ROUND: tl.constexpr, pos):
    """The float decode_codes computes from code q before the block step, for the code at
    bits 4*KK.. of src: linear q (two's complement if SIGNED), the no-zero entry
    (q + 1) / NT, or BReD's no-zero ordinal q + [d <= 0] (pos: d > 0 per row)."""
    M: tl.constexpr = 0xF << (4 * KK)
    if KIND == c.LINEAR:
        E: tl.constexpr = 23 - 4 * KK
        bits = (src & M) | ((127 + E) << 23)
        if SIGNED:  # (u ^ 8) - 8
            bits = ((src ^ (8 << (4 * KK))) & M) | ((127 + E) << 23)
            return bits.to(tl.float32, bitcast=True) - (2.0 ** E + 8.0)
        return bits.to(tl.float32, bitcast=True) - 2.0 ** E
    elif ROUND == c.BRED:  # q + [d <= 0] as an exact integer
        E2: tl.constexpr = 23 - 4 * KK
        a = ((src & M) | ((127 + E2) << 23)).to(tl.float32, bitcast=True)
        return a - tl.where(pos, 2.0 ** E2, 2.0 ** E2 - 1.0)[:, None]
    else:  # (q + 1) / NT: ulp 1 / NT at the code, minus (2**e - 1/NT)
        E3: tl.constexpr = 23 - 4 * KK - NT.bit_length() + 1
        a = ((src & M) | ((127 + E3) << 23)).to(tl.float32, bitcast=True)
        return a - (2.0 ** E3 - 1.0 / NT)


@triton.jit
def decode_words(codes_ptr, scales_ptr, row0, k1, k2,
                 KIND: tl.constexpr, SIGNED: tl.constexpr, TOP: tl.constexpr, NT: tl.constexpr,
                 ROUND: tl.constexpr, SQRT: tl.constexpr, SBF16: tl.constexpr,
                 B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, C0: tl.constexpr, G: tl.constexpr):
    """codes.decode_state of a full tile's part (columns C0 .. C0 + W - 1) of 4-bit linear
    or no-zero codes read as words of G = 8 (uint32) or 4 (uint16) codes, codes_ptr aligned
    to the word (module docstring). G = the columns a thread holds (its 16-byte vector of
    bf16 or fp32 values): each thread then reads one word per vector."""
    r = tl.arange(0, ROWS)
    j = tl.arange(0, W // G) + C0 // G
    loc = r[:, None] * (B // G) + j[None, :]
    if G == 8:
        w = tl.load(codes_ptr.to(tl.pointer_type(tl.uint32)) + loc)
    else:
        w = tl.load(codes_ptr.to(tl.pointer_type(tl.uint16)) + loc).to(tl.uint32)
    s = tl.load(scales_ptr + r)
    if SBF16:
        absmax = (s.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        absmax = s
    delta = c.step_of(absmax, TOP)
    pos = r < 0  # unused unless BReD
    d = 0.0
    f = 0.0
    if ROUND == c.BRED:
        d = c.uniform((row0 + r).to(tl.uint32), k1, k2) - 0.5
        pos = d > 0
        f = tl.where(pos, 1.0 - d, -d)
    v0 = _code_value(w, 0, KIND, SIGNED, NT, ROUND, pos)
    v1 = _code_value(w, 1, KIND, SIGNED, NT, ROUND, pos)
    v2 = _code_value(w, 2, KIND, SIGNED, NT, ROUND, pos)
    v3 = _code_value(w, 3, KIND, SIGNED, NT, ROUND, pos)
    if G == 8:
        hi = w >> 16
        v4 = _code_value(hi, 0, KIND, SIGNED, NT, ROUND, pos)
        v5 = _code_value(hi, 1, KIND, SIGNED, NT, ROUND, pos)
        v6 = _code_value(hi, 2, KIND, SIGNED, NT, ROUND, pos)
        v7 = _code_value(hi, 3, KIND, SIGNED, NT, ROUND, pos)
        # code k of word j at column G * j + k of [ROWS, W // G, 2, 2, 2] (the last index fastest)
        val = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    else:
        val = tl.join(tl.join(v0, v2), tl.join(v1, v3))
    val = tl.reshape(val, [ROWS, W])
    if KIND == c.LINEAR:
        if ROUND == c.BRED:  # x_hat = (q - d) * delta, one dither per block
            val = val - d[:, None]
    elif ROUND == c.BRED:  # rn((k + 1) + f) / NT
        val = (val + f[:, None]) * (1.0 / NT)
    val = val * delta[:, None]
    if SQRT:
        val = val * val
    return val


@triton.jit
def decode_state(codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT: tl.constexpr,
                 FRESH: tl.constexpr, B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
                 MASKED: tl.constexpr, C0: tl.constexpr, ALIGNED: tl.constexpr, G: tl.constexpr):
    """codes.decode_state, through decode_words where it applies (a full tile, aligned
    codes, 4-bit linear or no-zero codes; G: decode_words)."""
    if FMT.BITS == 4 and ALIGNED and not MASKED and not FRESH and FMT.KIND != c.TABLE:
        val = decode_words(codes_ptr, scales_ptr, row0, k1, k2, FMT.KIND, FMT.SIGNED, FMT.TOP, FMT.NT, FMT.ROUND,
                           FMT.SQRT, FMT.SBF16, B, W, ROWS, C0, G)
    else:
        val = cd.decode_state(codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT, FRESH, B, W, ROWS, MASKED, C0)
    return val
