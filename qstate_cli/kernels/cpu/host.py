"""Host side of the CPU path: what a launch steps, as tables of the torch tensors' addresses.

No numba here. A CpuBatch is the CPU counterpart of launch.Batch: the members of one launch
and the seed of their random streams. The optimizers' kernels step every member in one call
(member_table, run_members): a MemberTable holds each member's arrays as (address, length)
pairs, its first block in the launch and its stream keys; the kernel views the memory in
place (native.view_like: fp32 as float32, bf16 as its uint16 bit patterns), so parameters,
codes and scales are updated exactly where the reference keeps them. The table is cached
per set of addresses, so a step pays no per-tensor numpy views, hashes or kernel dispatch
(docs/cpu.md, "One launch per step"); the replay's kernels take numpy views (Tensor.numpy).

Threads: a kernel steps a range of blocks with the GIL released (numba nogil); run_blocks
splits a tensor's blocks (run_members: a launch's blocks, across its tensors) into
contiguous ranges of at least MIN_THREAD_ELEMENTS elements, one per thread of a pool of
torch.get_num_threads() threads, or torch_aside's count while torch's own ops run on one.
A small layout's replay splits its main kernels over numba's OpenMP team instead (team.py).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import numpy as np
import torch

from ...quant.codebooks import codebook
from ...quant.hash import GOLDEN, hash32
from ...runtime import torch_threads
from ..launch import Member, StateLayout, stream_key

MIN_STEP = 2.0 ** -126
MIN_THREAD_ELEMENTS = 1 << 16  # a smaller tensor is stepped by one thread (a task costs ~20 us)
_pools: dict[int, ThreadPoolExecutor] = {}
VALUE_DTYPES = (torch.float32, torch.bfloat16)  # parameter / gradient dtypes the CPU path covers


@dataclass
class CpuBatch:
    """The tensors of one CPU launch and the seed of their random streams."""

    members: list[Member]
    seed: int = 0
    tables: dict = field(default_factory=dict)  # member_table's, for a batch stepped again (optim/fused.SteadyPlan)

    def stream_key(self, member: Member, state_id: int) -> int:
        return stream_key(self.seed, member.tensor_id, state_id)


@dataclass
class MemberTable:
    """What a multi-tensor kernel reads of a launch's members (the CPU counterpart of
    launch.Batch; raw addresses: the caller keeps the tensors alive while it launches).

    arrays  int64 [n, 2k]: address and length (in the kernel's element type) of each of a
            member's k arrays, in the order the launcher's `columns` gives them
    first   int64 [n + 1]: member i's blocks are first[i] .. first[i + 1] - 1 of the launch
    skeys   uint32 [n, states]: the stream key of each state (launch.stream_key)
    numel   elements in all"""

    arrays: np.ndarray
    first: np.ndarray
    skeys: np.ndarray
    numel: int


MAX_CACHED_TABLES = 32
_tables: dict[tuple, MemberTable] = {}


def member_table(batch: CpuBatch, columns: Callable, block: int, states: int,
                 grad_column: int = 1) -> MemberTable:
    """The table of `batch`'s members; columns(member) -> ((tensor, bytes per element of the
    kernel's view), ...), the gradient at grad_column. Cached per (columns, block, seed,
    states, each member's other addresses, size, tensor id and dtypes): a step with the same
    parameters and states builds nothing, and only writes the gradients' addresses (a
    backward after zero_grad(set_to_none=True) allocates them anew). A batch launched again
    (optim/fused.SteadyPlan: the same members, their tensors other than the gradients the same
    objects at the same addresses) reuses its own last table without building the key."""
    mine = batch.tables.get((columns, block, states, grad_column))
    if mine is not None:
        mine.arrays[:, 2 * grad_column] = [m.grad.data_ptr() for m in batch.members]  # the gradient column
        return mine
    cols = [columns(m) for m in batch.members]
    key = (columns, int(block), batch.seed, states) + tuple(
        (tuple(t.data_ptr() for j, (t, _) in enumerate(col) if j != grad_column), m.param.numel(), m.tensor_id,
         m.param.dtype, m.grad.dtype) for m, col in zip(batch.members, cols))
    table = _tables.get(key)
    if table is None:
        if len({(m.param.dtype, m.grad.dtype) for m in batch.members}) > 1:
            raise ValueError("a CPU launch's parameters (and gradients) share one dtype")
        if any(m.grad.numel() != m.param.numel() for m in batch.members):
            raise ValueError("a CPU launch needs each gradient the size of its parameter")
        if len(_tables) >= MAX_CACHED_TABLES:
            _tables.clear()
        arrays = [[x for t, size in col for x in (t.data_ptr(), t.numel() * t.element_size() // size)] for col in cols]
        counts = [-(-m.param.numel() // block) for m in batch.members]
        table = _tables[key] = MemberTable(
            arrays=np.array(arrays, np.int64).reshape(len(cols), -1),
            first=np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64),
            skeys=np.array([[batch.stream_key(m, s) for s in range(states)] for m in batch.members],
                           np.uint32).reshape(len(cols), states),
            numel=sum(m.param.numel() for m in batch.members))
    else:
        table.arrays[:, 2 * grad_column] = [col[grad_column][0].data_ptr() for col in cols]
    batch.tables[(columns, block, states, grad_column)] = table
    return table


def run_members(kernel, table: MemberTable, block: int, args: tuple) -> np.ndarray:
    """kernel(b0, b1, part, arrays, first, skeys, bad, *args) over the launch's blocks in
    contiguous ranges, one per thread (parts_of the launch's elements: the ranges cross
    tensors); returns each member's non-finite count (the kernels add theirs to bad[part, i])."""
    parts = parts_of(table.numel)
    bad = np.zeros((parts, len(table.first) - 1), np.int64)
    run_parts(kernel, int(table.first[-1]) * block, block, (table.arrays, table.first, table.skeys, bad) + args, parts)
    return bad.sum(axis=0)


