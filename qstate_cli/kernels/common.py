"""Triton building blocks of the fused optimizer kernels: the hash, the state codec, casts.

Each helper reproduces one piece of the spec (qstate_cli/quant, optim/rules.py) bit for bit:

    hash32, stream_key, uniform     quant/hash.py: lowbias32, keys (seed, tensor, state, step),
                                    u = (bits >> 8) * 2**-24
    decode_state                    quant/quantizer.decode (+ packing.unpack)
    encode_state                    quant/quantizer.encode (+ packing.pack)
    load_values / store_values      torch's exact casts fp32 <-> bf16 (round to nearest even,
                                    done with integer ops: the interpreter's cast truncates)
    load_grad                       optim/base.py: a non-finite gradient element counts as 0

A program works on a tile of ROWS quantization blocks of one tensor, an fp32 tile of
[ROWS, BP] values, BP = the block size B rounded up to a power of two (columns >= B are
masked; only non-power-of-two blocks have them). `rem` is how many of the tile's elements
exist (the tensor's tail); with MASKED=False the whole tile exists and no mask is built.
Every division and square root is `div_rn` / `sqrt_rn`, and kernels are launched with
enable_fp_fusion=False, so no multiply-add is contracted into an FMA: fp32 results equal
torch's op for op.
"""
from __future__ import annotations

import triton
import triton.language as tl

# format kinds, rounding modes and value dtypes as the kernels see them (launch.py maps specs)
LINEAR = tl.constexpr(0)
TABLE = tl.constexpr(1)
NEAREST = tl.constexpr(0)
STOCHASTIC = tl.constexpr(1)
BRED = tl.constexpr(2)
F32 = tl.constexpr(0)
BF16 = tl.constexpr(1)
F16 = tl.constexpr(2)
# columns of the per-tensor address table (launch.META_COLUMNS)
PARAM, GRAD, M_CODES, M_SCALES, V_CODES, V_SCALES, NONFINITE, OUT, NUMEL, TENSOR_ID, FIRST_PROGRAM = (
    tl.constexpr(i) for i in range(11))


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
def stream_key(seed, tensor_id, STATE_ID: tl.constexpr):
    """k = hash32(hash32(hash32(seed) ^ tensor_id) ^ state_id); uint32 scalars."""
    k = hash32(seed)
    k = hash32(k ^ tensor_id)
    return hash32(k ^ STATE_ID)


@triton.jit
def uniform(counter, k, step):
    """U[0, 1) on the 2**-24 grid for uint32 counters of stream key k at `step`:
    k1 = hash32(k ^ step), k2 = hash32(k1 ^ 0x9e3779b9), bits = hash32(hash32(c ^ k1) ^ k2)."""
    k1 = hash32(k ^ step)
    k2 = hash32(k1 ^ 0x9E3779B9)
    bits = hash32(hash32(counter ^ k1) ^ k2)
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08


# ---- addresses --------------------------------------------------------------------------------
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
    if SBF16:
        return addr.to(tl.pointer_type(tl.uint16))
    return addr.to(tl.pointer_type(tl.float32))


@triton.jit
def program_tile(meta_ptr, prog_ptr, NC: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr):
    """Which tensor and which tile this program steps: (meta row, row0 = first quantization
    block, base = first element, rem = elements of the tile that exist, full = the whole
    tile exists and has no padding columns, so no mask is needed). Offsets are int64:
    tensors may exceed 2**31 elements."""
    pid = tl.program_id(0)
    t = tl.load(prog_ptr + pid)
    meta = meta_ptr + t.to(tl.int64) * NC
    numel = tl.load(meta + NUMEL)
    row0 = (pid - tl.load(meta + FIRST_PROGRAM)).to(tl.int64) * ROWS
    base = row0 * B
    rem = tl.minimum(numel - base, ROWS * B).to(tl.int32)
    return meta, row0, base, rem, (base + ROWS * B <= numel) & (BP == B)


@triton.jit
def count_nonfinite(meta, nonfinite):
    """Add this tile's count of NaN/Inf gradient elements to the tensor's int64 counter."""
    tl.atomic_add(tl.load(meta + NONFINITE).to(tl.pointer_type(tl.int64)), nonfinite.to(tl.int64),
                  mask=nonfinite > 0)


