"""numba building blocks of the CPU path: the hash, value casts, the block codec (bit casts
and arrays without reference counts: native.py).

Each helper reproduces one piece of the spec (qstate_cli/quant, optim/rules.py) bit for bit,
as kernels/common.py, memory.py and codes.py do in Triton:

    hash32, uniform, uniform16  quant/hash.py (uint32 arithmetic; uniform_bits: uniform16 of a block)
    value_at / store_value      torch's exact casts fp32 <-> bf16 (round half to even, NaN -> torch's: BF16_NAN)
    decode_value                quant/quantizer.decode of one code (decode_params: the block's)
    decode_block                quant/quantizer.decode (+ packing.unpack) of one block
    read_state                  decode_block with its scale, or zeros for a fresh state
    encode_block                quant/quantizer.encode (+ packing.pack) of one block
    encode_with_absmax          the same, the absmax computed by the caller (AdamW: in its update loop;
                                absmax_bits: the absmax loop of the others)

A block is B consecutive elements (the short last block has fewer); its codes start at byte
start * bits / 8 (B is even, so a 4-bit block starts on a byte), its scale is scales[b].
Codes go through an int32 scratch row so that the per-element loops are branch-free (AdamW's
4-bit linear states skip it: pairs.py rounds two elements into one code byte).

fp32 semantics: numba compiles with fastmath off, so every +, *, / and sqrt is one correctly
rounded IEEE fp32 op and LLVM contracts nothing into an FMA; every constant and
hyper-parameter is an np.float32 (a Python float would promote the arithmetic to float64).
error_model="numpy": a division by zero is IEEE (inf/nan) instead of a raised
ZeroDivisionError, so no division carries a check and the loops vectorize (no divisor
here can be zero: eps > 0, guarded block scales, distinct neighbouring codes).

A state layout is a tuple and two arrays (`layout_arrays` in host.py):
    lay  ints (KIND, BITS, SIGNED, NT, ROUND, SQRT, SBF16, UNIT, SHIFT, NM, STEPS, OFF)
         (launch.StateLayout; KIND LINEAR, TABLE or FLOAT, a minifloat whose MAN, EMIN, MAXORD
         take the last columns; UNIT = 2**bits for a code book that is exactly
         {1, 2, ..., 2**bits} / 2**bits (lin4nz, lin8nz), where #(table <= n) =
         clamp(floor(n * UNIT), 0, NT) exactly (n * UNIT is an exact power-of-two scaling);
         else 0 and search.py's floor code, whose constants are the last 4)
    lim  fp32  [TOP, TOP * 2**-126]                          (quantizer.step_of / normalize)
    table  fp32: the code book (padded with +inf), then its search buckets (host.search_table)
The kernels (adamw.py, ...) are built per layout (`specialized`): lay is a closure constant
of the compiled kernel, as the Triton kernels' tl.constexpr, so every `lay[...]` branch below
is resolved at compile time and each per-element loop is straight-line code that LLVM packs
into vectors (512-bit on an AVX-512 host: native.wide_features; 256-bit on AVX2). Loops index
with unsigned integers (`a[np.uint64(start) + np.uint64(j)]`): numba
adds no negative-index wraparound select to an unsigned index, so loads and stores stay
contiguous (slices would do the same but cost two atomic reference counts each per block).
"""
from __future__ import annotations

import warnings

import numba
import numpy as np
from numba import njit, types
from numba.extending import overload

from . import bf16_nan, cache_in_use, compiling, locator
from .native import bits_of_f32, f32_from_bits, sar32, shl32, shr32, wide_features

# Every kernel module imports this one before it compiles anything: point numba's disk
# cache at a folder per source version (package docstring: an inlined helper's change
# does not invalidate its callers' cached code), where any checkout of these sources finds
# the kernels (locator.py); versions unused for 30 days are removed.
numba.config.CACHE_DIR = str(cache_in_use())
locator.install()
compiling.install()  # each compilation's seconds and the first one's notice (runtime.COMPILES)
# and compile for 512-bit vectors on an AVX-512 host (native.wide_features), unless the user
# chose the target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, which numba reads into its config).
if numba.config.CPU_NAME is None and numba.config.CPU_FEATURES is None:
    numba.config.CPU_FEATURES = wide_features()
