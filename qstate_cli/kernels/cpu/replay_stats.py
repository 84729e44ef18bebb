"""The replay's fused code statistics on CPU: StateStats.observe's integer-valued part
(diagnose/stats.py) in one numba pass per unit block, on the packed codes the fused codec
(replay.py) just stored, instead of ~15 torch ops each its own pass over memory.

Per element i of the layout at replay step t (x the nominal fp32 state, prev / new the
values read back before / after, code the stored code unpacked from the packed storage):

    nominal_i    = x_i != prev_i                  stall_i      = nominal_i and new_i == prev_i
    code_stall_i = nominal_i and code_i == prev_code_i      err_i = new_i - shadow_i, err_i^2 (fp32)
    per unit u:  #stall, #nominal, #code stall (fp32: exact integers, a unit holds <= 2048
                 elements, so equal to torch's fp32 sums of the booleans)
    last_change_i = t where code_i != prev_code_i;  prev_code_i = code_i
    per code:    counts[bin * 5 + nominal * (1 + stall + 2 x code stall)] += 1, bin = the
                 code (4 or 8 bits) or a 16-bit float's binade, (code >> mantissa bits) &
                 (2**exponent bits - 1) (StateStats' "binade" mode)

exactly as StateStats' torch path computes them (padding included: it counts what the
torch path counts), so every record stays bit-identical; the float sums of the error
e = new - shadow and of e * e per unit are added in the same pass, in torch's own order
(torch_sum.py: torch sums them where no order is found), and StateStats' per-step series
follows in one more numba call (torch_sum.add_step). A snapshot's staleness histogram, bin
min(t - last_change_i + 1, top) per element (0 for padding), is a second kernel
(staleness_counts), and the per-unit parts of its dimension statistic a third
(dimension_sums: fp64 pair sums, squares and row sums in torch's order, so the same bits);
their per-tensor sums stay torch's. Codes of 4 or 8 bits, packed in uint8, or the 16-bit
patterns of an unscaled bf16 / fp16 state (int16, one per element: replay.py's replay_codec16).
Threads: parallel over unit ranges (host.run_parts), one histogram row per thread, summed.
No numba at import: the kernel (replay_stats_kernel.py) is imported on first use.
"""
from __future__ import annotations

import numpy as np
import torch

from . import torch_sum
from .host import parts_of, run_parts
from .layout import hist_copies

_NO_ROWS = np.zeros((2, 0), np.float32)  # the kernel's err rows when it writes none

_KERNELS: list = []
NO_VALID = np.ones(1, np.bool_)  # state_counts' valid where the layout has no padding
NO_STALE = np.zeros((1, 1, 0), np.int64)  # state_counts' stale off: no staleness histogram in its pass


def _kernel(which: int = 0):
    """0: state_counts, 1: staleness_counts, 2: dimension_sums, 3: gradient_sums (imports
    numba; compiled on first use, cached on disk)."""
    if not _KERNELS:
        from .replay_stats_kernel import dimension_sums, gradient_sums, staleness_counts, state_counts
        _KERNELS.extend([state_counts, staleness_counts, dimension_sums, gradient_sums])
    return _KERNELS[which]


def prev_code_dtype(bits: int, fused: bool) -> torch.dtype:
    """The dtype StateStats keeps the previous step's codes in: uint8 where the fused path counts
    codes of at most 8 bits (state_counts reads and writes it every step: 2 bytes an element
    where int32 moved 8), else int32 (torch's codes, a 16-bit float's patterns)."""
    return torch.uint8 if fused and bits <= 8 else torch.int32