def add_nonfinite(batch: CpuBatch, bad: np.ndarray) -> None:
    """member.nonfinite += its count, for the members whose gradient had any."""
    for i in np.flatnonzero(bad):
        batch.members[int(i)].nonfinite += int(bad[i])


F32, U16 = np.empty(0, np.float32), np.empty(0, np.uint16)  # the kernels' value arrays (view_like)


def like(t: torch.Tensor) -> np.ndarray:
    """An empty array of the type the kernels view `t` as: float32, or bf16's uint16 bit patterns."""
    return U16 if t.dtype == torch.bfloat16 else F32


def keys(key: int, step: int) -> list[int]:
    """[k1, k2] of a stream key at a step (quant/hash.stream_keys: k1 = hash32(key ^ step)); the
    optimizers' kernels compute the same in codec.step_keys (tests/test_kernels_cpu_launch.py)."""
    k1 = hash32(key ^ (int(step) & 0xFFFFFFFF))
    return [k1, hash32(k1 ^ GOLDEN)]


def step_words(*steps: int) -> np.ndarray:
    """Step counters as the uint32 words the kernels key their random streams with (codec.step_keys)."""
    return np.array([int(s) & 0xFFFFFFFF for s in steps], np.uint32)


def threads() -> int:
    """Threads the kernels split a tensor over: torch's intra-op count, or torch_aside's."""
    return _ASIDE[-1] if _ASIDE else max(1, torch.get_num_threads())


_ASIDE: list[int] = []  # torch_aside's counts, innermost last (process-wide, as torch's own count is)


@contextmanager
def torch_aside(n: int):
    """Inside the block torch's own ops run on one intra-op thread while the kernels keep n
    (threads()). torch's OpenMP workers spin after each parallel op (libgomp's default
    wait policy), on the very cores the kernels' threads need next: on the 2-core Xeon a
    replay of 2**20 elements, which alternates torch's ops and the kernels, ran 1.3-1.45x
    slower than with torch on one thread (docs/diagnose.md, "torch's threads spin").
    Elementwise torch ops can still use every core, each thread's range its own calls
    (replay_gauss.gauss_range); a sum to one value (torch_sum.sum64) keeps the order of
    torch's at n threads."""
    _ASIDE.append(int(n))
    try:
        with torch_threads(1):
            yield
    finally:
        _ASIDE.pop()