# numba's internal pedantic SSA check flags a conditional expression inside an inlined helper
# ("variable ... is not in scope", NumbaIRAssumptionWarning: up to 5 per minifloat kernel,
# each asking to report a numba bug) when a kernel first compiles. The compiled code is right
# (the parity tests compare every bit), so the message would only alarm a user: ignored.
if hasattr(numba.core.errors, "NumbaIRAssumptionWarning"):
    warnings.filterwarnings("ignore", category=numba.core.errors.NumbaIRAssumptionWarning)

from .layout import (BITS, BRED, EMIN, FLOAT, HALF, KIND, LINEAR, MAN, MAXORD, NEAREST, NT,  # noqa: E402,F401
                     ONE, ROUND, SBF16, SIGNED, SQRT, STOCHASTIC, TABLE, UNIT, ZERO)
from .rounding import code_of, float_code, float_floor_frac, pow2  # noqa: E402,F401 (after the cache line: its functions are cached there)

STORED = 2  # stored_value's `prepared` (False: raw, True: sqrt and sign applied, STORED: final)

MUL1 = np.uint32(0x7FEB352D)
MUL2 = np.uint32(0x846CA68B)
GOLDEN = np.uint32(0x9E3779B9)  # quant/hash.GOLDEN
U8, U15, U16 = np.uint32(8), np.uint32(15), np.uint32(16)
TWO_M24 = np.float32(2.0 ** -24)
TWO_M16 = np.float32(2.0 ** -16)
TWO = np.float32(2.0)
INF = np.float32(np.inf)


# ---- bf16 ------------------------------------------------------------------------------------------
@njit(cache=True, inline="always", error_model="numpy")
def bf16_bits_to_f32(h):
    return f32_from_bits(np.uint32(np.uint32(h) << np.uint32(16)))


BF16_NAN = np.uint16(0x7FC0 if bf16_nan() is None else bf16_nan())  # torch's cast of every NaN (bf16_nan)


@njit(cache=True, inline="always", error_model="numpy")
def f32_to_bf16_bits(x):
    """Round to nearest even, NaN -> BF16_NAN (torch's fp32 -> bf16 cast on CPU: 0xFFFF from
    its vectorized cast, 0x7FC0 from its scalar one; kernels/cpu.bf16_nan)."""
    if x != x:
        return BF16_NAN
    b = bits_of_f32(x)
    return np.uint16(np.uint32(b + np.uint32(0x7FFF) + ((b >> U16) & np.uint32(1))) >> U16)


# ---- values of parameters, gradients (fp32 or bf16 held as uint16) and scales ---------------
def value_at(a, i):
    """a[i] as fp32 (exact widening)."""


@overload(value_at, inline="always")
def _value_at(a, i):
    if a.dtype == types.uint16:
        return lambda a, i: bf16_bits_to_f32(a[i])
    return lambda a, i: a[i]


def store_value(a, i, x):
    """a[i] = x in a's dtype (bf16: round half to even)."""


@overload(store_value, inline="always")
def _store_value(a, i, x):
    if a.dtype == types.uint16:
        def impl(a, i, x):
            a[i] = f32_to_bf16_bits(x)
        return impl

    def impl(a, i, x):
        a[i] = x
    return impl


@njit(cache=True, inline="always", error_model="numpy")
def load_row(a, start, cnt, row):
    """row[:cnt] = a[start:start + cnt] as fp32."""
    i0 = np.uint64(start)
    for j in range(cnt):
        row[j] = value_at(a, i0 + np.uint64(j))


@njit(cache=True, inline="always", error_model="numpy")
def load_grad(g, start, cnt, row):
    """row[:cnt] = the gradient as fp32 with NaN/Inf elements set to 0; returns how many were."""
    bad = 0
    i0 = np.uint64(start)
    for j in range(cnt):
        gj = value_at(g, i0 + np.uint64(j))
        ok = abs(gj) < INF
        row[j] = gj if ok else ZERO
        bad += np.int64(not ok)
    return bad


