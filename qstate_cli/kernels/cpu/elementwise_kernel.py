"""numba kernels of elementwise.py: encode and decode of an unscaled 16-bit minifloat state
(bf16, fp16) over tensors laid end to end, in runs of RUN elements. The rounding and the
read-back are the replay codec's (replay_kernel.load_stored, round_bf16, round_float;
codec.decode_value), so the codes are quantizer.encode's and the values quantizer.decode's,
bit for bit (tests/test_kernels_cpu_elementwise.py)."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import codec as c  # sets numba's cache folder before anything here compiles
from .replay_kernel import load_stored, round_bf16, round_float

RUN = 2048  # elements per pass of a loop (a row of each scratch array: 8 kB)


@njit(nogil=True, cache=True, error_model="numpy")
def encode16(b0, b1, part, x, codes, lay, starts, k1s, k2s, numel):
    """codes[i] (uint16, the reference's int16 bits) of x[i] (fp32) for the runs b0 .. b1 - 1.
    Stochastic rounding: element i of tensor t (starts[t] <= i < starts[t + 1]) draws
    uniform16(i - starts[t]) of that tensor's keys (k1s[t], k2s[t]): the reference's Stream
    of that tensor (optim/small.Streams). Returns 0."""
    row = np.empty(RUN, np.float32)
    u = np.zeros(RUN, np.float32)
    q = np.empty(RUN, np.int32)
    rounding = lay[c.ROUND]
    bf16 = lay[c.EMIN] <= -126 and lay[c.MAN] == 7 and lay[c.SIGNED] != 0  # round_bf16 (bits only)
    t = 0
    for b in range(b0, b1):
        start = b * RUN
        cnt = min(RUN, numel - start)
        load_stored(x, np.uint64(start), cnt, lay, row)
        if rounding == c.STOCHASTIC:  # each piece of the run in one tensor: a loop that packs
            lo = 0
            while lo < cnt:
                while starts[t + 1] <= start + lo:
                    t += 1
                hi = min(cnt, starts[t + 1] - start)
                k1, k2, first = k1s[t], k2s[t], start - starts[t]
                for j in range(lo, hi):
                    u[j] = c.uniform16(first + j, k1, k2)
                lo = hi
        if bf16:
            round_bf16(row, u, cnt, rounding, lay[c.MAXORD], q)
        else:
            round_float(row, u, cnt, lay, rounding, c.ZERO, q)
        for j in range(cnt):
            codes[np.uint64(start) + np.uint64(j)] = np.uint16(q[j])
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def decode16(b0, b1, part, codes, out, lay, numel):
    """out[i] = the stored value of codes[i] (uint16) for the runs b0 .. b1 - 1: its ordinal's
    value, signed, squared for a :sqrt state (quantizer.decode, unscaled). Returns 0."""
    dp = (c.ONE, c.ZERO, c.ZERO, np.int32(0))  # decode_params of an unscaled, undithered block
    table = np.zeros(1, np.float32)  # a minifloat reads no table
    for b in range(b0, b1):
        i0 = np.uint64(b * RUN)
        for j in range(min(RUN, numel - b * RUN)):
            out[i0 + np.uint64(j)] = c.decode_value(np.int32(codes[i0 + np.uint64(j)]), lay, table, dp)
    return 0
