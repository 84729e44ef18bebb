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

HIST_COPIES = 4  # histogram rows per thread (replay_stats_kernel.state_counts): neighbours count into different rows
