"""Compile the kernels' inline-PTX stores for sm_90 (no GPU) and print, as JSON, what the
PTX says they do; tests/test_kernels_inline_ptx.py reads it. Triton's interpreter runs
none of this PTX, so no interpreter test can see an operand swapped or a store dropped.

- bf16x2: memory.store_values(..., ALIGNED) of a [32, 8] fp32 tile loaded with 16-byte
  loads: for each `cvt.rn.bf16x2.f32 d, a, b` (PTX ISA: a's bf16 in the upper half of d,
  b's in the lower half), the element index (in the thread's loaded vector) of a and b.
- scales: codes.store_scales of a full tile's row absmax, fp32 and bf16 (SBF16): the
  st.global lines its inline PTX left in the kernel (an asm whose result is unused
  survives only as a side effect).

Run as a script with TRITON_INTERPRET unset (the test does, through run_compile_probe).
"""
from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qstate_cli.kernels import codes as cd  # noqa: E402
from qstate_cli.kernels import common as c  # noqa: E402
from qstate_cli.kernels import memory as mem  # noqa: E402

ROWS, B = 32, 8  # one warp: 8 fp32 a thread, two 16-byte loads


@triton.jit
def _bf16_words(x_ptr, y_ptr, ROWS: tl.constexpr, B: tl.constexpr):
    x = mem.load_values(x_ptr, ROWS * B, c.F32, B, B, ROWS, False)
    mem.store_values(y_ptr.to(tl.pointer_type(tl.uint16)), x, ROWS * B, c.BF16, False, B, B, ROWS, False, 0, True)


@triton.jit
def _scales(x_ptr, s_ptr, ROWS: tl.constexpr, B: tl.constexpr, SBF16: tl.constexpr):
    r = tl.arange(0, ROWS)
    x = tl.load(x_ptr + r[:, None] * B + tl.arange(0, B)[None, :])
    ptr = mem.scales_ptr_at(s_ptr.to(tl.int64), SBF16)
    cd.store_scales(ptr, tl.max(tl.abs(x), axis=1), ROWS * B, SBF16, B, ROWS, False)


def compile_ptx(fn, sig: dict, consts: dict) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(sig)
    const = {(names.index(k),): v for k, v in consts.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn, sig, const, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "enable_fp_fusion": False})
    return kernel.asm["ptx"]


def bf16x2_operands(ptx: str) -> list[list[int]]:
    """[index of a, index of b] in the thread's loaded fp32 vectors (element k of the
    n-th 16-byte load is 4n + k) for every cvt.rn.bf16x2.f32 d, a, b."""
    index = {}
    for n, regs in enumerate(re.findall(r"ld\.global\.v4\.b32 \{([^}]*)\}", ptx)):
        for k, reg in enumerate(regs.split(",")):
            index[reg.strip()] = 4 * n + k
    return [[index.get(a, -1), index.get(b, -1)]
            for a, b in re.findall(r"cvt\.rn\.bf16x2\.f32 %r\d+, (%r\d+), (%r\d+);", ptx)]


def scale_stores(ptx: str) -> list[str]:
    """The st.global lines of store_scales's inline PTX (its template: `[$1], $2; mov`)."""
    return re.findall(r"st\.global\.b(?:16|32) \[%rd\d+\], %rs?\d+; mov\.b32 %r\d+, 0;", ptx)


if __name__ == "__main__":
    try:
        ptr = {"x_ptr": "*fp32", "y_ptr": "*bf16", "ROWS": "constexpr", "B": "constexpr"}
        out = {"bf16x2": bf16x2_operands(compile_ptx(_bf16_words, ptr, {"ROWS": ROWS, "B": B}))}
        sig = {"x_ptr": "*fp32", "s_ptr": "*fp32", "ROWS": "constexpr", "B": "constexpr", "SBF16": "constexpr"}
        for sbf16 in (0, 1):
            ptx = compile_ptx(_scales, sig, {"ROWS": ROWS, "B": B, "SBF16": sbf16})
            out[f"scales_sbf16_{sbf16}"] = scale_stores(ptx)
    except Exception as exc:  # noqa: BLE001 - no CUDA backend here: the test skips
        from triton.compiler.errors import CompilationError

        if isinstance(exc, CompilationError):
            raise
        out = {"unavailable": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
