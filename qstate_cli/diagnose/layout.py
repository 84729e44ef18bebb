"""The replay's flat layout: every recorded element of every tensor in one fp32 vector.

Each tensor's recorded blocks are concatenated into a *segment*; a segment's length is
padded with zeros to a multiple of `unit` (the largest block size the replayed
configurations use, a power of two dividing the trace's 2048-element blocks), so each
quantization block of the layout holds exactly the elements of one block of the full
tensor. One `encode` call then quantizes all tensors at once, block for block as the
reference optimizer would. Padding elements are held at zero (a zero never changes a
block's absmax), and counted nowhere.

Random streams (LayoutStream): the reference draws stochastic-rounding bits from counter
= flat element index, and BReD dithers from counter = block index, in stream
(seed, tensor id, state id, step). `quant.encode` hashes counter c = 0, 1, ... of the
layout as hash32(hash32(c ^ k1) ^ k2). Handing it, per position, the key
k1' = k1[tensor] ^ c ^ c_orig makes c ^ k1' = k1[tensor] ^ c_orig: exactly the bits the
reference draws for that element or block of that tensor. Stochastic rounding hashes
counter i >> 1 for element i and takes half (i & 1) of the bits (hash.uniform16), so the
element fold is (c >> 1) ^ (c_orig >> 1); a segment starts on an even position and its
recorded blocks on even element indices, so c and c_orig agree in parity (checked). So a
replay of a fully recorded trace stores the same codes as the optimizer did, bit for bit
(tested).

A part (`part=(rank, ranks)`, torchrun's element split, distributed.py): the unit blocks
u0..u1-1 of the whole layout (split_units), positions u0*unit .. u1*unit - 1. A unit never straddles
two tensors (segments are padded to whole units), so every quantization block and every
dither block of a part is a block of the whole layout; the keys above fold in the element's
index in its own tensor, so a part draws the same random bits as the whole layout does.
`offsets` / `lengths` stay the whole layout's (per tensor); `pieces` say which of each
tensor's recorded elements the part holds; n, n_units, n_valid, valid, unit_tensor and
element_index are the part's.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import QstateError
from ..quant import hash as qhash
from ..quant.quantizer import Stream
from ..trace.schema import BLOCK, Trace


STAGE_BYTES = 4 << 20  # the CPU gather's staged rows (Layout.gradients): at most this many bytes
STAGE_ROWS = 64  # and at most this many trace rows
STAGE_PIECE = 1 << 15  # staged only where the pieces average fewer elements (a copy's ~7 us then dominates)


class Layout:
    def __init__(self, trace: Trace, unit: int, device, part: tuple[int, int] | None = None, upload: bool = True):
        if unit < 1 or BLOCK % unit:
            raise QstateError(f"block size {unit} does not divide the trace's {BLOCK}-element blocks; "
                              f"use a power of two from 32 to {BLOCK}")
        self.trace, self.unit, self.device = trace, unit, torch.device(device)
        self.offsets, self.lengths = [], []  # per tensor, in the whole layout
        n = 0
        for t in trace.tensors:
            self.offsets.append(n)
            self.lengths.append(t.n_recorded)
            n += -(-t.n_recorded // unit) * unit
        self.total_n, self.total_units, self.total_valid = n, n // unit, sum(self.lengths)
        u0, u1 = split_units(self.total_units, part[1])[part[0]] if part is not None else (0, self.total_units)
        self.units = (u0, u1)
        self.start = u0 * unit  # first position of the part in the whole layout
        a, b = u0 * unit, u1 * unit
        self.n, self.n_units = b - a, u1 - u0
        self.pieces = []  # (tensor, first recorded element, count, position in the part)
        for i, (o, ln) in enumerate(zip(self.offsets, self.lengths)):
            lo, hi = max(o, a), min(o + ln, b)
            if lo < hi:
                self.pieces.append((i, lo - o, hi - lo, lo - a))
        self.n_valid = sum(p[2] for p in self.pieces)
        seg = torch.empty(self.n_units, dtype=torch.int64)
        orig = torch.zeros(self.n, dtype=torch.int64)
        valid = torch.zeros(self.n, dtype=torch.bool)
        for i, t in enumerate(trace.tensors):
            o, ln = self.offsets[i], self.lengths[i]
            s0, s1 = max(o // unit, u0), min((o + -(-ln // unit) * unit) // unit, u1)
            if s0 < s1:
                seg[s0 - u0: s1 - u0] = i
        for i, first, count, at in self.pieces:
            orig[at: at + count] = trace.tensors[i].element_index()[first: first + count]
            valid[at: at + count] = True
        self.unit_tensor = seg.to(self.device)  # tensor index of every unit block
        self.element_index = orig  # flat index in its tensor of every layout position (host)
        self.valid = valid.to(self.device) if self.n_valid < self.n else None  # None: no padding
        self.tensor_ids = [t.index for t in trace.tensors]
        self.n_tensors = len(trace.tensors)
        self._buf = torch.zeros(self.n, dtype=torch.float32, device=self.device)
        self.grads = {i: trace.tensors[i].grads[:, first: first + count] for i, first, count, _ in self.pieces}
        if upload and self.device.type == "cuda" and _fits_on_device(list(self.grads.values()), self.device):
            # one upload; per-step gathers stay on the GPU
            self.grads = {i: g.to(self.device) for i, g in self.grads.items()}
        self._streams: dict[tuple, LayoutStream] = {}
        # CPU: trace rows gathered ahead, `stage_k` at a time (gradients; 1: none, a row per step)
        dtypes = {g.dtype for g in self.grads.values()}
        self._stage_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        row_bytes = max(1, self.n * self._stage_dtype.itemsize)
        small = self.n_valid <= STAGE_PIECE * len(self.pieces)
        self.stage_k = max(1, min(STAGE_ROWS, STAGE_BYTES // row_bytes)) if self.device.type == "cpu" and small else 1
        self._stage, self._stage_rows = None, range(0)

    @property
    def whole(self) -> bool:
        return self.units == (0, self.total_units)

    def gradients(self, row: int) -> torch.Tensor:
        """The gradient of every layout position at trace row `row` (fp32, a fresh tensor;
        padding 0). On CPU the rows are gathered a chunk at a time into a staging block
        (each tensor's piece copied once per chunk: a copy costs ~7 us, and the demo trace
        has 29 pieces), and a row is one copy out of it: the same values, since every copy
        is exact (bf16 or fp32 into fp32)."""
        if self.stage_k < 2 or not self.pieces:  # CUDA, large pieces, or a row too large to stage several
            buf = torch.zeros_like(self._buf) if self.valid is not None else torch.empty_like(self._buf)
            for i, _, count, at in self.pieces:
                buf[at: at + count].copy_(self.grads[i][row], non_blocking=True)
            return buf
        if row not in self._stage_rows:
            self._gather_rows(row)
        return self._stage[row - self._stage_rows.start].to(torch.float32, copy=True)

    def _gather_rows(self, row: int) -> None:
        """Stage trace rows row .. row + k - 1 (k = stage_k, fewer where the trace ends), in
        the gradients' dtype (fp32 where the tensors' differ)."""
        if self._stage is None:
            self._stage = torch.zeros(self.stage_k, self.n, dtype=self._stage_dtype)  # padding columns stay 0
        steps = next(iter(self.grads.values())).shape[0]
        k = max(1, min(self._stage.shape[0], steps - row))
        for i, _, count, at in self.pieces:
            self._stage[:k, at: at + count].copy_(self.grads[i][row: row + k])
        self._stage_rows = range(row, row + k)

    def block_padded_units(self) -> tuple[np.ndarray, int]:
        """Where each unit of the whole layout sits when every segment is padded to whole trace
        blocks (BLOCK elements) instead of units, and that arrangement's length in units. The
        dimension statistic chunks this arrangement, so its chunks, and with them its numbers, are
        the same whatever unit the replayed configurations set (stats.dimension_ms)."""
        at, canon = [], 0
        for ln in self.lengths:
            k = -(-ln // self.unit)  # this tensor's units
            at.append(np.arange(k) + canon // self.unit)
            canon += -(-ln // BLOCK) * BLOCK
        return (np.concatenate(at) if at else np.zeros(0, np.int64)), canon // self.unit

    def per_tensor(self, unit_sums: torch.Tensor) -> torch.Tensor:
        """Sum per-unit values [..., n_units] into per-tensor values [..., n_tensors]."""
        out = torch.zeros(*unit_sums.shape[:-1], self.n_tensors, dtype=unit_sums.dtype, device=unit_sums.device)
        return out.index_add_(-1, self.unit_tensor, unit_sums)

    def stream(self, seed: int, state_id: int, counter: str, block: int) -> "LayoutStream":
        """The (shared, cached) stream of one state for one counter layout."""
        key = (seed, state_id, counter, block)
        if key not in self._streams:
            self._streams[key] = LayoutStream(self, seed, state_id, counter, block)
        return self._streams[key]


def _fits_on_device(grads, device, fraction: float = 0.25) -> bool:
    """Whether the recorded gradients take under `fraction` of the device's free memory."""
    free, _ = torch.cuda.mem_get_info(device)
    return sum(g.numel() * g.element_size() for g in grads) < fraction * free