# ---- tile geometry ----------------------------------------------------------------------------
@triton.jit
def tile(rem, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr):
    """Element offsets [ROWS, BP] from the tile's first element, and which of them exist."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, BP)
    loc = r[:, None] * B + c[None, :]
    return loc, (c[None, :] < B) & (loc < rem)


@triton.jit
def tile_bytes(rem, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr):
    """Byte offsets [ROWS, BP/2] of packed 4-bit codes, and which bytes exist
    (byte j holds elements 2j (low nibble) and 2j+1 (high nibble))."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, BP // 2)
    loc = r[:, None] * (B // 2) + c[None, :]
    return loc, (c[None, :] < B // 2) & (loc * 2 < rem)


# ---- parameters and gradients ---------------------------------------------------------------------
@triton.jit
def load_values(ptr, rem, KIND: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
                MASKED: tl.constexpr):
    """[ROWS, BP] fp32 (exact widening; missing elements read 0)."""
    loc, mask = tile(rem, B, BP, ROWS)
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
def store_values(ptr, x, rem, KIND: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
                 MASKED: tl.constexpr):
    """Write fp32 x as the tensor's dtype, rounding to nearest even (torch's copy_)."""
    loc, mask = tile(rem, B, BP, ROWS)
    if KIND == BF16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        y = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)
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
              MASKED: tl.constexpr):
    """Gradient tile in fp32 with NaN/Inf elements set to 0, and how many there were."""
    g = load_values(ptr, rem, KIND, B, BP, ROWS, MASKED)
    finite = tl.abs(g) < float("inf")
    return tl.where(finite, g, 0.0), tl.sum((finite == 0).to(tl.int32))


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
    f = f + (k - kc).to(tl.float32)
    lo = tl.load(table_ptr + kc)
    hi = tl.load(table_ptr + kc + 1)
    return lo + f * (hi - lo)