@njit(cache=True, inline="always", error_model="numpy")
def store_row(row, start, cnt, a):
    """a[start:start + cnt] = row[:cnt] in a's dtype."""
    i0 = np.uint64(start)
    for j in range(cnt):
        store_value(a, i0 + np.uint64(j), row[j])


# ---- the hash (quant/hash.py) --------------------------------------------------------------------
@njit(cache=True, inline="always", error_model="numpy")
def hash32(x):
    """lowbias32 on uint32 (each product truncated to 32 bits: LLVM keeps it a 32-bit multiply)."""
    x = np.uint32(x ^ (x >> U16))
    x = np.uint32(x * MUL1)
    x = np.uint32(x ^ (x >> U15))
    x = np.uint32(x * MUL2)
    return np.uint32(x ^ (x >> U16))


@njit(cache=True, inline="always", error_model="numpy")
def step_keys(key, step):
    """(k1, k2) of a stream key at a step (quant/hash.stream_keys, host.keys): k1 =
    hash32(key ^ step), k2 = hash32(k1 ^ 0x9e3779b9); key and step uint32."""
    k1 = hash32(np.uint32(np.uint32(key) ^ np.uint32(step)))
    return k1, hash32(np.uint32(k1 ^ GOLDEN))


@njit(cache=True, inline="always", error_model="numpy")
def uniform(counter, k1, k2):
    """U[0, 1) on the 2**-24 grid: (hash32(hash32(c ^ k1) ^ k2) >> 8) * 2**-24 (fp32);
    counter taken mod 2**32, k1 and k2 uint32."""
    c = np.uint32(counter)
    h = np.uint32(hash32(np.uint32(hash32(np.uint32(c ^ k1)) ^ k2)) >> U8)
    return np.float32(np.int32(h)) * TWO_M24  # h < 2**24: exact through int32 (packs on AVX2)


@njit(cache=True, inline="always", error_model="numpy")
def uniform16(counter, k1, k2):
    """U[0, 1) on the 2**-16 grid for element counter i (quant/hash.uniform16): bits
    16 (i & 1) .. 16 (i & 1) + 15 of hash32(hash32((i >> 1) ^ k1) ^ k2), times 2**-16."""
    i = np.int64(counter)
    bits = hash32(np.uint32(hash32(np.uint32(np.uint32(i >> 1) ^ k1)) ^ k2))
    return np.float32(shr32(bits, (i & 1) * 16) & np.uint32(0xFFFF)) * TWO_M16


@njit(cache=True, inline="always", error_model="numpy")
def uniform_bits(q, start, cnt, k1, k2):
    """q[j] = the 16 bits of uniform16(start + j, k1, k2) (times 2**-16: the uniform) for
    j < cnt, and for j = cnt when cnt is odd: one hash per pair of elements, whose halves are
    the pair's bits (start is even, so element start + 2i and the next share hash i + start / 2);
    a loop over pairs packs, where uniform16 per element computes each hash twice."""
    p0 = np.int64(start) >> 1
    for i in range((cnt + 1) >> 1):
        h = hash32(np.uint32(hash32(np.uint32(np.uint32(p0 + i) ^ k1)) ^ k2))
        q[2 * i] = np.int32(h & np.uint32(0xFFFF))
        q[2 * i + 1] = np.int32(h >> U16)


# ---- the block codec ---------------------------------------------------------------------------------
@njit(cache=True, inline="always", error_model="numpy")
def unpack_codes(codes, bits, start, cnt, q):
    """q[:cnt] = the unsigned codes of elements start .. start + cnt - 1."""
    if bits == 4:
        i0 = np.uint64(start >> 1)
        for j in range(cnt >> 1):
            byte = np.int32(codes[i0 + np.uint64(j)])
            q[2 * j] = byte & 15
            q[2 * j + 1] = byte >> 4
        if cnt & 1:
            q[cnt - 1] = np.int32(codes[i0 + np.uint64(cnt >> 1)]) & 15
    else:
        i0 = np.uint64(start)
        for j in range(cnt):
            q[j] = np.int32(codes[i0 + np.uint64(j)])


