"""Correctly rounded fp32 square root and division by a format constant, in fewer sm_90
instructions than ptxas's per-element expansions, with the same results bit for bit.

    sqrt_rn(x)          = sqrt.rn.f32(x), element for element
    div_top(a, TOP)     = rn(a / TOP) for TOP in RECIP and a >= TOP * 2**-126 (step_of)

sqrt_rn. ptxas expands every `sqrt.rn.f32 s, x` (sm_90, Triton 3.6-3.9's ptxas) into

    fast path   r = MUFU.RSQ(x); y = x * r (FMUL.FTZ); h = r * 0.5 (FMUL.FTZ);
                e = fma(-y, y, x); s = fma(e, h, y)
    guard       bits(x) + 0xF3000000 > 0x727FFFFF (unsigned): x outside the positive normals
                [2**-101, FLT_MAX] (zero, subnormal, negative, Inf, NaN) -> a slow-path call

and wraps each element's guard in BSSY / BRA / BSYNC: 10 instructions per element, 5 of them
the guard. SQRT4 below is the same fast path for four elements behind one combined guard
(the four checks OR-ed into one predicate, one branch); if any of the four is outside the
range, all four take `sqrt.rn.f32` itself. So every element gets either the very fast path
ptxas would have given it (it passed the same check) or sqrt.rn.f32: the result is
sqrt.rn.f32's, bit for bit. tests/test_kernels_fastmath.py checks on the sm_90 SASS that
the fast path and the guard constants are the ones ptxas emits for sqrt.rn.f32 (a ptxas
that expands it differently fails that test). Triton's interpreter runs no PTX: there
(INTERPRET) it is tl.sqrt_rn. sqrt_rn_low_guard (SQRT4_MIN) checks only the low end,
min(x0..x3) >= 2**-101: for finite x the same results; for +Inf or NaN elements not
sqrt.rn's, so only callers that discard those may use it (AdamW's checked full tiles).

div_top. For a constant divisor D and R = rn(1/D) (exact fp32 constants, RECIP):
q = rn(a * R), e = fma(-q, D, a), q' = fma(e, R, q) is Markstein's correction of q (R is
within half an ulp of 1/D, q within one ulp of a/D, e exact): q' = rn(a / D). Over-/underflow
aside the result only scales with a's exponent, so tests/test_kernels_fastmath.py checks
it against true division for every fp32 mantissa of one binade, and every value of the
lowest binades (from D * 2**-126, where q could be subnormal, up to where q is normal) and
of the top binade. Three instructions instead of div.rn's ten or so and its slow-path guard.
"""
from __future__ import annotations

import os

import numpy as np
import triton
import triton.language as tl


def _sqrt4_ptx() -> str:
    check, fast, slow, out = [], [], [], []
    for i in range(4):
        x = f"${i + 4}"
        test = "setp.gt.u32 p," if i == 0 else "setp.gt.or.u32 p,"
        check.append(f"mov.b32 b{i}, {x}; add.u32 b{i}, b{i}, 0xF3000000; {test} b{i}, 0x727FFFFF{', p' if i else ''};")
        fast.append(f"rsqrt.approx.ftz.f32 r{i}, {x}; mul.ftz.f32 y{i}, {x}, r{i}; mul.ftz.f32 h{i}, r{i}, 0f3F000000; "
                    f"neg.f32 n{i}, y{i}; fma.rn.f32 e{i}, n{i}, y{i}, {x}; fma.rn.f32 s{i}, e{i}, h{i}, y{i};")
        slow.append(f"sqrt.rn.f32 s{i}, {x};")
        out.append(f"mov.f32 ${i}, s{i};")
    regs = ".reg .pred p; .reg .b32 b<4>; .reg .f32 r<4>, y<4>, h<4>, n<4>, e<4>, s<4>;"
    return " ".join(["{", regs, *check, "@p bra SQRT_SLOW;", *fast, "bra.uni SQRT_DONE; SQRT_SLOW:", *slow,
                     "SQRT_DONE:", *out, "}"])