# ---- the state codec -------------------------------------------------------------------------------
@triton.jit
def decode_state(codes_ptr, scales_ptr, table_ptr, rem, row0, key, written, fresh,
                 KIND: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, TOP: tl.constexpr,
                 NT: tl.constexpr, ROUND: tl.constexpr, SQRT: tl.constexpr, SBF16: tl.constexpr,
                 B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr):
    """The stored state as an fp32 [ROWS, BP] tile (quantizer.decode); 0 where `fresh`
    (never written, or just reset). BReD subtracts the dither replayed at step `written`."""
    r = tl.arange(0, ROWS)
    if BITS == 4:
        bloc, bmask = tile_bytes(rem, B, BP, ROWS)
        if MASKED:
            byte = tl.load(codes_ptr + bloc, mask=bmask, other=0)
        else:
            byte = tl.load(codes_ptr + bloc)
        q = tl.reshape(tl.join(byte & 0xF, byte >> 4), [ROWS, BP]).to(tl.int32)
    else:
        loc, mask = tile(rem, B, BP, ROWS)
        if MASKED:
            q = tl.load(codes_ptr + loc, mask=mask, other=0).to(tl.int32)
        else:
            q = tl.load(codes_ptr + loc).to(tl.int32)
    if KIND == LINEAR and SIGNED:
        q = (q ^ (1 << (BITS - 1))) - (1 << (BITS - 1))  # two's complement within BITS
    if MASKED:
        s = tl.load(scales_ptr + r, mask=r * B < rem, other=0)
    else:
        s = tl.load(scales_ptr + r)
    if SBF16:
        absmax = (s.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        absmax = s
    if TOP == 1.0:
        delta = absmax
    else:
        delta = tl.math.div_rn(absmax, TOP)
    if ROUND == BRED:
        d = uniform((row0 + r).to(tl.uint32), key, written) - 0.5  # one dither per block
        if KIND == LINEAR:
            val = q.to(tl.float32) - d[:, None]
        else:  # read at ordinal q - d as (k, f) = (q - 1, 1 - d) if d > 0 else (q, -d)
            pos = d > 0
            val = table_interp(table_ptr, tl.where(pos[:, None], q - 1, q),
                               tl.where(pos, 1.0 - d, -d)[:, None], NT)
    elif KIND == LINEAR:
        val = q.to(tl.float32)
    else:
        val = tl.load(table_ptr + q)
    val = val * delta[:, None]
    if SQRT:
        val = val * val
    return tl.where(fresh != 0, 0.0, val)


@triton.jit
def encode_state(x, codes_ptr, scales_ptr, table_ptr, rem, row0, key, step,
                 KIND: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, TOP: tl.constexpr,
                 NT: tl.constexpr, ROUND: tl.constexpr, SQRT: tl.constexpr, SBF16: tl.constexpr,
                 B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr):
    """Quantize the fp32 tile x and store codes and block absmax (quantizer.encode)."""
    loc, mask = tile(rem, B, BP, ROWS)
    r = tl.arange(0, ROWS)
    x = tl.where(tl.abs(x) < float("inf"), x, 0.0)  # non-finite values are stored as 0
    if SQRT:
        x = tl.sqrt_rn(tl.where(x < 0.0, 0.0, x))
    if SIGNED == 0:
        x = tl.where(x < 0.0, 0.0, x)
    if MASKED:
        x = tl.where(mask, x, 0.0)  # the short last block is zero padded
    absmax = tl.max(tl.abs(x), axis=1)
    if SBF16:  # round the scale up to a bf16 value, so no element overflows the grid
        bits = absmax.to(tl.uint32, bitcast=True)
        down = bits & 0xFFFF0000
        bits = tl.where((bits & 0xFFFF) != 0, down + 0x10000, down)
        absmax = bits.to(tl.float32, bitcast=True)
    if TOP == 1.0:
        delta = absmax
    else:
        delta = tl.math.div_rn(absmax, TOP)
    dpos = delta > 0
    divisor = tl.broadcast_to(tl.where(dpos, delta, 1.0)[:, None], [ROWS, BP])
    n = tl.where(dpos[:, None], tl.math.div_rn(x, divisor), 0.0)
    # floor ordinal k and position frac between k and k + 1
    if KIND == LINEAR:
        k = n.to(tl.int32)  # toward zero, then down: floor without tl.floor's flush-to-zero
        k = tl.where(k.to(tl.float32) > n, k - 1, k)  # (|n| <= 2**bits, so int32 is exact)
        frac = n - k.to(tl.float32)
        if ROUND == NEAREST:  # half to even
            up = (frac > 0.5) | ((frac == 0.5) & ((k & 1) == 1))
    else:
        k = table_floor(table_ptr, n, NT, BITS)
        lo = tl.load(table_ptr + k)
        hi = tl.load(table_ptr + k + 1)
        if ROUND == NEAREST:  # ties up, as torchao
            up = (n - lo) >= (hi - lo) * 0.5
        else:
            frac = tl.minimum(tl.maximum(tl.math.div_rn(n - lo, hi - lo), 0.0), 1.0)
    if ROUND == STOCHASTIC:  # one uniform per element: counter = flat element index
        u = uniform((row0 * B).to(tl.uint32) + loc.to(tl.uint32), key, step)
        up = u < frac
    elif ROUND == BRED:  # one uniform per block: q = round(n + u - 1/2)
        u = uniform((row0 + r).to(tl.uint32), key, step)
        up = u[:, None] >= 1.0 - frac
    q = k + up.to(tl.int32)
    if KIND == LINEAR:
        if SIGNED:
            q = tl.minimum(tl.maximum(q, -(1 << (BITS - 1))), (1 << (BITS - 1)) - 1)
            q = q & ((1 << BITS) - 1)
        else:
            q = tl.minimum(tl.maximum(q, 0), (1 << BITS) - 1)
    else:
        q = tl.minimum(tl.maximum(q, 0), NT - 1)
    if MASKED:
        q = tl.where(mask, q, 0)  # the high nibble after an odd tail stays 0
    if BITS == 4:
        bloc, bmask = tile_bytes(rem, B, BP, ROWS)
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
    if SBF16:
        scale = (absmax.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
    else:
        scale = absmax
    if MASKED:
        tl.store(scales_ptr + r, scale, mask=r * B < rem)
    else:
        tl.store(scales_ptr + r, scale)
