"""The replay's fused staleness model on CPU: diagnose/staleness.predict's per-element part
for a state the fused codec stores (replay.py), in one numba pass per quantization block,
instead of ~60 torch ops each its own pass over memory.

Per element i at a model step (x_hat the stored value before the step, x_new its fp32 value
after, s the fp32 shadow before; staleness.windows gives each cell (down, up) from the
grid point nearest to the value, on the block's delta = absmax(y) / top, y = x or sqrt(x)):

    d_i       = x_new_i - x_hat_i,  nominal_i = d_i != 0 and i is recorded (not padding)
    emp_i     = nominal_i ? P(stall) : 0,   P(stall) = [-down < d < up] (nearest, half-gaps),
                max(0, 1 - |d| / (d > 0 ? up : down)) (stochastic, whole gaps), 0 (BReD)
                (down, up = windows(x_hat); a minifloat's gaps there are its binade
                average 2**-M ln2 |n|, binade_average=True)
    down, up  = windows(s)  (the Gaussian part's cell; staleness.gaussian_v / gaussian_m stay
                torch: torch's erf is its own polynomial)

y = sqrt(clamp(x, 0)) of a `:sqrt` state is torch's (two torch ops per tensor: torch's CPU
sqrt is not the correctly rounded one, 1 ulp off on ~17% of values), the rest is the kernel's,
fp32 op for op as staleness.py computes them (so inf * 0 = NaN where a block's scale is 0,
as there), so every record stays bit-identical; the float64 sums stay in torch
(stats.ModelStats). Formats: the fused CPU codec's (replay.why_not_fused: linear int/uint,
code books and minifloats, 4 or 8 bits, block-scaled, no tensor scale, so no absmax reduced
across ranks; the scale dtype does not enter the model; and unscaled bf16 / fp16, delta = 1).
Output buffers: one set per layout size and thread, shared by every state of the replay
(they are summed before the next state's pass), so a replay holds 13 bytes per element for
them once, not once per configuration and state; per thread, since replays may run side
by side in one process (tests/test_diagnose_split.py runs its ranks as threads: with one
set per process they wrote into each other's predictions).
Threads: parallel over block ranges (host.run_parts), one nominal count per thread; `sums`
runs each thread's range of the pass, the Gaussian model (replay_gauss.gauss_range) and the
fp64 sums in one launch.
No numba at import: the kernel (replay_model_kernel.py) is imported on first use.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch

from ...quant.codebooks import codebook
from . import host
from .replay import block_of, why_not_fused
from .thresholds import nearest_thresholds
from .host import parts_of, run_parts, search_table
from .team import launched, team_parts

ROUNDINGS = {"nearest": 0, "stochastic": 1, "bred": 2}  # codec.NEAREST, STOCHASTIC, BRED
KINDS = {"linear": 0, "table": 1, "float": 2}  # replay_model_kernel.LINEAR, BOOK, FLOAT
_KERNEL: list = []
_LOCAL = threading.local()  # .buffers: n -> (emp, nominal, down, up), the thread's latest layout size only


def _buffers(n: int) -> tuple:
    """This thread's output buffers of n elements (emp, nominal, down, up) and their numpy
    views (reused: fresh pages would cost a page fault per 4 kB every call); a new size
    replaces the thread's old set."""
    bufs = _LOCAL.__dict__.setdefault("buffers", {})
    if n not in bufs:
        bufs.clear()
        rows = (torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.bool),
                torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32))
        bufs[n] = rows, tuple(t.numpy() for t in rows)
    return bufs[n]


def _kernel(team: bool = False):
    """model_pass, or with team its team launch and {"model_pass": its address} (native.call_compiled)."""
    if not _KERNEL:
        from .replay_model_kernel import model_pass, model_team
        _KERNEL.extend([model_pass, model_team, {}])
    return _KERNEL[1:] if team else _KERNEL[0]


