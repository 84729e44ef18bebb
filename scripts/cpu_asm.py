"""Diagnostic (not a test): instruction counts of the CPU path's compiled AdamW kernels, one
line per specialization (kernels/cpu/adamw.kernel_for), to see whether the per-block loops
were packed: packed ops (vmulps, vdivps, ...) against scalar ones (vmulss, vdivss, ...), and
how wide: instructions on 512-bit (zmm) and 256-bit (ymm) registers (an AVX-512 host compiles
for zmm, native.wide_features; NUMBA_CPU_FEATURES=<the host's features> for the ymm build).

    NUMBA_CACHE_DIR=$(mktemp -d) python scripts/cpu_asm.py nearest-4bit sr-4bit bred-4bit

numba shows no assembly for a kernel loaded from its disk cache, hence the empty cache dir
(each kernel compiles: about a minute each on an idle 2-core machine). Scalar counts include
each vectorized loop's scalar remainder and the per-block scalar code (scales, the BReD
dither), so they never reach zero.
"""
from __future__ import annotations

import re
import sys
import time
from collections import Counter

import torch

from qstate_cli.kernels.cpu import adamw
from qstate_cli.optim import AdamW

OPS = ("vmulss", "vmulps", "vaddss", "vaddps", "vdivss", "vdivps", "vsqrtss", "vsqrtps", "vcvtss2si", "vcvttss2si",
       "vcvttps2dq", "vpmulld", "vroundss", "vroundps", "vmaskmovps", "vgatherdps")


def main(presets: list[str]) -> None:
    built: dict = {}
    compile_kernel = adamw.kernel_for

    def recording(*key):
        built[key] = compile_kernel(*key)
        return built[key]

    adamw.kernel_for = recording
    for preset in presets:
        p = torch.nn.Parameter(torch.randn(3000))
        p.grad = torch.randn(3000)
        opt = AdamW([p], states=preset, backend="cpu", min_quant_numel=0)
        t = time.perf_counter()
        opt.step()
        print(f"{preset}: first step {time.perf_counter() - t:.1f} s (compile, or load from the disk cache)")
        for key, kernel in built.items():
            for asm in kernel.inspect_asm().values():
                counts = Counter(re.findall(r"^\s+(v\w+)\s", asm, re.M))
                regs = {r: len(re.findall("%" + r + r"\d", asm)) for r in ("zmm", "ymm")}
                widths = " ".join(f"{r} {n}" for r, n in regs.items())
                print(f"  {key}:", " ".join(f"{op} {counts[op]}" for op in OPS), "|", widths)
        built.clear()


if __name__ == "__main__":
    main(sys.argv[1:] or ["nearest-4bit", "sr-4bit", "bred-4bit"])
