"""The columns of a state layout tuple `lay` (codec.py, host.layout_arrays), its format kinds
and roundings, and the fp32 constants the kernels share (no numba here)."""
from __future__ import annotations

import numpy as np

KIND, BITS, SIGNED, NT, ROUND, SQRT, SBF16, UNIT = range(8)  # then search.py's SHIFT, NM, STEPS, OFF
MAN, EMIN, MAXORD = range(8, 11)  # a minifloat's mantissa bits, emin, largest ordinal, in those columns
LINEAR, TABLE, FLOAT = 0, 1, 2
NEAREST, STOCHASTIC, BRED = 0, 1, 2

HALF = np.float32(0.5)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)

HIST_COPIES = 4  # histogram copies per thread (replay_stats_kernel): neighbours count into different ones
STALE_COPIES = 8  # a snapshot's staleness histogram in the step's pass (replay_stats_kernel.state_counts): its
# elements crowd into a few bins; 8 copies and the bins written first took nearest-4bit's counts on a
# snapshot step from 14.3-15.7 to 10.2-10.6 us per 4096 elements (one thread)


def hist_copies(bits: int) -> int:
    """Interleaved copies per thread of the code histogram of `bits`-bit codes
    (replay_stats.CodeCounts.hist [threads, copies, bins]; replay_stats_kernel.state_counts):
    element j counts into copy j % copies, so neighbours that hit the same bin do not wait on
    each other's increment. 8 for 4-bit codes (80 bins, most elements in a few of them: one
    chunk's counts 7.5-7.9 -> 6.8-7.0 us per 4096 elements against 4 copies, nearest-4bit, one thread),
    4 otherwise (8 copies of an 8-bit state's 1280 bins, 80 kB, no faster)."""
    return 8 if bits == 4 else HIST_COPIES
