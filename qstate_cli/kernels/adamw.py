"""Fused AdamW / Adam step on quantized m and v: one pass over memory, many tensors per launch.

Per element the kernel reads the parameter (p bytes), the gradient (g bytes), the packed
codes of m and v (bits/8 each) and, per block of B, two fp32 scales; it writes the
parameter, both codes and both scales. Bytes moved per element:

    2p + g + 2 * (bits/8) * 2 + 8 * 2 / B
    4-bit, B=128:  bf16 p and g  8.125 B/elem;  fp32 p and g  14.125 B/elem
    (torch's fused AdamW with fp32 states: 22 and 28 B/elem, so at equal bandwidth the
    4-bit step can be up to 22/8.125 = 2.7x faster)

No full-size temporary is allocated: decode, update and requantization happen in
registers, one tile of ROWS quantization blocks per program (memory.py). The rule is
optim/rules.adamw, op for op:

    m = m_hat * b1 + g * (1 - b1);   v = v_hat * b2 + (g * g) * (1 - b2)
    p = p * decay - (m / (sqrt(v) * inv_bc2_sqrt + eps)) * step_size
    (Adam: g = g + p * wd first, decay = 1)

lr, decay, step_size and inv_bc2_sqrt are read from device memory (rules.pack_scalars),
the step counters are plain (unspecialized) integer arguments: an LR schedule neither
recompiles nor syncs. sqrt(v) serves both the update and v's `:sqrt` storage domain.

Compute per element (H100/H200 are near their issue limit at 8.125 B/elem): one div.rn
and one sqrt.rn, no int<->float conversion (common.py), the per-step hash keys once per
program of up to 8 tiles, the BReD dither once per block row.
"""
from __future__ import annotations

from collections import namedtuple

import triton
import triton.language as tl

from . import codes as cd
from . import common as c
from . import fastmath as fm
from . import memory as mem
from . import nibbles as nb
from .launch import LAUNCH_OPTIONS, NCOL, Batch, StateLayout, as_int32, interpreting, tile_parts, tile_shape

# AdamW's own compile-time constants, one argument through the tile (OPTS.P_KIND, ...)
_Opts = namedtuple("_Opts", ["P_KIND", "G_KIND", "L2", "INTERPRET"])


@triton.jit
def _adamw_part(ptrs, keys, hyper, rem, row0, OPTS: tl.constexpr, M: tl.constexpr, V: tl.constexpr,
                FRESH_M: tl.constexpr, FRESH_V: tl.constexpr, B: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
                MASKED: tl.constexpr, C0: tl.constexpr, ALIGNED: tl.constexpr, RAW: tl.constexpr):
    """Columns C0 .. C0 + W - 1 of every block row of the tile: load, decode, update, store
    the parameter. Returns (m, v in its stored domain, the gradient as loaded, the new
    parameter). RAW: the gradient as loaded, not checked for NaN/Inf, and the parameter not
    stored (the caller checks the tile, then stores it or steps the tile again)."""
    p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, table_m_ptr, table_v_ptr = ptrs
    _, _, _, _, wm1, wm2, wv1, wv2 = keys  # the keys m and v were written with
    decay, step_size, inv_bc2_sqrt, beta1, omb1, beta2, omb2, eps, l2_wd = hyper
    G: tl.constexpr = 4 if OPTS.P_KIND == c.F32 or OPTS.G_KIND == c.F32 else 8  # columns per thread (launch.tile_shape)
    p = mem.load_values(p_ptr, rem, OPTS.P_KIND, B, W, ROWS, MASKED, C0, ALIGNED)
    if RAW:
        g_raw = mem.load_values(g_ptr, rem, OPTS.G_KIND, B, W, ROWS, MASKED, C0, ALIGNED)
        g = g_raw
    else:
        g, g_raw = mem.load_grad(g_ptr, rem, OPTS.G_KIND, B, W, ROWS, MASKED, C0, ALIGNED)
    if OPTS.L2:  # Adam: coupled weight decay
        g = g + p * l2_wd
    m_hat = nb.decode_state(mc_ptr, ms_ptr, table_m_ptr, rem, row0, wm1, wm2, M, FRESH_M, B, W, ROWS, MASKED, C0,
                            ALIGNED, G)
    v_hat = nb.decode_state(vc_ptr, vs_ptr, table_v_ptr, rem, row0, wv1, wv2, V, FRESH_V, B, W, ROWS, MASKED, C0,
                            ALIGNED, G)
    if V.SQRT == 0 and V.KIND != c.NOZERO:  # a dithered v read back below 0 (a square never is;
        v_hat = tl.where(v_hat < 0.0, 0.0, v_hat)  # the no-zero map reads back > 0 even dithered)
    m = m_hat * beta1 + g * omb1
    v = v_hat * beta2 + (g * g) * omb2  # >= 0: v's storage needs no clamp (PREPARED)
    if RAW:  # an Inf or NaN v sends the tile to _adamw_tile_zeroing: its sqrt is discarded
        sqrt_v = fm.sqrt_rn_low_guard(v, OPTS.INTERPRET)
    else:
        sqrt_v = fm.sqrt_rn(v, OPTS.INTERPRET)  # sqrt.rn.f32, four elements per range check (fastmath)
    p = p * decay - tl.math.div_rn(m, sqrt_v * inv_bc2_sqrt + eps) * step_size
    if not RAW:
        mem.store_values(p_ptr, p, rem, OPTS.P_KIND, OPTS.INTERPRET, B, W, ROWS, MASKED, C0, ALIGNED)
    if V.SQRT:
        return m, sqrt_v, g_raw, p
    return m, v, g_raw, p


