"""Triton building blocks of the fused optimizer kernels: the hash, the state codec, casts.

Each helper reproduces one piece of the spec (qstate_cli/quant, optim/rules.py) bit for bit:

    hash32, step_keys, uniform      quant/hash.py: lowbias32; per-step keys k1, k2 of a stream
                                    key (computed on the host: launch.stream_key);
                                    u = (bits >> 8) * 2**-24 (per block)
    one_plus_uniform16              1 + hash.uniform16 (per element, one hash per pair)
    decode_state                    quant/quantizer.decode (+ packing.unpack)
    encode_state                    quant/quantizer.encode (+ packing.pack)
    load_values / store_values      torch's exact casts fp32 <-> bf16/fp16
    load_grad                       optim/base.py: a non-finite gradient element counts as 0

A program works on tiles of ROWS quantization blocks of one tensor, fp32 tiles of
[ROWS, BP] values, BP = the block size B rounded up to a power of two (columns >= B are
masked; only non-power-of-two blocks have them). `rem` is how many of the tile's elements
exist (the tensor's tail); with MASKED=False the whole tile exists and no mask is built.

Rounding: every division and square root is `div_rn` / `sqrt_rn`, and kernels are
launched with enable_fp_fusion=False (no FMA contraction): fp32 results equal torch's,
op for op. Throughput (H100/H200 issue 8x fewer int<->float conversions and MUFU ops
than fp32 adds per clock): codes become floats and back without conversion instructions,
by the 1.5 * 2**23 trick (adding it rounds |n| < 2**22 to an integer held in the low
mantissa bits), and the only per-element MUFU ops are AdamW's sqrt and division.
"""
from __future__ import annotations

from collections import namedtuple

import triton
import triton.language as tl

from . import fastmath as fm

# format kinds, rounding modes and value dtypes as the kernels see them (launch.py maps specs)
LINEAR = tl.constexpr(0)
TABLE = tl.constexpr(1)
NOZERO = tl.constexpr(2)  # the table {(j + 1) / NT}, j < NT (lin4nz, lin8nz): entries computed, not loaded
NEAREST = tl.constexpr(0)
STOCHASTIC = tl.constexpr(1)
BRED = tl.constexpr(2)
F32 = tl.constexpr(0)
BF16 = tl.constexpr(1)
F16 = tl.constexpr(2)
# a state's format as the codec's compile-time constants (launch.StateLayout.constexprs, in order):
# bound in a kernel as `M: tl.constexpr = Format(M_KIND, ...)` (a plain `m = ...` makes tensors of
# them), passed whole, read by field (FMT.KIND, FMT.BITS, ...)
Format = namedtuple("Format", ["KIND", "BITS", "SIGNED", "TOP", "NT", "ROUND", "SQRT", "SBF16"])
# columns of the per-tensor address table (launch.META_COLUMNS)
(PARAM, GRAD, M_CODES, M_SCALES, V_CODES, V_SCALES, NONFINITE, OUT, NUMEL, TENSOR_ID, FIRST_PROGRAM,
 M_KEY, V_KEY) = (tl.constexpr(i) for i in range(13))
MIN_STEP = tl.constexpr(1.1754943508222875e-38)  # 2**-126: blocks with smaller steps read 0 (quantizer.step_of)
MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
MAGIC_BITS = tl.constexpr(0x4B400000)
INT_BASE = tl.constexpr(8388608.0)  # 2**23: as_float(0x4B000000 | c) - 2**23 == c for 0 <= c < 2**23
INT_BASE_BITS = tl.constexpr(0x4B000000)


