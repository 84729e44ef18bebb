"""kernels/fastmath.py: the cheaper correctly rounded sqrt and division by a format's top
give the same bits as sqrt.rn.f32 and true fp32 division.

- div_top runs in Triton's interpreter (its fma rounds once, as the GPU's) on every fp32
  value of the binades where its result cannot simply scale with the exponent (the lowest,
  where q = a * R may be subnormal, and the top one) and on every mantissa of [1, 2), whose
  result every other binade's is a power-of-two multiple of; compared with torch's a / TOP.
- sqrt_rn's GPU path is inline PTX the interpreter cannot run: its sm_90 SASS is compared
  with ptxas's own expansion of sqrt.rn.f32 (tests/fastmath_sass_probe.py): the same
  expression on the fast path for every element, behind the same range checks
  (sqrt_rn_low_guard: behind one check of the four elements' minimum)."""
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernel_parity import DEVICE, run_compile_probe
from qstate_cli.kernels import fastmath as fm

BLOCK = 1 << 20


@triton.jit
def _div_top_kernel(a_ptr, q_ptr, TOP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(q_ptr + i, fm.div_top(tl.load(a_ptr + i), TOP))


def _floats(lo_bits: int, hi_bits: int) -> torch.Tensor:
    """Every fp32 with bit pattern in [lo_bits, hi_bits), padded to whole blocks with 1.0."""
    n = hi_bits - lo_bits
    bits = torch.full((-(-n // BLOCK) * BLOCK,), 0x3F800000, dtype=torch.int32)
    bits[:n] = torch.arange(lo_bits, hi_bits, dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32)


def _bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.int32))


@pytest.mark.parametrize("top", sorted(fm.RECIP.value))
def test_reciprocal_constants_are_correctly_rounded(top):
    r = fm.RECIP.value[top]
    assert float(np.float32(r)) == r  # an fp32 value
    ulp = Fraction(2) ** (int(np.floor(np.log2(r))) - 23)
    assert abs(Fraction(r) - Fraction(1, int(top))) <= ulp / 2


@pytest.mark.parametrize("top", sorted(fm.RECIP.value))
@pytest.mark.skipif(not fm.FMA_ROUNDS_ONCE.value, reason="this Triton interpreter's tl.fma rounds twice: div_top "
                    "is the true division here (fastmath._fma_rounds_once)")
def test_div_top_equals_true_division(top, one_thread):
    low = _bits(top * 2.0 ** -126)  # step_of uses the quotient from here up
    normal_q = _bits(2.0 ** (-126 + int(top).bit_length() + 1))  # a / top >= 2**-125 from here
    ranges = [(low, normal_q), (_bits(1.0), _bits(2.0)), (_bits(2.0 ** 127), _bits(np.finfo(np.float32).max) + 1),
              (0, 1), (_bits(np.inf), _bits(np.inf) + 1)]  # and a == 0, a == +Inf (an infinite bf16 scale)
    for lo, hi in ranges:
        a = _floats(lo, hi).to(DEVICE)
        q = torch.empty_like(a)
        _div_top_kernel[(a.numel() // BLOCK,)](a, q, TOP=top, BLOCK=BLOCK)
        want = a / top
        diff = (q.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
        assert diff.numel() == 0, f"top {top}: {diff.numel()} differ, first a = {a[diff[:4]].tolist()}"


def test_sqrt_fast_path_is_ptxas_sqrt_rn_fast_path():
    got = run_compile_probe("fastmath_sass_probe.py", timeout=300)[-1]
    if "unavailable" in got:
        pytest.skip(f"Triton cannot compile for CUDA here: {got['unavailable']}")
    ptxas, fast = got["ptxas"], got["fastmath"]
    assert len(ptxas["stored"]) == 4 and all("MUFU.RSQ" in e for e in ptxas["stored"]), ptxas
    assert fast["stored"] == ptxas["stored"]
    assert fast["guards"] == ptxas["guards"] and len(ptxas["guards"]) == 4
    # sqrt_rn_low_guard: the same fast path behind one ordered compare of min(x0..x3) with
    # 2**-101 (ptxas's low end; its high end, +Inf and NaN, is left to the caller)
    low = got["low_guard"]
    assert low["stored"] == ptxas["stored"]
    (guard,) = low["guards"]
    m = re.fullmatch(r"FSETP\.GE\.AND\((.*),([-0-9.e+]+)\)", guard)
    assert m and float(m.group(2)) == 2.0 ** -101, guard
    assert m.group(1).count("FMNMX(") == 3 and "!PT" not in m.group(1), guard  # PT: min
    assert all(f"x{i}" in m.group(1) for i in range(4)), guard