@triton.constexpr_function
def _words(OPTS, ALIGNED):
    """4-bit codes per stored word (codes.store_words): 8, the columns a thread holds with
    16-bit parameters and gradients, if the batch is aligned; else 0 (byte stores). With
    fp32 values (4 a thread, uint16 words) the words cost more than the bytes (nearest /
    sr / bred 71.8 / 102.1 / 93.7 -> 72.0 / 102.3 / 94.1 SASS/elem)."""
    if not ALIGNED or OPTS.P_KIND == c.F32 or OPTS.G_KIND == c.F32:
        return 0
    return 8


@triton.jit
def _row_absmax_nan(x0, x1, PARTS: tl.constexpr):
    """max |x| per block row over the tile's parts, NaN where a row holds a NaN: equal to
    encode_parts's block absmax (the max over |x| with non-finite values zeroed) in every
    row, when no value of the tile is NaN or Inf."""
    a = tl.abs(x0)
    if PARTS == 2:  # the parts' elementwise max first: one row reduction (shuffles) instead of two
        a = mem.max_nan(a, tl.abs(x1))
    return tl.reduce(a, 1, mem.max_nan)


@triton.jit
def _adamw_tile_zeroing(seen, ptrs, keys, hyper, rem, row0, OPTS: tl.constexpr, M: tl.constexpr, V: tl.constexpr,
                        FRESH_M: tl.constexpr, FRESH_V: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
                        ROWS: tl.constexpr, MASKED: tl.constexpr, PARTS: tl.constexpr, ALIGNED: tl.constexpr):
    """A tile with every gradient, m and v element checked for NaN/Inf (zeroed, tracked in
    `seen`), as the reference does: masked tiles, and full tiles that hold one."""
    W: tl.constexpr = BP // PARTS
    _, _, mc_ptr, ms_ptr, vc_ptr, vs_ptr, table_m_ptr, table_v_ptr = ptrs
    km1, km2, kv1, kv2, _, _, _, _ = keys
    m0, v0, g0, _ = _adamw_part(ptrs, keys, hyper, rem, row0, OPTS, M, V, FRESH_M, FRESH_V, B, W, ROWS, MASKED, 0,
                                ALIGNED, False)
    seen = mem.track_nonfinite(seen, g0)
    m1, v1 = m0, v0
    if PARTS == 2:
        m1, v1, g1, _ = _adamw_part(ptrs, keys, hyper, rem, row0, OPTS, M, V, FRESH_M, FRESH_V, B, W, ROWS, MASKED,
                                    W, ALIGNED, False)
        seen = mem.track_nonfinite(seen, g1)
    GW: tl.constexpr = _words(OPTS, ALIGNED)
    cd.encode_parts(m0, m1, mc_ptr, ms_ptr, table_m_ptr, rem, row0, km1, km2, M, False, B, W, ROWS, MASKED, PARTS,
                    GW)
    cd.encode_parts(v0, v1, vc_ptr, vs_ptr, table_v_ptr, rem, row0, kv1, kv2, V, True, B, W, ROWS, MASKED, PARTS,
                    GW)
    return seen