class CodeCounts:
    """The fused counterpart of StateStats' comparisons, per-unit counts, per-code counts and
    last_change / prev_code updates for one state (module docstring)."""

    def __init__(self, bits: int, n: int, unit: int, n_codes: int, shift: int = 0):
        """n_codes bins (a power of two), each code's bin (code >> shift) & (n_codes - 1): the
        code (shift 0, n_codes 2**bits) or a 16-bit float's binade (shift its mantissa bits)."""
        if bits not in (4, 8, 16) or n % unit or unit % 2 or n_codes & (n_codes - 1) or not 0 <= shift < bits:
            raise ValueError(f"fused code statistics need 4-, 8- or 16-bit codes on whole even units and "
                             f"a power-of-two number of bins (got {bits} bits, {n} elements, unit {unit}, "
                             f"{n_codes} bins, shift {shift})")
        self.bits, self.n, self.unit, self.shift, self.mask = bits, n, unit, shift, n_codes - 1
        self.hist = np.zeros((parts_of(n), hist_copies(bits), n_codes * 5), np.int64)  # per thread; summed in `codes`

    def observe(self, step: int, x: torch.Tensor, prev: torch.Tensor, new: torch.Tensor, storage: torch.Tensor,
                prev_code: torch.Tensor, last_change: torch.Tensor, shadow: torch.Tensor,
                shadow_x2_units: torch.Tensor, keep_err: bool = False):
        """(fp32 [6, n_units]: this step's per-unit rows of StateStats (S_*): the sums of the
        error e = new - shadow and of e * e (each one fp32 op as torch's, summed in torch's
        order: torch_sum.py), #stall, #nominal, shadow_x2_units, #code stall; fp32 [n]: e,
        or None unless keep_err); updates prev_code (int32 [n], or uint8 [n] for codes of at most
        8 bits: StateStats' prev_code_dtype) and last_change (int32 [n]) in place and adds this
        step's per-code counts."""
        n_units = self.n // self.unit
        if prev_code.dtype != prev_code_dtype(self.bits, True) or last_change.dtype != torch.int32:
            raise ValueError(f"prev_code must be {prev_code_dtype(self.bits, True)} and last_change int32")
        sizes = (x.numel(), prev.numel(), new.numel(), prev_code.numel(), last_change.numel(), shadow.numel())
        dtype, per = (torch.int16, 1) if self.bits == 16 else (torch.uint8, self.bits / 8)
        if (set(sizes) != {self.n} or storage.dtype != dtype or storage.numel() != self.n * per
                or shadow_x2_units.numel() != n_units):  # the kernel does not bound-check
            raise ValueError(f"fused code statistics of {self.n} elements got sizes {sizes}, "
                             f"{storage.numel()} {storage.dtype} codes and {shadow_x2_units.numel()} units")
        codes = storage.reshape(-1).numpy()
        if self.bits == 16:
            codes = codes.view(np.uint16)  # the unsigned pattern, as stats.stored_code reads it
        parts = parts_of(self.n)
        self.ensure_parts(parts)
        sums = torch.empty(6, n_units, dtype=torch.float32)
        rows = sums.numpy()
        rows[4] = _f32(shadow_x2_units)
        lanes = (torch_sum.lanes() or (0,))[0]
        err = torch.empty(2, self.n, dtype=torch.float32) if lanes == 0 or keep_err else None  # row 1: lanes 0
        run_parts(_kernel(0), self.n, self.unit,
                  (_f32(x), _f32(prev), _f32(new), codes, self.bits, prev_code.numpy(), last_change.numpy(),
                   int(step), self.unit, rows, self.hist, _f32(shadow),
                   _NO_ROWS if err is None else err.numpy(), self.shift, self.mask, lanes, bool(keep_err),
                   NO_VALID, NO_STALE),
                  parts=parts)
        if lanes == 0:  # torch sums what the kernel wrote
            sums[:2] = err.view(2, -1, self.unit).sum(2, dtype=torch.float32)
        return sums, (err[0] if keep_err else None)

    def ensure_parts(self, parts: int) -> None:
        """Histogram copies for `parts` threads (replay_stats_kernel.state_counts): more if there
        are more threads than at the start."""
        if parts > self.hist.shape[0]:
            self.hist = np.concatenate([self.hist, np.zeros((parts - self.hist.shape[0],) + self.hist.shape[1:],
                                                            np.int64)])

    def staleness(self, step: int, last_change: torch.Tensor, valid: torch.Tensor | None, nbins: int) -> torch.Tensor:
        """int64 [nbins]: the staleness histogram of a snapshot at `step`, per element bin
        min(step - last_change + 1, nbins - 1), padding (valid False) in bin 0: StateStats'
        three passes and a scatter_add_ in one pass (integers, so the same counts)."""
        if last_change.dtype != torch.int32 or last_change.numel() != self.n or (
                valid is not None and (valid.dtype != torch.bool or valid.numel() != self.n)):
            raise ValueError(f"a staleness histogram of {self.n} elements needs int32 last_change and bool valid")
        parts = parts_of(self.n)
        hist = np.zeros((parts, int(nbins)), np.int64)
        mask = valid.numpy() if valid is not None else np.ones(1, np.bool_)
        run_parts(_kernel(1), self.n, self.unit, (last_change.numpy(), mask, int(step), self.unit, hist), parts=parts)
        return torch.from_numpy(hist.sum(0))

    def dimension(self, err: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A snapshot's per-unit parts of the dimension statistic from its fp32 errors err [n]
        (replay_stats_kernel.dimension_sums): fp64 [levels, n_units], the sums of squared
        chunk sums of 1, 2, ..., 2**(levels - 1) errors, and fp64 [n_units], the unit's error
        sum; the bits of StateStats._snapshot's torch ops. None where torch's order of an fp64
        row sum was not found (torch_sum.f64_row_lanes) or the unit does not halve `levels` times."""
        lanes = torch_sum.f64_row_lanes()
        if lanes is None or self.unit % (1 << levels):
            return None
        if err.dtype != torch.float32 or err.numel() != self.n or not err.is_contiguous():
            raise ValueError(f"a dimension snapshot of {self.n} elements needs contiguous fp32 errors")
        n_units = self.n // self.unit
        small = torch.empty(levels, n_units, dtype=torch.float64)
        tail = torch.empty(n_units, dtype=torch.float64)
        run_parts(_kernel(2), self.n, self.unit, (err.numpy(), self.unit, int(levels), lanes, small.numpy(),
                                                  tail.numpy()))
        return small, tail

    def codes(self) -> torch.Tensor:
        """int64 [n_codes * 5]: the per-code counts over every step observed."""
        return torch.from_numpy(self.hist.sum((0, 1)))


GRADIENT_BLOCK = 4096  # elements: gradient_step's ranges are multiples of it (run_parts)


def gradient_step(g: torch.Tensor, valid: torch.Tensor | None, g2: torch.Tensor, g4: torch.Tensor,
                  sq: torch.Tensor) -> tuple[float, float]:
    """GradientStats.observe of one step's fp32 gradients g [n] in one numba pass
    (replay_stats_kernel.gradient_sums, a contiguous range per thread: host.run_parts; one
    thread until 2**17 elements): g2 += g**2 and g4 += g**4 (fp64 [n], in place), and
    (the sum of g**2, #zeros among the recorded elements) with torch's bits (torch_sum.sum64);
    sq: fp64 [n] scratch."""
    n = g.numel()
    if (g.dtype != torch.float32 or not g.is_contiguous() or any(
            t.dtype != torch.float64 or t.numel() != n or not t.is_contiguous() for t in (g2, g4, sq))
            or (valid is not None and (valid.dtype != torch.bool or valid.numel() != n))):
        raise ValueError(f"gradient statistics of {n} elements need fp32 g, fp64 sums and a bool mask")
    mask = valid.numpy() if valid is not None else np.ones(1, np.bool_)
    zeros = run_parts(_kernel(3), n, GRADIENT_BLOCK, (GRADIENT_BLOCK, g.numpy(), mask, g2.numpy(), g4.numpy(),
                                                    sq.numpy()))
    return torch_sum.sum64(sq), float(zeros)


def _f32(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous() and not t.requires_grad:
        return t.numpy()  # the replay's states: no copy, no checks beyond these
    t = t.detach().reshape(-1)
    if t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(torch.float32).contiguous()
    return t.numpy()