@njit(cache=True, inline="always", error_model="numpy")
def pack_codes(q, bits, start, cnt, codes):
    """Write q[:cnt] (reduced to `bits` bits) as the codes of elements start .. (4-bit: the
    high nibble after an odd tail is 0, as packing.pack pads)."""
    if bits == 4:
        i0 = np.uint64(start >> 1)
        for j in range(cnt >> 1):
            codes[i0 + np.uint64(j)] = np.uint8(q[2 * j] | (q[2 * j + 1] << 4))
        if cnt & 1:
            codes[i0 + np.uint64(cnt >> 1)] = np.uint8(q[cnt - 1])
    else:
        i0 = np.uint64(start)
        for j in range(cnt):
            codes[i0 + np.uint64(j)] = np.uint8(q[j])


@njit(cache=True, inline="always", error_model="numpy")
def block_step(absmax, top, top_min):
    """delta = absmax / top, 0 where absmax < top * 2**-126 (quantizer.step_of)."""
    if absmax >= top_min:
        return absmax / top
    return ZERO


@njit(cache=True, inline="always", error_model="numpy")
def decode_params(scale, lay, lim, b, k1, k2):
    """(delta, d, f0, shift) of block b for decode_value: the step delta = scale / top (0 for
    a scale below top * 2**-126), BReD's dither d = u_b - 1/2 (0 otherwise), and the dither
    read as an ordinal offset: (1 - d, 1) if d > 0 else (-d, 0) (formats.interp)."""
    delta = block_step(scale, lim[0], lim[1])
    d = uniform(b, k1, k2) - HALF if lay[ROUND] == BRED else ZERO
    pos = d > ZERO
    f0 = ONE - d if pos else -d
    shift = np.int32(1) if pos else np.int32(0)
    return delta, d, f0, shift


@njit(cache=True, inline="always", error_model="numpy")
def decode_value(qj, lay, table, dp):
    """The stored value of code qj (an int32 in [0, 2**bits)) in a block with decode_params dp
    (quantizer.decode, one element: straight-line code for a given lay, so a loop of it packs)."""
    delta, d, f0, shift = dp
    rounding = lay[ROUND]
    if lay[KIND] == FLOAT:  # the magnitude ordinal's value (BReD: at q - d, formats.interp), signed
        sign = np.int32(1 << (lay[BITS] - 1)) if lay[SIGNED] else np.int32(0)
        q = np.int32(qj & ~sign)
        if rounding == BRED:
            k = np.int32(q - shift)
            kc = min(max(k, np.int32(0)), np.int32(lay[MAXORD]))
            f = f0 + np.float32(np.int32(k - kc))
            lo = float_value(kc, lay)
            x = lo + f * (float_value(np.int32(kc + 1), lay) - lo)
        else:
            x = float_value(q, lay)
        x = (-x if (qj & sign) != 0 else x) * delta
    elif lay[KIND] == LINEAR:  # x_hat = (q - d) * delta, q read as two's complement if signed
        half = np.int32(1 << (lay[BITS] - 1)) if lay[SIGNED] else np.int32(0)
        qf = np.float32(np.int32((qj ^ half) - half))
        x = (qf - d) * delta if rounding == BRED else qf * delta
    elif lay[UNIT] and rounding == BRED:  # a no-zero linear map, one line: rn((k + 1) + f) / UNIT
        x = ((np.float32(np.int32(qj - shift + 1)) + f0) * (ONE / np.float32(lay[UNIT]))) * delta
    elif lay[UNIT]:
        x = (np.float32(np.int32(qj + 1)) * (ONE / np.float32(lay[UNIT]))) * delta
    elif rounding == BRED:  # ordinal q - d read as (k, f) = (q - 1, 1 - d) if d > 0 else (q, -d)
        k = np.int32(qj - shift)
        kc = min(max(k, np.int32(0)), np.int32(lay[NT] - 2))
        f = f0 + np.float32(np.int32(k - kc))
        lo = table[kc]
        x = (lo + f * (table[kc + 1] - lo)) * delta
    else:
        x = table[qj] * delta
    if lay[SQRT]:
        x = x * x
    return x