# ---- the hash (quant/hash.py) ---------------------------------------------------------------
@triton.jit
def hash32(x):
    """lowbias32 on uint32 (multiplies wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def step_keys(key, step):
    """k1 = hash32(key ^ step), k2 = hash32(k1 ^ 0x9e3779b9) for a stream key and a step."""
    k1 = hash32(key ^ step)
    return k1, hash32(k1 ^ 0x9E3779B9)


@triton.jit
def uniform(counter, k1, k2):
    """U[0, 1) on the 2**-24 grid: (hash32(hash32(c ^ k1) ^ k2) >> 8) * 2**-24."""
    bits = hash32(hash32(counter ^ k1) ^ k2)
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def one_plus_uniform16(row0, k1, k2, B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, C0: tl.constexpr = 0):
    """1 + u for every element of a [ROWS, W] tile part (tile()), u = quant/hash.uniform16 of
    its flat index i: one hash per pair (i even, i + 1), 16 bits each, put into the mantissa
    of 1.0 (exact; the caller subtracts 1 or 3/2 instead of converting)."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, W // 2) + C0 // 2
    pair = (row0 * (B // 2)).to(tl.uint32) + (r[:, None] * (B // 2) + c[None, :]).to(tl.uint32)
    bits = hash32(hash32(pair ^ k1) ^ k2)
    lo = ((bits << 7) & 0x7FFF80) | 0x3F800000  # even i: bits 0..15
    hi = ((bits >> 9) & 0x7FFF80) | 0x3F800000  # odd i: bits 16..31
    return tl.reshape(tl.join(lo, hi), [ROWS, W]).to(tl.float32, bitcast=True)


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
    ntiles = ((numel + ROWS * B - 1) // (ROWS * B)).to(tl.int32)
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
def track_nonfinite(seen, g):
    """max(seen, |g|), NaN-propagating: one instruction per element (FMNMX.NAN), and
    non-finite (count_nonfinite) iff some gradient element was NaN or Inf."""
    return tl.maximum(seen, tl.abs(g), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def count_nonfinite(meta, seen, g_base, numel, tile0, ntiles, KIND: tl.constexpr, B: tl.constexpr,
                    BP: tl.constexpr, ROWS: tl.constexpr):
    """Add the program's count of NaN/Inf gradient elements to the tensor's int64 counter.
    seen: track_nonfinite over the program's tiles; only when it is NaN or Inf (rare) are
    the program's gradient tiles read again and their non-finite elements counted."""
    if tl.max(tl.max(((seen < float("inf")) == 0).to(tl.int32), axis=1), axis=0) > 0:
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
                 BP: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr, C0: tl.constexpr = 0):
    """Write fp32 x as the tensor's dtype, rounding to nearest even as torch's copy_ does on
    the same device (bf16 on GPU: cvt.rn, NaN -> 0x7FFF; the interpreter's cast truncates,
    so there it is done with integer ops, NaN -> 0x7FC0 as torch on CPU)."""
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


# ---- integer <-> float without conversion instructions --------------------------------------------
@triton.jit
def code_to_float(u, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """The integer value of an unsigned BITS-bit code u (two's complement if SIGNED), as fp32."""
    if SIGNED:  # (u ^ half) - half, half = 2**(BITS-1)
        return ((u ^ (1 << (BITS - 1))) | INT_BASE_BITS).to(tl.float32, bitcast=True) - (INT_BASE + (1 << (BITS - 1)))
    return (u | INT_BASE_BITS).to(tl.float32, bitcast=True) - INT_BASE


@triton.jit
def round_half_even(n):
    """(r, int32 r): n rounded to the nearest integer, ties to even (|n| < 2**22)."""
    t = n + MAGIC
    return t - MAGIC, t.to(tl.int32, bitcast=True) - MAGIC_BITS


@triton.jit
def nozero_entry(k, NT: tl.constexpr):
    """Entry k of the no-zero linear map, (k + 1) / NT, exactly: the float 2**e + (k + 1) / NT
    with e = 23 - log2(NT) (whose ulp is 1 / NT) built from its bits, minus 2**e."""
    E: tl.constexpr = 23 - NT.bit_length() + 1
    return ((k + 1) | ((127 + E) << 23)).to(tl.float32, bitcast=True) - (2.0 ** E)


@triton.jit
def step_of(absmax, TOP: tl.constexpr):
    """delta = absmax / top, 0 where absmax < top * 2**-126 (quantizer.step_of)."""
    if TOP == 1.0:
        delta = absmax
    else:  # rn(absmax / TOP) where it is used (fastmath: Markstein's correction)
        delta = fm.div_top(absmax, TOP)
    return tl.where(absmax >= TOP * MIN_STEP, delta, 0.0)


@triton.jit
def inverse_step(absmax, TOP: tl.constexpr):
    """top / absmax, 0 where absmax < top * 2**-126 (quantizer.normalize): n = x * this."""
    ok = absmax >= TOP * MIN_STEP
    return tl.where(ok, tl.math.div_rn(tl.full(absmax.shape, TOP, tl.float32), tl.where(ok, absmax, 1.0)), 0.0)


# ---- code books ---------------------------------------------------------------------------------
@triton.jit
def table_floor(table_ptr, n, NT: tl.constexpr, LOG: tl.constexpr):
    """clamp(#(table <= n) - 1, 0, NT - 2) by binary search (NT <= 2**LOG entries, sorted)."""
    pos = tl.zeros(n.shape, tl.int32)
    for i in tl.static_range(LOG):
        cand = pos + (1 << (LOG - 1 - i))
        ok = cand <= NT - 1
        t = tl.load(table_ptr + tl.where(ok, cand - 1, 0))
        pos = tl.where(ok & (t <= n), cand, pos)
    return tl.maximum(pos - 1, 0)


@triton.jit
def table_interp(table_ptr, k, f, NT: tl.constexpr):
    """Value at fractional ordinal k + f, linear between neighbours, extrapolated at the ends
    (formats.Format.interp: kc = clamp(k, 0, NT-2); f += k - kc; lo + f * (hi - lo))."""
    kc = tl.minimum(tl.maximum(k, 0), NT - 2)
    f = f + tl.where(k < kc, -1.0, tl.where(k > kc, 1.0, 0.0))  # k - kc is -1, 0 or 1 here
    lo = tl.load(table_ptr + kc)
    hi = tl.load(table_ptr + kc + 1)
    return lo + f * (hi - lo)


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
def store_codes(x, inv, codes_ptr, table_ptr, rem, row0, k1, k2,
                KIND: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, TOP: tl.constexpr,
                NT: tl.constexpr, ROUND: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
                MASKED: tl.constexpr, C0: tl.constexpr = 0):
    """Quantize x (stored domain) with n = x * inv (inv = top / absmax per row) and store the
    codes; returns them as int32 [ROWS, BP] (decode_codes reads them back; 0 beyond rem)."""
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
            q = fl - 1
            if ROUND == STOCHASTIC:
                u = one_plus_uniform16(row0, k1, k2, B, BP, ROWS, C0) - 1.0
                q = q + (u < frac).to(tl.int32)
            else:
                u = uniform((row0 + r).to(tl.uint32), k1, k2)
                q = q + (u[:, None] >= 1.0 - frac).to(tl.int32)
        q = tl.minimum(tl.maximum(q, 0), NT - 1)
    else:  # code book: k in [0, NT-2], so k + up needs no clamp
        k = table_floor(table_ptr, n, NT, BITS)
        lo = tl.load(table_ptr + k)
        step = tl.load(table_ptr + k + 1) - lo
        if ROUND == NEAREST:  # ties up, as torchao
            q = k + ((n - lo) >= step * 0.5).to(tl.int32)
        else:
            frac = tl.minimum(tl.maximum(tl.math.div_rn(n - lo, step), 0.0), 1.0)
            if ROUND == STOCHASTIC:
                u = one_plus_uniform16(row0, k1, k2, B, BP, ROWS, C0) - 1.0
                q = k + (u < frac).to(tl.int32)
            else:
                u = uniform((row0 + r).to(tl.uint32), k1, k2)
                q = k + (u[:, None] >= 1.0 - frac).to(tl.int32)
    if MASKED:
        q = tl.where(mask, q, 0)  # the high nibble after an odd tail stays 0
    if BITS == 4:
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


@triton.jit
def bf16_round_up(absmax):
    """The smallest bf16 value >= absmax (>= 0), in fp32 (quantizer.bf16_round_up)."""
    bits = absmax.to(tl.uint32, bitcast=True)
    down = bits & 0xFFFF0000
    return tl.where((bits & 0xFFFF) != 0, down + 0x10000, down).to(tl.float32, bitcast=True)


@triton.jit
def encode_parts(x0, x1, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT: tl.constexpr,
                 PREPARED: tl.constexpr, B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
                 MASKED: tl.constexpr, PARTS: tl.constexpr):
    """Quantize a tile held as PARTS (1 or 2) parts of W columns (x0: columns 0..W-1, x1:
    W..2W-1; x1 is ignored when PARTS == 1) to format FMT (a Format) and store codes and
    block absmax (quantizer.encode); k1, k2 are the keys of this step. PREPARED: x is
    already in the stored domain (sqrt taken) and >= 0 where the format is unsigned or SQRT."""
    x0 = stored_domain(x0, rem, FMT.SIGNED, FMT.SQRT, PREPARED, B, W, ROWS, MASKED, 0)
    absmax = tl.max(tl.abs(x0), axis=1)
    if PARTS == 2:
        x1 = stored_domain(x1, rem, FMT.SIGNED, FMT.SQRT, PREPARED, B, W, ROWS, MASKED, W)
        absmax = tl.maximum(absmax, tl.max(tl.abs(x1), axis=1))
    encode_scaled(x0, x1, absmax, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT, B, W, ROWS, MASKED,
                  PARTS)


@triton.jit
def encode_scaled(x0, x1, absmax, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT: tl.constexpr,
                  B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr, PARTS: tl.constexpr):
    """encode_parts after the block absmax [ROWS] of x0, x1 (in the stored domain): round
    it up to bf16 (SBF16), quantize and store codes and scales."""
    if FMT.SBF16:  # round the scale up to a bf16 value, so no element overflows the grid
        absmax = bf16_round_up(absmax)
    inv = inverse_step(absmax, FMT.TOP)
    store_codes(x0, inv, codes_ptr, table_ptr, rem, row0, k1, k2, FMT.KIND, FMT.BITS, FMT.SIGNED, FMT.TOP, FMT.NT,
                FMT.ROUND, B, W, ROWS, MASKED, 0)
    if PARTS == 2:
        store_codes(x1, inv, codes_ptr, table_ptr, rem, row0, k1, k2, FMT.KIND, FMT.BITS, FMT.SIGNED, FMT.TOP,
                    FMT.NT, FMT.ROUND, B, W, ROWS, MASKED, W)
    store_scales(scales_ptr, absmax, rem, FMT.SBF16, B, ROWS, MASKED)


@triton.jit
def store_scales(scales_ptr, absmax, rem, SBF16: tl.constexpr, B: tl.constexpr, ROWS: tl.constexpr,
                 MASKED: tl.constexpr):
    """Store the [ROWS] block absmax: fp32, or (SBF16) its top 16 bits, the bf16 it was
    rounded up to, as int16 bits."""
    r = tl.arange(0, ROWS)
    if SBF16:
        scale = (absmax.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        scale = absmax
    if MASKED:
        tl.store(scales_ptr + r, scale, mask=r * B < rem)
    else:
        tl.store(scales_ptr + r, scale)


@triton.jit
def encode_state(x, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT: tl.constexpr,
                 PREPARED: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
                 MASKED: tl.constexpr):
    """Quantize the fp32 [ROWS, BP] tile x to format FMT (a Format) and store codes and
    block absmax (encode_parts)."""
    encode_parts(x, x, codes_ptr, scales_ptr, table_ptr, rem, row0, k1, k2, FMT, PREPARED, B, BP, ROWS, MASKED, 1)