@triton.jit
def _adamw_tile(seen, ptrs, keys, hyper, rem, row0, OPTS: tl.constexpr, M: tl.constexpr, V: tl.constexpr,
                FRESH_M: tl.constexpr, FRESH_V: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
                ROWS: tl.constexpr, MASKED: tl.constexpr, PARTS: tl.constexpr, ALIGNED: tl.constexpr):
    """One tile of ROWS blocks, held as PARTS parts of BP / PARTS columns (each thread holds
    the same block row in every part, so its per-row work, the block scales, the BReD
    hashes and divisions, is done once for all of them). ptrs: the addresses of p, g, m's
    codes and scales, v's, and the code books of m and v; keys: (km1, km2, kv1, kv2) of
    this step, (wm1, wm2, wv1, wv2) of the steps m and v were written at; hyper: the fp32
    scalars; OPTS: AdamW's own constexprs (_Opts); M, V: the formats (common.Format).
    Returns `seen` updated with the tile's gradient (memory.track_nonfinite).

    A full tile is stepped from the gradient as loaded, its parameter held back: if no
    gradient, m or v element of the tile is NaN or Inf (one tile-wide NaN-propagating max of
    the block maxima, which are then the block absmax encode_parts would compute), zeroing
    them changes nothing, so the parameter is stored and m, v quantized as they are; else
    the tile is stepped again by _adamw_tile_zeroing (nothing was written yet). Same bits
    either way, without the per-element checks (FSETP + FSEL each) on the common path."""
    W: tl.constexpr = BP // PARTS
    if MASKED or M.SQRT or M.SIGNED == 0:  # encode_parts's stored_domain does more than zero non-finite
        seen = _adamw_tile_zeroing(seen, ptrs, keys, hyper, rem, row0, OPTS, M, V, FRESH_M, FRESH_V, B, BP, ROWS,
                                   MASKED, PARTS, ALIGNED)
    else:  # a full tile: checked for NaN/Inf once, stepped again element by element if it holds one
        p_ptr, _, mc_ptr, ms_ptr, vc_ptr, vs_ptr, table_m_ptr, table_v_ptr = ptrs
        km1, km2, kv1, kv2, _, _, _, _ = keys
        m0, v0, g0, p0 = _adamw_part(ptrs, keys, hyper, rem, row0, OPTS, M, V, FRESH_M, FRESH_V, B, W, ROWS, MASKED,
                                     0, ALIGNED, True)
        m1, v1, g1, p1 = m0, v0, g0, p0
        if PARTS == 2:
            m1, v1, g1, p1 = _adamw_part(ptrs, keys, hyper, rem, row0, OPTS, M, V, FRESH_M, FRESH_V, B, W, ROWS,
                                         MASKED, W, ALIGNED, True)
        am = _row_absmax_nan(m0, m1, PARTS)
        av = _row_absmax_nan(v0, v1, PARTS)
        # no check of g itself: a NaN or Inf gradient makes m NaN or Inf (m = m_hat * b1 + g * (1 - b1),
        # and Inf * 0 is NaN where b1 = 1; Adam's g + p * wd keeps g non-finite), so m's check covers it
        if tl.reduce(mem.max_nan(am, av), 0, mem.max_nan) < float("inf"):  # NaN compares false
            mem.store_values(p_ptr, p0, rem, OPTS.P_KIND, OPTS.INTERPRET, B, W, ROWS, MASKED, 0, ALIGNED)
            if PARTS == 2:
                mem.store_values(p_ptr, p1, rem, OPTS.P_KIND, OPTS.INTERPRET, B, W, ROWS, MASKED, W, ALIGNED)
            GW: tl.constexpr = _words(OPTS, ALIGNED)
            cd.encode_scaled(m0, m1, am, mc_ptr, ms_ptr, table_m_ptr, rem, row0, km1, km2, M, B, W, ROWS, MASKED, PARTS,
                             GW)
            cd.encode_scaled(v0, v1, av, vc_ptr, vs_ptr, table_v_ptr, rem, row0, kv1, kv2, V, B, W, ROWS, MASKED, PARTS,
                             GW)
        else:
            seen = _adamw_tile_zeroing(seen, ptrs, keys, hyper, rem, row0, OPTS, M, V, FRESH_M, FRESH_V, B, BP,
                                       ROWS, MASKED, PARTS, ALIGNED)
    return seen


