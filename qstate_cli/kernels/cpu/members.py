"""numba helpers of a multi-tensor launch: which members of a launch (host.MemberTable) a
thread's range of blocks meets, each member's own blocks in it, and a state's arrays at the
table's addresses. The optimizers' kernels (adamw.py, lion.py, sgd.py, muon.py) loop

    i0, i1 = member_span(first, b0, b1)
    for i in range(i0, i1):
        views of member i's arrays (native.view_like, state_at), its keys (codec.step_keys)
        lo, hi = member_blocks(first, i, b0, b1)
        for b in range(lo, hi): the per-block step
"""
from __future__ import annotations

from numba import njit

from . import codec  # noqa: F401 - first: it points numba's disk cache at this source version
from .native import view_u8, view_u16


@njit(cache=True, inline="always", error_model="numpy")
def member_span(first, b0, b1):
    """(i0, i1): members i0 .. i1 - 1 of a launch (host.MemberTable.first) have blocks in the
    launch's blocks b0 .. b1 - 1 (a member without blocks is skipped at the start)."""
    n = first.size - 1
    i0 = 0
    while i0 < n and first[i0 + 1] <= b0:
        i0 += 1
    i1 = i0
    while i1 < n and first[i1] < b1:
        i1 += 1
    return i0, i1


@njit(cache=True, inline="always", error_model="numpy")
def member_blocks(first, i, b0, b1):
    """(lo, hi): member i's own blocks lo .. hi - 1 that lie in the launch's blocks b0 .. b1 - 1."""
    return max(b0, first[i]) - first[i], min(b1, first[i + 1]) - first[i]


@njit(cache=True, inline="always", error_model="numpy")
def state_at(a, col):
    """(codes as uint8, scales as uint16 words) of the state whose address and length pairs
    start at column col of a member's row of host.MemberTable.arrays."""
    return view_u8(0, a[col], a[col + 1]), view_u16(0, a[col + 2], a[col + 3])