@njit(cache=True, inline="always", error_model="numpy")
def float_value(k, lay):
    """The magnitude of minifloat ordinal k (int32 >= 0, one past the largest included):
    formats._float_value, the normal value's bits built from k, else k on the subnormal grid."""
    man, emin = lay[MAN], lay[EMIN]
    normal = f32_from_bits(shl32(np.int32(k + np.int32((126 + emin) << man)), 23 - man))  # 32-bit shifts (native.shl32)
    # k * 2**(emin - man), exact. emin <= -126 (bf16): an fp32 subnormal, whose bits are k shifted
    # to 2**-149's place; multiplying by the subnormal 2**-133 gave the same bits, but a subnormal
    # operand costs a microcode assist per element on x86 (~40 ns: replay_codec16's bf16 decode).
    by_bits = f32_from_bits(shl32(k, min(max(emin + 149 - man, 0), 31)))
    by_mul = np.float32(k) * pow2(emin - man if emin > -126 else 0)  # bf16: no subnormal factor either
    sub = by_bits if emin <= -126 else by_mul
    return normal if sar32(k, man) > np.int32(0) else sub


@njit(cache=True, inline="always", error_model="numpy")
def decode_block(codes, scale, lay, lim, table, b, start, cnt, k1, k2, q, out):
    """out[:cnt] = the stored values of block b (quantizer.decode); (k1, k2) are the keys of
    the step the state was written at (BReD replays its dither from them)."""
    unpack_codes(codes, lay[BITS], start, cnt, q)
    dp = decode_params(scale, lay, lim, b, k1, k2)
    for j in range(cnt):
        out[j] = decode_value(q[j], lay, table, dp)


@njit(cache=True, inline="always", error_model="numpy")
def stored_value(v, lay, prepared):
    """The value encode_block quantizes: non-finite -> 0; unless prepared, sqrt(max(v, 0))
    for a sqrt state and max(v, 0) for an unsigned one; prepared == STORED: v is that value
    already (the caller applied this rule where it computed v). Computed where it is used
    instead of written back over x: a store of `0 where v is bad, else v` into v's own slot
    becomes a masked store (vmaskmovps), microcoded and slow on AMD cores."""
    if prepared == STORED:
        return v
    v = v if abs(v) < INF else ZERO
    if not prepared:
        if lay[SQRT]:
            v = np.sqrt(ZERO if v < ZERO else v)
        if not lay[SIGNED]:
            v = ZERO if v < ZERO else v
    return v


@njit(cache=True, inline="always", error_model="numpy")
def abs_bits(v):
    """The bit pattern of |v| (uint32): ordered as the values for every v >= 0 that is not
    NaN, so a running max of abs_bits is the bit pattern of the absmax."""
    return np.uint32(bits_of_f32(v) & np.uint32(0x7FFFFFFF))


@njit(cache=True, inline="always", error_model="numpy")
def encode_block(x, cnt, lay, lim, table, b, start, k1, k2, prepared, q):
    """Quantize x[:cnt] into q[:cnt] (codes reduced to their bits) and return the block's
    scale as fp32 (quantizer.encode; bf16 scales rounded up). prepared: x is already in the
    stored domain (sqrt taken, >= 0 where unsigned), so only the non-finite rule remains
    (stored_value). x is not modified. Every loop is branch-free (it vectorizes)."""
    return encode_with_absmax(x, cnt, absmax_bits(x, cnt, lay, prepared), lay, lim, table, b, start, k1, k2,
                              prepared, q)


@njit(cache=True, inline="always", error_model="numpy")
def absmax_bits(x, cnt, lay, prepared):
    """max_j abs_bits(stored_value(x[j])), j < cnt: the bits of the block's absmax (a max of
    bit patterns, ordered as the values; it vectorizes)."""
    amax_bits = np.uint32(0)
    for j in range(cnt):
        amax_bits = max(amax_bits, abs_bits(stored_value(x[j], lay, prepared)))
    return amax_bits


