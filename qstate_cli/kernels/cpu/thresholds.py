"""Rounding to the nearest entry of a code book as a search for thresholds.

The staleness model rounds n to the nearest entry of a code book as Format.nearest_ordinal
does (staleness.windows): the floor code, then a step up by a test on the fp32 position
inside the gap,

    k0 = clamp(#(book <= n) - 1, 0, nt - 2),  lo, hi = book[k0], book[k0 + 1]
    code = k0 + [clamp((n - lo) / (hi - lo), 0, 1) >= 1/2]

The replay's model rounds by its thresholds (replay_model_kernel.chunk_windows). The codec's
own test, (n - lo) >= (hi - lo) / 2 (rounding.py), has thresholds too, but reading them (with
the entry each code reads back, 16 bytes a bucket) took the same time as its floor search
in the replay's codec (docs/diagnose.md), so the codec keeps its search.

Every fp32 op there is monotone in n and the code does not fall where k0 steps up (at n =
book[k0 + 1] the test of the gap below holds), so the code is non-decreasing in n. For every n
that is not NaN it is therefore #(thresholds <= n) - 1, clamped to [0, nt - 1], thresholds =
-inf, theta_1, ..., theta_{nt-1}, +inf with theta_k the least fp32 n of code >= k: the floor
code of that array (search.floor_code, host.search_table's buckets on it), one bucket and
one compare where the book's own rounding loads two entries and tests the gap. theta_k lies
in (book[k - 1], book[k]] (code k - 1 at book[k - 1], >= k at book[k]) and is found by
bisection over the fp32 values between, in their order (bit patterns, the negative ones
reversed), each step asking the format's own nearest_ordinal, then checked at itself and at
the value below it.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ...quant.codebooks import codebook


def _code(fmt, n: np.ndarray) -> np.ndarray:
    """fmt.nearest_ordinal of fp32 values (the reference's own torch ops)."""
    return fmt.nearest_ordinal(torch.from_numpy(np.ascontiguousarray(n, np.float32))).numpy()


def _order(x: np.ndarray) -> np.ndarray:
    """fp32 -> int64 in the values' order (-0.0 just below +0.0)."""
    b = x.view(np.uint32).astype(np.int64)
    return np.where(b >> 31, 0x7FFFFFFF - (b & 0x7FFFFFFF), b | 0x80000000)


def _value(o: np.ndarray) -> np.ndarray:
    b = np.where(o >= 0x80000000, o & 0x7FFFFFFF, (0x7FFFFFFF - o) | 0x80000000)
    return b.astype(np.uint32).view(np.float32)


@lru_cache(maxsize=None)
def nearest_thresholds(fmt) -> np.ndarray:
    """fp32 [nt + 1]: -inf, theta_1 .. theta_{nt-1}, +inf of a code-book format (module
    docstring). Read-only."""
    book = np.asarray(codebook(fmt.name), np.float32)
    k = np.arange(1, book.size)
    lo, hi = _order(book[:-1]), _order(book[1:])  # code(lo) = k - 1 < k <= code(hi)
    while (hi - lo > 1).any():
        mid = (lo + hi) // 2
        up = _code(fmt, _value(mid)) >= k
        wide = hi - lo > 1
        hi = np.where(wide & up, mid, hi)
        lo = np.where(wide & ~up, mid, lo)
    theta = _value(hi)
    if not ((_code(fmt, theta) >= k).all() and (_code(fmt, _value(hi - 1)) < k).all()):
        raise AssertionError("nearest_thresholds: the code is not monotone in n")  # cannot happen
    out = np.concatenate([[-np.inf], theta, [np.inf]]).astype(np.float32)
    out.flags.writeable = False
    return out
