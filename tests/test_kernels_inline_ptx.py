"""The kernels' inline PTX that Triton's interpreter never runs (it takes the pure-Triton
twin instead), checked against the PTX ISA without a GPU:

- codes._WORD8 (store_words: 8 codes in a uint32 word) evaluated instruction by
  instruction: code k (operand $k+1) lands at bits 4k .. 4k+3, where nibbles.decode_words
  and the interpreter's sum put it;
- memory.store_values's cvt.rn.bf16x2.f32 d, a, b (ISA: a -> upper half, b -> lower half):
  b is the even element (the lower address, little-endian), a the odd one, in the sm_90
  PTX of a compiled tile (tests/inline_ptx_probe.py);
- codes.store_scales's st.global (an asm whose result is unused): still in the PTX, for
  fp32 and bf16 scales (made pure, LLVM would drop it and no scale would be written)."""
import random
import re

import pytest

from kernel_parity import run_compile_probe
from qstate_cli.kernels import codes as cd

MASK32 = 0xFFFFFFFF


def run_ptx_block(text: str, operands: dict[str, int]) -> dict[str, int]:
    """Evaluate a `{ .reg .b32 ...; shl.b32 / add.u32 ... }` block on 32-bit registers;
    operands: "$1" -> value. Returns the registers written (with "$0")."""
    regs = dict(operands)
    body = text.strip()
    assert body.startswith("{") and body.endswith("}"), body
    for stmt in filter(None, (s.strip() for s in body[1:-1].split(";"))):
        op, _, args = stmt.partition(" ")
        if op == ".reg":
            continue
        d, a, b = (x.strip() for x in args.split(","))
        val = lambda x: int(x) if re.fullmatch(r"\d+", x) else regs[x]  # noqa: E731
        if op == "shl.b32":
            regs[d] = (val(a) << val(b)) & MASK32
        elif op == "add.u32":
            regs[d] = (val(a) + val(b)) & MASK32
        else:
            raise AssertionError(f"instruction {op!r} not modelled")
    return regs


def test_word8_puts_code_k_at_bits_4k():
    rng = random.Random(0)
    cases = [[15] * 8, [0] * 8] + [[1 if i == k else 0 for i in range(8)] for k in range(8)]
    cases += [[rng.randrange(16) for _ in range(8)] for _ in range(200)]
    for q in cases:
        out = run_ptx_block(cd._WORD8.value, {f"${k + 1}": q[k] for k in range(8)})
        assert out["$0"] == sum(q[k] << (4 * k) for k in range(8)), q


@pytest.fixture(scope="module")
def probe():
    got = run_compile_probe("inline_ptx_probe.py", timeout=300)[-1]
    if "unavailable" in got:
        pytest.skip(f"Triton cannot compile for CUDA here: {got['unavailable']}")
    return got


def test_bf16x2_store_puts_the_even_element_in_the_low_half(probe):
    # 8 fp32 a thread: four cvt.rn.bf16x2.f32 d, a, b with b = element 2j (low half of
    # word j), a = element 2j + 1
    assert sorted(probe["bf16x2"]) == [[2 * j + 1, 2 * j] for j in range(4)], probe["bf16x2"]


def test_scale_stores_survive_compilation(probe):
    assert probe["scales_sbf16_0"] and all(s.startswith("st.global.b32") for s in probe["scales_sbf16_0"])
    assert probe["scales_sbf16_1"] and all(s.startswith("st.global.b16") for s in probe["scales_sbf16_1"])
