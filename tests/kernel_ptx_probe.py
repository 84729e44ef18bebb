"""Compile the fused kernels for an sm_90 target without a GPU and count PTX instructions.

Run as a script (TRITON_INTERPRET unset): `python tests/kernel_ptx_probe.py` prints one
JSON object per variant. qstate_cli/kernels/sass.py calls the real launchers with CPU
tensors and a stand-in kernel that records the launch arguments, then compiles the real
Triton kernel with them through `triton.compile`, as a launch on an H100/H200 would.
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter

import torch

OPS = r"^\s+(?:@!?%p\d+ )?((?:ld|st)\.(?:global|shared)[.\w]*|fma\.rn\.f32|div\.\w+\.f32|sqrt\.\w+\.f32|bar\.sync)"


def compile_ptx(op: str, states: str, dtype: torch.dtype, arch: int = 90) -> str:
    """The PTX of the launch `op` makes for `states` (qstate_cli.kernels.sass records it)."""
    from qstate_cli.kernels import sass

    jit, call = sass.record_launch(op, states, dtype)
    return sass.compile_kernel(jit, call, arch).asm["ptx"]


def _fastmath_sqrt() -> re.Pattern:
    """kernels.fastmath.SQRT4 and SQRT4_MIN as they appear in PTX: $n operands are registers."""
    from qstate_cli.kernels import fastmath

    blocks = (fastmath.SQRT4.value, fastmath.SQRT4_MIN.value)
    return re.compile("|".join(re.sub(r"\\\$\d+", r"%r\\d+", re.escape(b)) for b in blocks))


def _div_top_constants() -> set[str]:
    """PTX spellings of -TOP, TOP and rn(1 / TOP), the multipliers of fastmath.div_top's FMAs
    (Triton 3.9 folds the negation of fma(-q, TOP, a) into the constant, 3.6 negates q)."""
    import numpy as np

    from qstate_cli.kernels import fastmath

    spell = lambda x: "0f%08X" % int(np.array(x, dtype=np.float32).view(np.uint32))  # noqa: E731
    return {spell(c) for d, r in fastmath.RECIP.value.items() for c in (-d, d, r)}  # 3.6: fma(neg q, TOP, a)


def summarize(ptx: str) -> dict:
    """Counts of memory, division, sqrt, FMA and barrier instructions and of .ftz ones,
    outside fastmath's sqrt blocks ("fastmath_sqrt": how many); "div_top_fma": the FMAs
    whose multiplier is one of fastmath.div_top's constants."""
    sqrt4 = _fastmath_sqrt()
    rest = sqrt4.sub("", ptx)
    fmas = re.findall(r"^\s+fma\.rn\.f32\s+[^,]+,\s*[^,]+,\s*([^,]+),", rest, re.M)
    consts = _div_top_constants()
    return {"all": dict(Counter(re.findall(OPS, rest, re.M))), "ftz": len(re.findall(r"\.ftz\b", rest)),
            "fastmath_sqrt": len(sqrt4.findall(ptx)), "div_top_fma": sum(f.strip() in consts for f in fmas)}


VARIANTS = [("adamw", "bred-4bit", torch.bfloat16), ("adamw", "torchao-4bit", torch.float32),
            ("muon", "m=int8:sr:b256", torch.bfloat16),
            ("adamw", "m=int4:bred:b128:sbf16,v=lin4nz:bred:b128:sbf16", torch.bfloat16)]  # bf16 block scales

if __name__ == "__main__":
    for op, states, dtype in VARIANTS:
        try:
            result = summarize(compile_ptx(op, states, dtype))
        except Exception as exc:  # noqa: BLE001
            from triton.compiler.errors import CompilationError

            if isinstance(exc, CompilationError):  # an error in the kernel's code: report it
                raise
            # no CUDA backend or toolchain here, or another Triton version's compile API
            result = {"unavailable": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(dict(op=op, states=states, dtype=str(dtype), **result)), flush=True)
    sys.exit(0)