class LayoutStream:
    """A `quant.Stream` stand-in whose keys are per counter position (see module docstring).

    counter = "element" (stochastic rounding) or "block" (BReD, blocks of `block`)."""

    offset = 0  # quant.Stream.offset: the layout's counters are folded into the keys instead
    element_uniforms = Stream.element_uniforms  # uniform16 of keys(step) at counters 0 .. n - 1

    def __init__(self, layout: Layout, seed: int, state_id: int, counter: str, block: int):
        self.seed, self.state_id, self.layout = seed, state_id, layout
        idx = layout.element_index
        if counter == "element":  # hash.uniform16: element i takes half (i & 1) of hash counter i >> 1
            pos = torch.arange(layout.n, dtype=torch.int64)
            orig, owner = idx, layout.unit_tensor.cpu().repeat_interleave(layout.unit)
            held = layout.valid.cpu() if layout.valid is not None else torch.ones(layout.n, dtype=torch.bool)
            if not torch.equal((pos & 1)[held], (orig & 1)[held]):  # segments start on even positions
                raise QstateError("layout positions and tensor elements differ in parity: the stochastic-rounding "
                                  "bits would not be the optimizer's")
            pos, orig = pos >> 1, orig >> 1
        else:
            pos = torch.arange(layout.n // block, dtype=torch.int64)
            orig = idx[::block] // block
            owner = layout.unit_tensor.cpu().repeat_interleave(layout.unit // block)
        self.fold = (pos ^ orig).to(layout.device)
        self.owner = owner.to(layout.device)
        # hash.stream_keys, split: the per-(seed, tensor, state) part once, the step part per step
        base = [qhash.hash32(qhash.hash32(qhash.hash32(seed & qhash.MASK32) ^ (tid & qhash.MASK32)) ^ state_id)
                for tid in layout.tensor_ids]
        self.base = torch.tensor(base, dtype=torch.int64)
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keys(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k1', k2') per counter position for `step` (cached for the last two steps)."""
        if step not in self._cache:
            k1 = qhash.hash32(self.base ^ (int(step) & qhash.MASK32))  # = stream_keys(...)[0] per tensor
            k2 = qhash.hash32(k1 ^ qhash.GOLDEN)
            k1, k2 = k1.to(self.layout.device), k2.to(self.layout.device)
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[step] = (k1[self.owner] ^ self.fold, k2[self.owner])
        return self._cache[step]


def split_units(n_units: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous unit ranges, one per rank, in rank order: rank r holds units
    floor(r U / N) .. floor((r + 1) U / N) - 1 (sizes differ by at most one; with more
    ranks than units some ranges are empty)."""
    return [(r * n_units // parts, (r + 1) * n_units // parts) for r in range(parts)]
