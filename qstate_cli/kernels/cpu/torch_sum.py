"""torch's CPU sums, reproduced in numba (torch_sum_kernel.py), so the fused replay statistics
(replay_stats.py, the update's sums in replay_rule.py) add up per unit and per step inside
their own pass over memory and still give the bits StateStats' torch path gives.

A float sum's bits depend on the order of its additions. torch's CPU sum of a contiguous row
(`x.view(-1, unit).sum(1)`, `u.sum(1, dtype=torch.float64)`) adds in a fixed order, set by
the number of lanes W of one of its vectors (torch_sum_kernel.py writes it out). Each row is
summed whole, whatever the thread count, as long as the tensor has more than one row (a sum
to one value splits a long row over threads: sum64 below). W comes from
torch's build and the machine (8 fp32 lanes on x86, AVX2 and AVX-512 alike: ATen runs its
sum kernel at 256 bits), so `lanes()` finds it by trying each candidate against torch on
rows of every length the replay sums, once per process; where none gives torch's bits on
every row, it returns None and the statistics keep torch's sums (the same records, slower).
A sum of fp64 rows (the snapshots' dimension statistic) has its own probe, f64_row_lanes.
A sum to one value (sum64) of more than GRAIN values splits over torch's threads: the chunks
are found once per thread count (_split_found).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from .host import threads

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


GRAIN = 32768  # at::internal::GRAIN_SIZE: a sum to one value of more elements splits over threads
SPLIT_PROBE = (GRAIN - 1, GRAIN, GRAIN + 1, 40000, 65541, 100000, 300007, 1 << 20)


def split_parts(n: int) -> int:
    """Over how many chunks torch's CPU sum of n values to one value splits (the threads of
    at::parallel_for at GRAIN values each, at least one), at host.threads(): torch's own
    count, or the one it had before host.torch_aside put it at one."""
    return max(1, min(threads(), -(-int(n) // GRAIN))) if n > GRAIN else 1


def _lanes_of(dtype: torch.dtype) -> int | None:
    """torch's fp64 lanes for a sum of fp32 values (cast) or of fp64 values."""
    if dtype == torch.float32:
        return (lanes() or (0, None))[1]
    return f64_row_lanes() if dtype == torch.float64 else None


@lru_cache(maxsize=None)
def _split_found(count: int, dtype: torch.dtype, w: int) -> bool:
    """Whether torch_sum_kernel.split_sum with w lanes gives torch's x.sum(dtype=torch.float64)
    of 1-D x (fp32 or fp64) at `count` threads, on SPLIT_PROBE lengths (around the grain, and
    large). Probed only while torch runs that many threads (not inside host.torch_aside:
    split_found probes its count before)."""
    if torch.get_num_threads() != count:
        raise RuntimeError(f"torch's sum order at {count} threads probed at {torch.get_num_threads()}")
    from .torch_sum_kernel import split_sum

    gen = torch.Generator().manual_seed(20261203 + count)
    for n in SPLIT_PROBE:
        x = (torch.randn(n, generator=gen) * torch.exp(3 * torch.randn(n, generator=gen))).to(dtype)
        x[::7] = 0.0
        if split_sum(x.numpy(), split_parts(n), w) != x.sum(dtype=torch.float64).item():
            return False
    return True


def sum64(x: torch.Tensor) -> float:
    """x.sum(dtype=torch.float64) of a contiguous 1-D fp32 or fp64 CPU tensor, the same bits,
    in one numba pass where torch's order at this thread count was found (_split_found):
    ~7x faster at 2**20 fp32 values, as torch casts the whole tensor to fp64 first; else torch's."""
    w = _lanes_of(x.dtype) if x.device.type == "cpu" and x.dim() == 1 and x.is_contiguous() else None
    if w is not None and _split_found(threads(), x.dtype, w):
        if not _SPLIT_SUM:  # imported once: a `from` import per call costs ~5 us
            from .torch_sum_kernel import split_sum
            _SPLIT_SUM.append(split_sum)
        return float(_SPLIT_SUM[0](x.numpy(), split_parts(x.numel()), w))
    return float(x.sum(dtype=torch.float64))


_SPLIT_SUM: list = []


def sum_plan(n: int) -> tuple[int, int] | None:
    """(chunks, lanes): sum64 of n fp32 values adds them in numba as `chunks` contiguous rows
    of ceil(n / chunks) values, each summed with `lanes` fp64 lanes (torch_sum_kernel.range_sum),
    then 0 + the row sums in order (add_in_order); None where sum64 leaves it to torch. For a
    caller that sums the rows where it writes them (replay_model.StalenessModel.sums)."""
    w = _lanes_of(torch.float32)
    if w is None or not _split_found(threads(), torch.float32, w):
        return None
    return split_parts(n), w


def add_in_order(row_sums) -> float:
    """0.0 + each row sum in order, in fp64: split_sum's last step (Python floats are fp64)."""
    total = 0.0
    for r in row_sums:
        total += float(r)
    return total


def split_found() -> bool:
    """Whether sum64 reproduces torch's sums of fp32 and fp64 values at torch's present thread
    count (probed once per count): what host.torch_aside needs to keep their order."""
    return all((w := _lanes_of(d)) is not None and _split_found(threads(), d, w) for d in (torch.float32, torch.float64))


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