def _sqrt4_min_ptx() -> str:
    """SQRT4 with the guard on the low end only: min(x0..x3) >= 2**-101 (ordered compare of
    the NaN-ignoring min), for callers that discard results of +Inf and NaN inputs."""
    full = _sqrt4_ptx()
    start, end = full.index("mov.b32 b0"), full.index("@p bra SQRT_SLOW;")
    guard = ("min.f32 m0, $4, $5; min.f32 m1, $6, $7; min.f32 m0, m0, m1; "
             "setp.ltu.f32 p, m0, 0f0D000000;")  # 2**-101; unordered (NaN min) -> slow too
    return full[:start].replace(".reg .pred p;", ".reg .pred p; .reg .f32 m<2>;") + guard + " " + full[end:]


@triton.jit
def _fma_probe(x_ptr, y_ptr):
    x = tl.load(x_ptr)
    tl.store(y_ptr, tl.fma(x, x, -1.0))


def _fma_rounds_once() -> bool:
    """Whether tl.fma rounds once, as the GPU's fma.rn.f32 does. Only Triton's interpreter
    can differ: Triton 3.6's computes x * y + z with two roundings (3.9's rounds once). The
    probe: x = 1 + 2**-12, x * x - 1 = 2**-11 + 2**-24 exactly (an fp32), but 2**-11 when the
    product is rounded first. Where it rounds twice div_top is the true division (div_rn):
    the interpreter's parity tests then do not depend on the interpreter's fma."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return True
    import torch
    x = torch.tensor([1.0 + 2.0 ** -12], dtype=torch.float32)
    y = torch.empty_like(x)
    _fma_probe[(1,)](x, y)
    return float(y[0]) == 2.0 ** -11 + 2.0 ** -24


FMA_ROUNDS_ONCE = tl.constexpr(_fma_rounds_once())
SQRT4 = tl.constexpr(_sqrt4_ptx())
SQRT4_MIN = tl.constexpr(_sqrt4_min_ptx())
# rn(1 / D) for the linear formats' tops (2**(bits-1) - 1 signed, 2**bits - 1 unsigned; 4 and 8 bits)
RECIP = tl.constexpr({d: float(np.float32(1.0 / d)) for d in (7.0, 15.0, 127.0, 255.0)})


@triton.jit
def sqrt_rn(x, INTERPRET: tl.constexpr):
    """sqrt.rn.f32 of every element of fp32 x (four per guard; module docstring)."""
    if INTERPRET:
        return tl.sqrt_rn(x)
    return tl.inline_asm_elementwise(SQRT4, "=f,=f,=f,=f,f,f,f,f", [x], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def sqrt_rn_low_guard(x, INTERPRET: tl.constexpr):
    """sqrt.rn.f32 of every element of fp32 x that is finite (four per guard, which checks
    only their minimum against 2**-101); for +Inf or NaN elements the result is NOT
    sqrt.rn's (the caller must discard it: adamw's checked full tiles do)."""
    if INTERPRET:
        return tl.sqrt_rn(x)
    return tl.inline_asm_elementwise(SQRT4_MIN, "=f,=f,=f,=f,f,f,f,f", [x], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def div_top(a, TOP: tl.constexpr):
    """rn(a / TOP) for a == 0 or a >= TOP * 2**-126 and TOP in RECIP (module docstring);
    the correctly rounded division itself for any other TOP."""
    if TOP == 7.0 or TOP == 15.0 or TOP == 127.0 or TOP == 255.0:
        if FMA_ROUNDS_ONCE:
            R: tl.constexpr = RECIP[TOP]
            q = a * R
            # a = +Inf (a bf16 scale rounded up past bf16's largest finite value): q = +Inf is
            # Inf / TOP, while the correction would make it NaN (fma(-Inf, TOP, Inf) = NaN)
            return tl.where(a < float("inf"), tl.fma(tl.fma(-q, TOP, a), R, q), q)
    return tl.math.div_rn(a, TOP)
