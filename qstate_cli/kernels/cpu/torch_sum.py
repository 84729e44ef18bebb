"""torch's CPU sums, reproduced in numba (torch_sum_kernel.py), so the fused replay statistics
(replay_stats.py, the update's sums in replay_rule.py) add up per unit and per step inside
their own pass over memory and still give the bits StateStats' torch path gives.

A float sum's bits depend on the order of its additions. torch's CPU sum of a contiguous row
(`x.view(-1, unit).sum(1)`, `u.sum(1, dtype=torch.float64)`) adds in a fixed order, set by
the number of lanes W of one of its vectors (torch_sum_kernel.py writes it out). Each row is
summed whole, whatever the thread count, as long as the tensor has more than one row (a sum
to one value splits a long row over threads: not reproduced, not used). W comes from
torch's build and the machine (8 fp32 lanes on x86, AVX2 and AVX-512 alike: ATen runs its
sum kernel at 256 bits), so `lanes()` finds it by trying each candidate against torch on
rows of every length the replay sums, once per process; where none gives torch's bits on
every row, it returns None and the statistics keep torch's sums (the same records, slower).
A sum of fp64 rows (the snapshots' dimension statistic) has its own probe, f64_row_lanes.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

CANDIDATES_32 = (8, 16, 4)  # fp32 lanes tried, most likely first
CANDIDATES_64 = (4, 8, 2)  # fp64 lanes
PROBE_LENGTHS = tuple(range(1, 70)) + (96, 100, 127, 128, 200, 256, 384, 512, 1000, 1024, 2048, 3000, 4096, 8192,
                                       12345)


@lru_cache(maxsize=None)
def lanes() -> tuple[int, int] | None:
    """(fp32 lanes, fp64 lanes) with which torch_sum_kernel's sums equal torch's x.sum(1) and
    x.sum(1, dtype=torch.float64) of fp32 rows, bit for bit, on rows of PROBE_LENGTHS values
    (signed, spread over many binades, with zeros); None if no candidate does (imports numba)."""
    from .torch_sum_kernel import row_sums

    gen = torch.Generator().manual_seed(20261202)
    found32, found64 = set(CANDIDATES_32), set(CANDIDATES_64)
    for n in PROBE_LENGTHS:
        x = torch.randn(3, n, generator=gen) * torch.exp(3 * torch.randn(3, n, generator=gen))
        x[:, ::7] = 0.0
        a = x.numpy()
        want32, want64 = x.sum(1).numpy(), x.sum(1, dtype=torch.float64).numpy()
        for w in list(found32):
            got = np.empty(3, np.float32)
            row_sums(a, w, got)
            if got.tobytes() != want32.tobytes():
                found32.discard(w)
        for w in list(found64):
            got = np.empty(3, np.float64)
            row_sums(a, w, got)
            if got.tobytes() != want64.tobytes():
                found64.discard(w)
    if not found32 or not found64:
        return None
    return next(w for w in CANDIDATES_32 if w in found32), next(w for w in CANDIDATES_64 if w in found64)


@lru_cache(maxsize=None)
def f64_row_lanes() -> int | None:
    """The fp64 lanes with which torch_sum_kernel's sums of fp64 rows equal torch's x.sum(1)
    of fp64 x, bit for bit, on rows of PROBE_LENGTHS values (products of values spread over
    many binades, with zeros: the dimension statistic's squares); None if none does."""
    from .torch_sum_kernel import row_sums

    gen = torch.Generator().manual_seed(20261203)
    found = list(CANDIDATES_64)
    for n in PROBE_LENGTHS:
        x = torch.randn(3, n, generator=gen, dtype=torch.float64) * torch.exp(
            3 * torch.randn(3, n, generator=gen, dtype=torch.float64))
        x[:, ::7] = 0.0
        x = x * x
        want = x.sum(1).numpy()
        for w in list(found):
            got = np.empty(3, np.float64)
            row_sums(x.numpy(), w, got)
            if got.tobytes() != want.tobytes():
                found.remove(w)
    return found[0] if found else None


_ADD: list = []


def add_step(u: torch.Tensor, units: torch.Tensor, series: torch.Tensor, i: int) -> None:
    """One step's bookkeeping of per-unit sums u (fp32 [rows, n_units]): units += u (fp64) and
    series[:, i] = u.sum(1, dtype=torch.float64), in one numba call where lanes() found
    torch's order, else as those two torch ops (the same bits either way)."""
    w = lanes()
    if w is None:
        units += u
        series[:, i] = u.sum(1, dtype=torch.float64)
        return
    if not _ADD:
        from .torch_sum_kernel import add_step as kernel
        _ADD.append(kernel)
    _ADD[0](u.numpy(), units.numpy(), series.numpy(), int(i), w[1])