@triton.jit
def _adamw_tile_at(seen, tile, numel, bases, keys, hyper, OPTS: tl.constexpr, M: tl.constexpr, V: tl.constexpr,
                   FRESH_M: tl.constexpr, FRESH_V: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
                   ROWS: tl.constexpr, MASKED: tl.constexpr, PARTS: tl.constexpr, ALIGNED: tl.constexpr):
    """_adamw_tile of the program's tile number `tile`; bases: the tensor's pointers (p, g, m's
    codes and scales, v's) and the code books."""
    p_base, g_base, mc_base, ms_base, vc_base, vs_base, table_m_ptr, table_v_ptr = bases
    row0, base, rem, _ = mem.tile_origin(numel, tile, B, BP, ROWS)
    ptrs = (p_base + base, g_base + base, mc_base + base * M.BITS // 8, ms_base + row0,
            vc_base + base * V.BITS // 8, vs_base + row0, table_m_ptr, table_v_ptr)
    return _adamw_tile(seen, ptrs, keys, hyper, rem, row0, OPTS, M, V, FRESH_M, FRESH_V, B, BP, ROWS, MASKED, PARTS,
                       ALIGNED)


@triton.jit(do_not_specialize=["step", "written_m", "written_v"])
def _adamw_kernel(
    meta_ptr,  # int64 [T, NCOL]: addresses, sizes and stream keys of each tensor (launch.META_COLUMNS)
    prog_ptr,  # int32 [grid]: the tensor each program works on
    scal_ptr,  # fp32 [4]: lr, decay = 1 - lr * wd, step_size = lr / (1 - b1**t), 1 / sqrt(1 - b2**t)
    table_m_ptr, table_v_ptr,  # fp32 code books of m and v (table formats only)
    step, written_m, written_v,  # int32 bit patterns of uint32 steps: this one, and when m, v were written
    beta1, omb1, beta2, omb2, eps, l2_wd,  # fp32 hyper-parameters (omb = 1 - beta, from float64)
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, L2: tl.constexpr, INTERPRET: tl.constexpr,
    M_KIND: tl.constexpr, M_BITS: tl.constexpr, M_SIGNED: tl.constexpr, M_TOP: tl.constexpr,
    M_NT: tl.constexpr, M_ROUND: tl.constexpr, M_SQRT: tl.constexpr, M_SBF16: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_SIGNED: tl.constexpr, V_TOP: tl.constexpr,
    V_NT: tl.constexpr, V_ROUND: tl.constexpr, V_SQRT: tl.constexpr, V_SBF16: tl.constexpr,
    FRESH_M: tl.constexpr, FRESH_V: tl.constexpr,  # the state reads as 0 (never written, or reset)
    B: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, ALIGNED: tl.constexpr,
    NC: tl.constexpr, PARTS: tl.constexpr,  # a thread holds PARTS 16-byte vectors of one block row
):
    meta, numel, tile0, ntiles = mem.program_tiles(meta_ptr, prog_ptr, NC, B, ROWS, TILES)
    key_m = tl.load(meta + c.M_KEY).to(tl.uint32)
    key_v = tl.load(meta + c.V_KEY).to(tl.uint32)
    km1, km2 = c.step_keys(key_m, step.to(tl.uint32, bitcast=True))
    kv1, kv2 = c.step_keys(key_v, step.to(tl.uint32, bitcast=True))
    wm1, wm2 = c.step_keys(key_m, written_m.to(tl.uint32, bitcast=True))
    wv1, wv2 = c.step_keys(key_v, written_v.to(tl.uint32, bitcast=True))
    decay = tl.load(scal_ptr + 1)
    step_size = tl.load(scal_ptr + 2)
    inv_bc2_sqrt = tl.load(scal_ptr + 3)
    p_base = mem.value_ptr(tl.load(meta + c.PARAM), P_KIND, ALIGNED)
    g_base = mem.value_ptr(tl.load(meta + c.GRAD), G_KIND, ALIGNED)
    mc_base = mem.codes_ptr_at(tl.load(meta + c.M_CODES), ALIGNED)
    ms_base = mem.scales_ptr_at(tl.load(meta + c.M_SCALES), M_SBF16)
    vc_base = mem.codes_ptr_at(tl.load(meta + c.V_CODES), ALIGNED)
    vs_base = mem.scales_ptr_at(tl.load(meta + c.V_SCALES), V_SBF16)
    keys = (km1, km2, kv1, kv2, wm1, wm2, wv1, wv2)
    hyper = (decay, step_size, inv_bc2_sqrt, beta1, omb1, beta2, omb2, eps, l2_wd)
    OPTS: tl.constexpr = _Opts(P_KIND, G_KIND, L2, INTERPRET)
    M: tl.constexpr = c.Format(M_KIND, M_BITS, M_SIGNED, M_TOP, M_NT, M_ROUND, M_SQRT, M_SBF16)
    V: tl.constexpr = c.Format(V_KIND, V_BITS, V_SIGNED, V_TOP, V_NT, V_ROUND, V_SQRT, V_SBF16)
    seen = tl.zeros([ROWS, BP // PARTS], tl.float32)
    bases = (p_base, g_base, mc_base, ms_base, vc_base, vs_base, table_m_ptr, table_v_ptr)
    nfull = mem.full_tiles(numel, tile0, ntiles, B, BP, ROWS)
    for i in range(0, nfull):  # every element of these tiles exists: no masks
        seen = _adamw_tile_at(seen, tile0 + i, numel, bases, keys, hyper, OPTS, M, V, FRESH_M, FRESH_V, B, BP, ROWS,
                              False, PARTS, ALIGNED)
    for i in range(nfull, ntiles):  # the tensor's short last tile, or every tile if B < BP
        seen = _adamw_tile_at(seen, tile0 + i, numel, bases, keys, hyper, OPTS, M, V, FRESH_M, FRESH_V, B, BP, ROWS,
                              True, PARTS, ALIGNED)
    mem.count_nonfinite(meta, seen, g_base, numel, tile0, ntiles, G_KIND, B, BP, ROWS)


def adamw_step(batch: Batch, scalars, m: StateLayout, v: StateLayout, *, p_kind: int, g_kind: int,
               step: int, written: tuple[int, int], fresh: tuple[bool, bool],
               beta1: float, beta2: float, eps: float, l2_wd: float = 0.0, tables=(None, None)) -> None:
    """Launch one fused AdamW step over every tensor of `batch` (launch.build_batch, which
    holds the random streams' keys).

    scalars: fp32 [4] device tensor (rules.pack_scalars); written/fresh per state (m, v);
    tables: the code book tensors of table formats (None for linear ones).
    """
    if m.block != v.block:
        raise ValueError("m and v must share a block size to be stepped by one kernel")
    bp, rows, warps = tile_shape(m.block, batch.value_bytes)
    parts = tile_parts(m.block, batch.value_bytes)
    table_m = tables[0] if tables[0] is not None else scalars
    table_v = tables[1] if tables[1] is not None else scalars
    _adamw_kernel[(batch.grid,)](
        batch.meta, batch.programs, scalars, table_m, table_v,
        as_int32(step), as_int32(written[0]), as_int32(written[1]),
        float(beta1), 1.0 - float(beta1), float(beta2), 1.0 - float(beta2), float(eps), float(l2_wd),
        P_KIND=p_kind, G_KIND=g_kind, L2=int(l2_wd != 0.0), INTERPRET=interpreting(),
        **m.constexprs("M_"), **v.constexprs("V_"), FRESH_M=int(bool(fresh[0])), FRESH_V=int(bool(fresh[1])),
        B=m.block, BP=bp, ROWS=rows, TILES=batch.tiles, ALIGNED=batch.aligned, NC=NCOL, PARTS=parts,
        num_warps=warps, **LAUNCH_OPTIONS)