class StalenessModel:
    """The fused staleness model of one state on a layout of n elements (valid: bool [n] or
    None, the recorded elements); module docstring."""

    def __init__(self, spec, n: int, valid: torch.Tensor | None = None):
        why = why_not_fused(spec)
        if why is not None:
            raise ValueError(f"no fused staleness model for {spec}: {why}")
        fmt, self.block = spec.fmt, block_of(spec, n)
        if n % self.block:
            raise ValueError(f"block size {self.block} does not divide the layout's {n} elements")
        self.n, self.rounding, self.sqrt = n, spec.rounding, bool(spec.sqrt)
        nt, search, unit = 0, (0, 0, 0, 0), 0
        self.table = np.zeros(2, np.float32)
        lo = hi = 0.0
        if fmt.kind == "linear":
            lo, hi = fmt.code_range
        elif fmt.kind == "float":  # codec.py's MAN, EMIN, MAXORD in the search's columns
            search = (fmt.man_bits, fmt.emin, fmt.max_ordinal, 0)
        else:  # the code book with its search buckets (search.floor_code, as the codec's)
            book = np.asarray(codebook(fmt.name), np.float32)
            nt = len(book)
            if nt & (nt - 1) == 0 and np.array_equal(book, np.arange(1, nt + 1, dtype=np.float64) / nt):
                unit = nt  # {1, ..., nt} / nt: the floor code in closed form (replay_model_kernel.P_UNIT)
            # a searched book: the code from its thresholds' buckets; else the book's (scanned: unused)
            keys = nearest_thresholds(fmt) if nt != 16 and not unit else book
            table, search = search_table(keys.tobytes())
            self.table = np.concatenate([table, code_gaps(book)])  # chunk_windows reads the gaps there
        # a code book searched per element (search.floor_codes: not 16 entries, which are scanned, nor
        # {1, ..., nt} / nt): its pass gains from numba's team in a small layout (team.py); the
        # others' passes, ~2.5x shorter, lost their gain to the serial passes after them reading
        # the rows the other core wrote (docs/diagnose.md)
        self.searched = fmt.kind == "table" and nt != 16 and not unit
        # lim[3]: a minifloat's binade-average gap per unit of |n|, the fp32 scalar torch multiplies by
        binade = (2.0 ** -fmt.man_bits) * math.log(2.0) if fmt.kind == "float" else 0.0
        self.lim = np.array([lo, hi, fmt.top, binade], np.float32)
        self.valid = np.ones(1, np.bool_) if valid is None else valid.cpu().contiguous().numpy()
        self.prm = (KINDS[fmt.kind], int(spec.sqrt), ROUNDINGS[spec.rounding], int(valid is not None), 0, nt,
                    int(fmt.signed), int(spec.scaled)) + tuple(int(v) for v in search) + (unit,)
        self.prm_of = {g: self.prm[:4] + (int(g),) + self.prm[5:] for g in (False, True)}  # prm[4]: the Gaussian cells
        self._row_lanes: dict = {}  # (parts, threads) -> sums' lanes where its ranges are sum64's rows, else 0

    def predict(self, x_hat: torch.Tensor, x_new: torch.Tensor, s: torch.Tensor | None):
        """(emp fp32 [n], nominal bool [n], #nominal, (down, up) fp32 [n] each of windows(s),
        or None where s is None or the rounding is BReD). The tensors are buffers shared by
        every StalenessModel of n elements in this thread: valid until its next predict of any of them."""
        gauss, args, out, counts, parts, team = self._pass(x_hat, x_new, s)
        if not (team > 1 and launched(lambda: _team_launch(team, self.n // self.block, args))):
            run_parts(_kernel(), self.n, self.block, args, parts=parts)
        emp, nominal, down, up = out
        return emp, nominal, int(counts.sum()), ((down, up) if gauss else None)

    def sums(self, x_hat: torch.Tensor, x_new: torch.Tensor, s: torch.Tensor, gaussian) -> tuple:
        """(#nominal, emp's fp64 sum, G's fp64 sum or None): predict, then
        replay_gauss.masked_gaussian(sr, gaussian, s, down, up, nominal) where gaussian is not
        None, each summed by torch_sum.sum64, the same values, in one handoff to the threads:
        each thread's range runs the pass, the Gaussian's pipeline (replay_gauss.gauss_range)
        and, where its range is one of sum64's rows (torch_sum.sum_plan), the row sums of
        what it wrote. Not BReD (stats.ModelStats writes its +0.0 sums). A layout stepped by
        one thread (or by numba's team), or torch on more than one thread, takes predict's way:
        there is no handoff to save there."""
        from . import replay_gauss as rg
        from .torch_sum import add_in_order, sum64, sum_plan

        n, B = self.n, self.block
        sr = self.rounding == "stochastic"
        g = gaussian is not None and s is not None
        parts = parts_of(n)
        if parts == 1 or rg.range_parts(n) == 1:  # one thread, or torch's own threads
            emp, nominal, count, cell = self.predict(x_hat, x_new, s if g else None)
            return count, sum64(emp), (sum64(rg.masked_gaussian(sr, gaussian, s, *cell, nominal)) if g else None)
        gauss, args, (emp, nominal, down, up), counts, parts, _ = self._pass(x_hat, x_new, s if g else None)
        job, G = rg.gauss_job(sr, gaussian, s, down, up, nominal) if gauss else (None, None)
        key = (parts, host.threads())
        lanes = self._row_lanes.get(key)
        if lanes is None:  # sum64's lanes where each thread's range is one of its rows, else 0 (sum after)
            plan, nblocks = sum_plan(n), n // B
            edges = [nblocks * i // parts * B for i in range(parts)] + [n]
            rows = plan is not None and plan[0] == parts and edges == [min(n, i * -(-n // parts))
                                                                       for i in range(parts + 1)]
            lanes = self._row_lanes[key] = plan[1] if rows else 0
        rows = lanes > 0
        row_sums = np.zeros((2, parts), np.float64)
        kernel = _kernel()
        range_sum = _range_sum() if rows else None
        emp_np = args[5]  # model_pass' emp row (after x_hat, x_new, yx, ys, valid)

        def run_range(b0, b1, part):
            kernel(b0, b1, part, *args)
            i0, i1 = b0 * B, min(b1 * B, n)
            if job is not None:
                rg.gauss_range(job, i0, i1)
            if rows:
                row_sums[0, part] = range_sum(emp_np, i0, i1 - i0, lanes)
                if job is not None:
                    row_sums[1, part] = range_sum(job.G, i0, i1 - i0, lanes)
            return 0

        run_parts(run_range, n, B, (), parts=parts)
        if not rows:
            return int(counts.sum()), sum64(emp), (sum64(G) if job is not None else None)
        return int(counts.sum()), add_in_order(row_sums[0]), (add_in_order(row_sums[1]) if job is not None else None)

    def _pass(self, x_hat: torch.Tensor, x_new: torch.Tensor, s: torch.Tensor | None) -> tuple:
        """(gauss, model_pass' arguments after the range, its output tensors (emp, nominal,
        down, up), the nominal counts per thread, threads, numba team size) for one predict."""
        n = self.n
        gauss = s is not None and self.rounding != "bred"
        ys = s if gauss else x_hat
        if self.sqrt and self.rounding != "bred":  # y = sqrt(clamp(x, 0)) as torch computes it
            yx, ys = x_hat.clamp(min=0.0).sqrt(), (ys.clamp(min=0.0).sqrt() if gauss else ys)
        else:
            yx = x_hat
        arrays = [_f32(t, n) for t in (x_hat, x_new, yx, ys)]
        out, views = _buffers(n)
        parts = parts_of(n)
        team = team_parts(n) if parts == 1 and self.searched else 1  # a small layout: numba's team (team.py)
        counts = np.zeros(max(parts, team), np.int64)
        args = (*arrays, self.valid, *views, counts, self.prm_of[gauss], self.lim, self.table, self.block, n)
        return gauss, args, out, counts, parts, team


def _range_sum():
    from .torch_sum_kernel import range_sum
    return range_sum


def _team_launch(team: int, nblocks: int, args: tuple) -> bool:
    """model_pass over `team` threads of numba's team (team.py), called by its address
    (native.call_compiled), taken on first use (every call's argument types: fp32 / bool rows, ints)."""
    launch, at = _kernel(team=True)
    if not at:
        from .native import compiled_address
        at["model_pass"] = compiled_address(_kernel(), (0, 0, 0) + args)
    launch(at["model_pass"], team, nblocks, *args)
    return True


def code_gaps(book: np.ndarray) -> np.ndarray:
    """fp32 [2 nt]: per code k of a sorted code book, [2k] the gap below it, table[k] -
    table[k - 1] (inf at k = 0), and [2k + 1] the gap above, table[k + 1] - table[k] (inf at
    the last code): staleness._grid_gaps' fp32 subtractions, done once per code book instead
    of per element (replay_model_kernel.block_windows reads them past the search buckets)."""
    book = np.asarray(book, np.float32)
    gaps = np.full(2 * book.size, np.inf, np.float32)
    gaps[2:-1:2] = book[1:] - book[:-1]  # below k = 1 .. nt - 1
    gaps[1:-2:2] = book[1:] - book[:-1]  # above k = 0 .. nt - 2
    return gaps


def _f32(t: torch.Tensor, n: int) -> np.ndarray:
    if t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous() and t.numel() == n \
            and t.device.type == "cpu" and not t.requires_grad:
        return t.numpy()  # the replay's rows: no reshape, no copy
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.numel() != n:
        raise ValueError(f"the fused staleness model needs fp32 CPU tensors of {n} elements "
                         f"(got {t.dtype} {t.device.type} {t.numel()})")  # the kernel does not bound-check
    return t.detach().reshape(-1).contiguous().numpy()