@njit(cache=True, inline="always", error_model="numpy")
def encode_with_absmax(x, cnt, amax_bits, lay, lim, table, b, start, k1, k2, prepared, q):
    """encode_block where the caller has computed amax_bits = max_j abs_bits(stored_value(x[j]))
    in a loop of its own (the AdamW update loop: one pass less over the block). One loop:
    n = stored_value(x[j]) * (top / absmax), rounded to a code."""
    absmax, inv = scale_of(amax_bits, lay, lim)
    _round_block(x, cnt, inv, prepared, lay, table, b, start, k1, k2, q)
    return absmax


@njit(cache=True, inline="always", error_model="numpy")
def scale_of(amax_bits, lay, lim):
    """(scale, top / scale) of a block whose absmax has the bit pattern amax_bits (bf16 scales
    rounded up; the factor is 0 where scale < top * 2**-126, quantizer.step_of)."""
    if lay[SBF16] and amax_bits & np.uint32(0xFFFF):  # round the scale up to a bf16 value
        amax_bits = np.uint32((amax_bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000))
    absmax = f32_from_bits(amax_bits)
    return absmax, (lim[0] / absmax if absmax >= lim[1] else ZERO)


@njit(cache=True, inline="always", error_model="numpy")
def block_dither(lay, b, k1, k2):
    """Block b's BReD dither as its rounding uses it: u_b - 1/2 for a linear format (added to
    n), u_b for a code book (rounding.py's up test); 0 for the other roundings."""
    if lay[ROUND] != BRED:
        return ZERO
    if lay[KIND] == LINEAR:
        return uniform(b, k1, k2) - HALF
    return uniform(b, k1, k2)


@njit(cache=True, inline="always", error_model="numpy")
def _round_block(x, cnt, inv, prepared, lay, table, b, start, k1, k2, q):
    """q[:cnt] = code_of(stored_value(x[j]) * inv); stochastic rounding's uniforms go
    through q first (uniform_bits: one hash per pair)."""
    dither = block_dither(lay, b, k1, k2)
    if lay[ROUND] == STOCHASTIC:
        uniform_bits(q, start, cnt, k1, k2)
    for j in range(cnt):
        u = np.float32(q[j]) * TWO_M16 if lay[ROUND] == STOCHASTIC else ZERO
        q[j] = code_of(stored_value(x[j], lay, prepared) * inv, lay, table, dither, u)


@njit(cache=True, inline="always", error_model="numpy")
def read_state(fresh, codes, s16, sbf16, lay, lim, table, b, start, cnt, k1, k2, q, out):
    """out[:cnt] = block b of a stored state (decode_block with its scale_at), or zeros when
    the state is fresh (its first step, or the step after a reset)."""
    if fresh:
        for j in range(cnt):
            out[j] = ZERO
    else:
        decode_block(codes, scale_at(s16, b, sbf16), lay, lim, table, b, start, cnt, k1, k2, q, out)


@njit(cache=True, inline="always", error_model="numpy")
def scale_at(s16, b, sbf16):
    """Scale of block b from scales held as uint16 words (fp32: two little-endian words per
    scale; bf16: one), so every scale dtype is one array type (one compilation)."""
    if sbf16:
        return f32_from_bits(np.uint32(np.uint32(s16[b]) << U16))
    return f32_from_bits(np.uint32(np.uint32(s16[2 * b]) | (np.uint32(s16[2 * b + 1]) << U16)))


@njit(cache=True, inline="always", error_model="numpy")
def store_scale(s16, b, absmax, sbf16):
    """Store block b's scale (bf16 scales are exact: encode_block rounded them up)."""
    bits = bits_of_f32(absmax)
    if sbf16:
        s16[b] = np.uint16(bits >> U16)
    else:
        s16[2 * b] = np.uint16(bits & np.uint32(0xFFFF))
        s16[2 * b + 1] = np.uint16(bits >> U16)
