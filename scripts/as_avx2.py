"""Diagnostic (not a test): run a command as this project's code would run on an AVX2-only host.

    python scripts/as_avx2.py python scripts/bench_cpu.py --no-peers --presets nearest-4bit,sr-4bit
    python scripts/as_avx2.py python scripts/bench_replay.py --backends auto --repeats 3

On an AVX-512 host it sets, for the command only:
    NUMBA_CPU_NAME=haswell            the CPU path's kernels compiled for an AVX2 core (LLVM's
                                      `haswell`: 256-bit vectors, FMA, BMI2)
    NUMBA_CPU_FEATURES=<the host's, every AVX-512, AMX, AVX10 and AVX-VNNI/IFMA/NE feature and
                                      GFNI off>: no instruction an AVX2 core (Zen 3, Haswell
                                      .. Skylake client) lacks
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

# features an AVX2-only core lacks (by prefix): AVX-512 (every subset), AMX, AVX10, the VEX-coded
# VNNI / IFMA / NE-convert extensions of later cores, GFNI (not on Zen 3 nor Haswell .. Skylake)
AVX512_ONLY = ("avx512", "amx", "avx10", "evex512", "avxvnni", "avxifma", "avxneconvert", "gfni")


def avx2_env(features: dict[str, bool]) -> dict[str, str]:
    """The environment that builds and dispatches for AVX2 (module docstring), from the host's
    features as llvmlite reports them ({name: present})."""
    flags = [("-" if name.startswith(AVX512_ONLY) or not on else "+") + name
             for name, on in sorted(features.items())]
    return {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ",".join(flags), "ATEN_CPU_CAPABILITY": "avx2"}


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    try:
        import llvmlite.binding as llvm
    except ImportError:
        raise SystemExit("as_avx2: needs numba's llvmlite (pip install 'qstate-cli[cpu]')")
    env = dict(os.environ, **avx2_env(dict(llvm.get_host_cpu_features())))
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        raise SystemExit(f"as_avx2: cannot run {argv[0]!r}: {exc.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
