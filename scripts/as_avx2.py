"""Diagnostic (not a test): run a command as this project's code would run on an AVX2-only host.

    python scripts/as_avx2.py python scripts/bench_cpu.py --no-peers --presets nearest-4bit,sr-4bit
    python scripts/as_avx2.py python scripts/bench_replay.py --backends auto --repeats 3

On an AVX-512 host it sets, for the command only:
    NUMBA_CPU_NAME=haswell            the CPU path's kernels compiled for an AVX2 core (LLVM's
                                      `haswell`: 256-bit vectors, FMA, BMI2)
    NUMBA_CPU_FEATURES=<the host's, each off unless LLVM's haswell has it, or AES>: no AVX-512,
                                      AMX, AVX10, APX, GFNI, VAES, SHA ... instruction, none
                                      that a Haswell-class AVX2 core lacks (HASWELL)
    ATEN_CPU_CAPABILITY=avx2          torch's own CPU kernels (its fused AdamW, the reductions)
                                      dispatched to their AVX2 build, as on such a host

so the step's ratio to torch's fused AdamW compares the two at the same vector width on the
same core (docs/cpu.md, "An AVX2 build on an AVX-512 host"). It is a proxy: another core's
caches, memory and execution ports are not modelled. numba keys its disk cache by CPU name
and features, so the AVX2 kernels never load the host build's code (their first use compiles).
Needs numba (its llvmlite reads the host's features).
"""
from __future__ import annotations

import os
import sys

# the features of LLVM's `haswell` (its definition in X86.td) as llvmlite names them, and AES, which
# haswell's definition leaves out and Haswell i5/i7 and Zen 3 cores have (LLVM emits it only from
# intrinsics, which the kernels do not use); every other host feature is turned off, so nothing
# later (AVX-512, AMX, AVX10, APX, AVX-VNNI, GFNI, VAES, SHA, ADX, SSE4a ...) reaches the code
HASWELL = frozenset({"64bit", "cmov", "cx8", "cx16", "mmx", "fxsr", "sse", "sse2", "sse3", "ssse3", "sse4.1",
                     "sse4.2", "crc32", "popcnt", "sahf", "avx", "avx2", "fma", "f16c", "bmi", "bmi2", "lzcnt",
                     "movbe", "aes", "pclmul", "rdrnd", "fsgsbase", "invpcid", "xsave", "xsaveopt", "nopl"})


def avx2_env(features: dict[str, bool]) -> dict[str, str]:
    """The environment that builds and dispatches for AVX2 (module docstring), from the host's
    features as llvmlite reports them ({name: present}): each on only where the host has it and
    `haswell` does (HASWELL)."""
    flags = [("+" if on and name in HASWELL else "-") + name for name, on in sorted(features.items())]
    return {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ",".join(flags), "ATEN_CPU_CAPABILITY": "avx2"}


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    try:
        import llvmlite.binding as llvm
    except ImportError:
        _fail("needs numba's llvmlite (pip install 'qstate-cli[cpu]')")
    env = dict(os.environ, **avx2_env(dict(llvm.get_host_cpu_features())))
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        _fail(f"cannot run {argv[0]!r}: {exc.strerror}")


def _fail(why: str) -> None:
    """One line on stderr, exit 2: nothing has run."""
    sys.stderr.write(f"as_avx2: {why}\n")
    raise SystemExit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
