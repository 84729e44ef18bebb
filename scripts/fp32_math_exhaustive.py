"""Measurement (not a test): the largest errors of qstate_cli.fp32_math's erf and exp over
EVERY fp32 input of their working ranges, against float64 references (scipy's erf, numpy's
exp): erf over 0 <= x < 4 (erf32 is odd, and +-1 from 4 on, within half an ulp), exp over
[-104, 89] (+inf above, +0 below). fp32_math's docstring states these maxima and
tests/test_fp32_math.py checks its bounds at the worst inputs found here.

    PYTHONPATH=$PWD python scripts/fp32_math_exhaustive.py [erf|exp|all]

Errors: ulps of the fp32 value nearest the float64 reference (normal results), and for exp's
subnormal results, multiples of 2^-149. One thread, chunks of 2^24 inputs: erf ~3 min, exp
~6 min on a 2-core Xeon (2026-12-07), which printed

    erf [0, 4):    ulp 2.5498 at 0.9907498955726624, abs 1.5198e-07 at 0.9907498955726624
    exp [0, 89]:   ulp 1.2206 at 59.26522445678711
    exp [-104, 0]: ulp 1.2122 at -71.04561614990234, subnormal 0.77706 at -87.8175277709961

fp32_math uses IEEE basic operations only, so every CPU gives these bits (and the numba
kernels the same, tests/test_fp32_math.py).
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from scipy import special

from qstate_cli import fp32_math as F

CHUNK = 1 << 24


def bits(v: float) -> int:
    return int(torch.tensor([v], dtype=torch.float32).view(torch.int32).item())


def spacing(want: np.ndarray) -> np.ndarray:
    """The ulp of the fp32 value nearest to want."""
    with np.errstate(over="ignore"):
        return np.spacing(np.abs(want.astype(np.float32))).astype(np.float64)


def scan(lo: int, hi: int, sign: int, f, ref, extra: str | None = None) -> dict[str, tuple[float, float]]:
    """The largest errors of f over the fp32 values with bit patterns lo..hi-1 (times sign):
    {"ulp": (error, x)}, with `extra` "abs" (absolute error) or "subnormal" (of the subnormal
    results, in 2^-149)."""
    worst: dict[str, tuple[float, float]] = {}

    def keep(key, err, x):
        i = int(err.argmax())
        if err[i] > worst.get(key, (-1.0, 0.0))[0]:
            worst[key] = (float(err[i]), float(x[i]))

    for start in range(lo, hi, CHUNK):
        x = torch.arange(start, min(start + CHUNK, hi), dtype=torch.int64).to(torch.int32).view(torch.float32) * sign
        with np.errstate(over="ignore", under="ignore"):
            want = ref(x.double().numpy())
        err = np.abs(f(x).double().numpy() - want)
        normal = (want >= 2.0 ** -126) & (want < 3.4e38)
        keep("ulp", np.where(normal, err / spacing(want), 0.0), x)
        if extra == "subnormal":
            keep("subnormal", np.where(want < 2.0 ** -126, err / 2.0 ** -149, 0.0), x)
        elif extra == "abs":
            keep("abs", err, x)
    return worst


def show(name: str, worst: dict[str, tuple[float, float]]) -> None:
    print(f"{name:14s} " + ", ".join(f"{k} {v:.5g} at {x!r}" for k, (v, x) in worst.items()), flush=True)


def main(what: str = "all") -> None:
    torch.set_num_threads(1)
    if what in ("erf", "all"):
        show("erf [0, 4):", scan(0, bits(4.0), 1, F.erf32, special.erf, "abs"))
    if what in ("exp", "all"):
        show("exp [0, 89]:", scan(0, bits(89.0) + 1, 1, F.exp32, np.exp))
        show("exp [-104, 0]:", scan(0, bits(104.0) + 1, -1, F.exp32, np.exp, "subnormal"))


if __name__ == "__main__":
    what = sys.argv[1:]
    if len(what) > 1 or (what and what[0] not in ("erf", "exp", "all")):
        print(f"usage: python scripts/fp32_math_exhaustive.py [erf|exp|all] (got {' '.join(what)!r})", file=sys.stderr)
        sys.exit(2)
    main(*what)