def parts_of(numel: int) -> int:
    """How many threads run_blocks splits `numel` elements over (>= MIN_THREAD_ELEMENTS each)."""
    return max(1, min(threads(), int(numel) // MIN_THREAD_ELEMENTS))


def run_blocks(kernel, numel: int, block: int, args: tuple) -> int:
    """kernel(b0, b1, *args) over blocks [0, ceil(numel / block)) in contiguous ranges, one
    per thread; returns the sum of what the calls return (non-finite counts)."""
    return run_parts(lambda b0, b1, part, *rest: kernel(b0, b1, *rest), numel, block, args)


def run_parts(kernel, numel: int, block: int, args: tuple, parts: int | None = None) -> int:
    """run_blocks, with each range's index: kernel(b0, b1, part, *args), part in
    [0, parts) (a thread's own row of a shared output); parts defaults to parts_of(numel).
    A caller that sized a per-part output passes the count it sized it with, so the
    kernel (which does not bound-check) never sees a part past it."""
    nblocks = -(-int(numel) // int(block))
    parts = parts_of(numel) if parts is None else max(1, int(parts))
    if parts == 1:
        return int(kernel(0, nblocks, 0, *args))
    pool = _pool(parts)
    edges = [nblocks * i // parts for i in range(parts + 1)]
    futures = [pool.submit(kernel, edges[i], edges[i + 1], i, *args) for i in range(1, parts)]
    try:
        total = int(kernel(edges[0], edges[1], 0, *args))  # the first range on this thread
        return total + sum(int(f.result()) for f in futures)
    except BaseException:
        _finish(futures)
        raise


def _finish(futures) -> None:
    """Wait until every range is done, through any further Ctrl-C: the kernels write into the
    caller's tensors by raw address, so an exception (a KeyboardInterrupt between two calls)
    must not unwind the frames that own those tensors while a worker still writes (it
    corrupted the heap: "corrupted double-linked list", exit 134 instead of 130)."""
    while True:
        try:
            wait(futures)
            return
        except KeyboardInterrupt:
            continue  # the exception already on its way out is the one the caller sees


def _pool(parts: int) -> ThreadPoolExecutor:
    pool = _pools.get(parts)
    if pool is None:
        pool = _pools[parts] = ThreadPoolExecutor(parts, thread_name_prefix="qstate-cpu")
    return pool


NOZERO_KIND = 2  # launch.StateLayout.kind of the no-zero linear map (lin4nz, lin8nz): a table here
MINIFLOAT_KIND = 3  # launch.StateLayout.kind of a minifloat: codec.py's FLOAT (2)


@lru_cache(maxsize=None)
def _layout(layout: StateLayout):
    # codec.py's kinds: the no-zero map is a code book with UNIT set; a minifloat is FLOAT
    kind = {NOZERO_KIND: 1, MINIFLOAT_KIND: 2}.get(layout.kind, layout.kind)
    lay = (int(kind), int(layout.bits), int(layout.signed), int(layout.table_len), int(layout.rounding),
           int(layout.sqrt), int(layout.sbf16), _unit(layout))  # the kernels' compile-time constants
    lim = np.array([layout.top, layout.top * MIN_STEP], np.float32)
    return lay, lim


def _unit(layout: StateLayout) -> int:
    """2**bits if the code book is exactly {1, ..., 2**bits} / 2**bits (codec.py: UNIT), else 0."""
    if layout.kind not in (1, NOZERO_KIND):
        return 0
    unit = 1 << layout.bits
    table = codebook(layout.table_name)
    return unit if list(table) == [(i + 1) / unit for i in range(unit)] else 0


@lru_cache(maxsize=None)
def _table(name: str) -> np.ndarray:
    return np.array(codebook(name), np.float32)


def layout_arrays(layout: StateLayout, table: torch.Tensor | None):
    """(lay: 12 ints, lim fp32 [2], table fp32) of a state layout (codec.py; the kernels are
    compiled per lay, which they hold as constants: adamw.kernel_for, ...). The Triton
    kernels compute the no-zero map (kind 2) and get no table; the codec reads its entries.
    A code book searched by the codec (kind 1, UNIT 0) comes with its search buckets
    appended (search_table, prepared once per code book); lay's last 4 ints say where. For a
    minifloat (kind 3) they are its mantissa bits, emin and largest ordinal (codec's MAN, EMIN,
    MAXORD), and 0."""
    lay, lim = _layout(layout)
    if table is not None:
        tab = table.detach().cpu().numpy()
    elif layout.kind == NOZERO_KIND:
        tab = _table(layout.table_name)
    else:
        tab = np.zeros(2, np.float32)
    if lay[0] == 1 and not lay[7]:  # KIND == TABLE, UNIT == 0 (codec.py): searched
        tab, search = search_table(np.ascontiguousarray(tab, np.float32).tobytes())
        return lay + search, lim, tab
    if layout.kind == MINIFLOAT_KIND:  # codec.py's MAN, EMIN, MAXORD
        return lay + (int(layout.man_bits), int(layout.emin), int(layout.max_ordinal), 0), lim, tab
    return lay + (0, 0, 0, 0), lim, tab


SEARCH_MIN_EXP = -30  # magnitudes below 2**-30 share the buckets next to 0
SEARCH_LO = int(np.float32(2.0 ** SEARCH_MIN_EXP).view(np.uint32))  # bits of 2**-30
SEARCH_HI = int(np.float32(1.0).view(np.uint32))  # bits of 1.0


@lru_cache(maxsize=None)
def search_table(table_bytes: bytes) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """(the code book with its search buckets, (SHIFT, NM, STEPS, OFF)) for search.floor_code,
    exact for any sorted fp32 code book (given as its bytes, so each is prepared once):

    mag = clamp(bits(|v|), LO = bits(2**-30), HI = bits(1.0)); i = (mag - LO) >> SHIFT, with
    SHIFT = 23 - m (2**m buckets per binade); bucket NM + i for v >= +0, NM - 1 - i for a set
    sign bit. bucket[j] = #(table <= the least value of bucket j) (first buckets: all magnitudes
    below LO; last: all above 1), and STEPS = the most entries any bucket holds above its least
    value, so bucket[j] + STEPS steps of `count += table[count] <= v` reach #(table <= v).
    m is the smallest of 3..7 with STEPS <= 1, else 7 (de8: 6, de8u: 7; at 6 de8u took 2
    steps, 1.9 against 1.45 ns per value in stages). The array returned holds the table padded
    with +inf to OFF = max(NT, 256) + STEPS + 1 entries, rounded up to even (every code and
    every step reads an entry), then the 2 NM buckets, each a pair of fp32 slots: its count as
    an int32 bit pattern, then table[count], the entry its first step compares, so one 8-byte
    load (native.pair_at) gives both (de8u: 60 kB). One array per code book, so the kernels
    take it where they took the table."""
    tab = np.frombuffer(table_bytes, np.float32)
    lo, hi = SEARCH_LO, SEARCH_HI
    for m in range(3, 8):
        s = 23 - m
        nm = ((hi - lo) >> s) + 1
        i = np.arange(nm, dtype=np.int64)
        least = np.where(i == 0, 0, lo + (i << s)).astype(np.uint32).view(np.float32)
        most = np.where(i == nm - 1, 0x7F800000, lo + ((i + 1) << s) - 1).astype(np.uint32).view(np.float32)
        vmin = np.concatenate([-most[::-1], least])
        vmax = np.concatenate([-least[::-1], most])
        c0 = np.searchsorted(tab, vmin, side="right")
        steps = int((np.searchsorted(tab, vmax, side="right") - c0).max()) if tab.size else 0
        if steps <= 1:
            break
    off = max(tab.size, 256) + steps + 1
    off += off & 1
    out = np.full(off + 2 * c0.size, np.inf, np.float32)
    out[:tab.size] = tab
    out[off::2] = c0.astype(np.int32).view(np.float32)
    out[off + 1::2] = out[c0]
    return out, (s, nm, steps, off)
