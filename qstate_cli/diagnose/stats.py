"""Statistics of one replayed state against its fp32 shadow, accumulated on the device.

Per step t, over the N recorded elements (padding excluded), with stored value x_hat_t,
the fp32 value before rounding x_t, the previous stored value x_hat_{t-1} and the fp32
shadow s_t (same gradients, fp32 states), E_t = x_hat_t - s_t:

    drift_t          = mean(E_t) / rms(s_t)                     (signed, dimensionless)
    rel_rms_error_t  = rms(E_t) / rms(s_t)
    error_var_t      = var(E_t) / ms(s_t) = rel_rms_error_t^2 - drift_t^2
    stall_rate_t     = #(x_t != x_hat_{t-1} and x_hat_t == x_hat_{t-1}) / #(x_t != x_hat_{t-1})
    code_stall_rate_t = #(x_t != x_hat_{t-1} and code_t == code_{t-1}) / #(x_t != x_hat_{t-1}),
                       code = the stored integer code (formats of 8 bits or fewer, unpacked),
                       or the raw bits of a 16-bit float or fp32 state. Under a block scale
                       the value read back moves with the block's absmax while an element's
                       code stays frozen: the value-level rate misses that, this one counts it
    staleness        = t - (last step the stored *code* changed), sampled at snapshot steps
    per code         = elements x steps with a non-zero nominal update, value stalls and
                       code stalls, per stored code (8 bits or fewer) or per binade (16-bit
                       floats)
    dimension        = RMS over chunks of |sum of d errors| (each error over its tensor's
                       shadow RMS; chunks aligned with each tensor's trace blocks, squares
                       per d recorded elements: dimension_ms) at d = 1, 2, 4, ..., N/4 (N
                       recorded elements); log-log slope ~1 for a
                       coherent bias (d b), ~0.5 for independent noise (sqrt(d) s); the
                       record's slope is fitted over d >= the dither block (summary.py)

Update fidelity (UpdateStats): cosine and |u - u_ref| / |u_ref| between the update
direction of the quantized configuration and of the fp32 shadow, per step.

Everything is reduced per `unit` block first (one pass per quantity), then to per-step
scalars and per-unit sums over time (per-tensor statistics); all of it stays on the
device until `collect()`, so the CUDA replay never waits on the host.

`collect()` returns parts that add up across torchrun's ranks (merge.py): per-step sums,
histograms, per-unit arrays. What is not a sum is finished once on the whole: the update
cosine and relative error (`fidelity`) and the dimension statistic (`dimension_ms`),
which a snapshot keeps as per-tensor sums of s^2 and of squared chunk sums of the raw
errors for d < unit, and per-unit raw error sums for d >= unit (those chunks span units,
and ranks); the per-tensor shadow RMS divides them afterwards.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..quant.config import StateSpec
from ..quant.packing import unpack
from .layout import Layout

S_ERR, S_ERR2, S_STALL, S_NOMINAL, S_SHADOW2, S_CSTALL = range(6)
N_ROWS = 6
N_CODE_CLASSES = 5  # per code: no nominal update; nominal x (value stalled, code stalled)


def unit_sums(x: torch.Tensor, unit: int) -> torch.Tensor:
    return x.view(-1, unit).sum(1, dtype=torch.float32)


class StateStats:
    """fused: the state is stored through the fused CPU codec (kernels/cpu/replay.py), so the
    comparisons, counts and code updates run in one numba pass per unit block, and a
    snapshot's staleness histogram in another (kernels/cpu/replay_stats.py, the same
    integers, and the float sums per unit and per step in torch's own order of additions:
    kernels/cpu/torch_sum.py, the same bits); else (no numba, the reference codec, CUDA) as
    torch ops. A snapshot's dimension statistic per unit: fused too where torch's order of
    an fp64 row sum was found (the same bits); its per-tensor sums are torch ops either way."""

    def __init__(self, layout: Layout, spec: StateSpec, n_steps: int, snapshot_every: int, fused: bool = False):
        dev, self.layout, self.spec = layout.device, layout, spec
        self.n_steps = n_steps
        self.series = torch.zeros(N_ROWS, n_steps, dtype=torch.float64, device=dev)  # rows: S_*
        self.units = torch.zeros(N_ROWS, layout.n_units, dtype=torch.float64, device=dev)  # summed over steps
        self.prev_code = torch.zeros(layout.n, dtype=torch.int32, device=dev)  # never written: all-zero storage
        self.last_change = torch.zeros(layout.n, dtype=torch.int32, device=dev)
        self.staleness = torch.zeros(n_steps + 2, dtype=torch.int64, device=dev)
        self.snapshot_every = snapshot_every
        self.code_mode = _code_mode(spec)
        self.n_codes = {"code": 2 ** spec.fmt.bits, "binade": 2 ** spec.fmt.exp_bits}.get(self.code_mode, 0)
        self.codes = torch.zeros(N_CODE_CLASSES * max(self.n_codes, 1), dtype=torch.int64, device=dev)
        self.dims = [2 ** k for k in range(int(math.log2(max(1, layout.total_valid // 4))) + 1)]  # as any unit
        self.snap_x2, self.snap_small, self.snap_units = [], [], []  # per snapshot (_snapshot)
        self._ones = torch.ones(layout.n, dtype=torch.int64, device=dev)
        self._fused = None
        if fused and self.code_mode is not None and dev.type == "cpu":
            from ..kernels.cpu.replay_stats import CodeCounts, prev_code_dtype  # no numba until the first observe
            shift = spec.fmt.man_bits if self.code_mode == "binade" else 0
            self._fused = CodeCounts(spec.fmt.bits, layout.n, layout.unit, self.n_codes, shift)
            self.prev_code = torch.zeros(layout.n, dtype=prev_code_dtype(spec.fmt.bits, True))  # uint8: <= 8 bits

    def observe(self, i: int, x: torch.Tensor, prev: torch.Tensor, new: torch.Tensor,
                shadow: torch.Tensor, shadow_x2_units: torch.Tensor, storage: torch.Tensor | None) -> None:
        """Record replay step t = i + 1: nominal x, stored before (prev) and after (new), shadow."""
        unit, step = self.layout.unit, i + 1
        snapshot = self.snapshot_due(i)
        if self._fused is not None and storage is not None:  # this step's rows u from the kernel, the same bits
            from ..kernels.cpu.torch_sum import add_step

            u, err = self._fused.observe(step, x, prev, new, storage, self.prev_code, self.last_change, shadow,
                                         shadow_x2_units, keep_err=snapshot)
            add_step(u, self.units, self.series, i)  # = self._add(i, u)
            if snapshot:
                self._snapshot(step, err, shadow_x2_units)
            return
        err = new - shadow
        changed = new != prev
        nominal = x != prev
        stall = nominal > changed  # nominal and not changed
        code = stored_code(storage, self.spec, self.layout.n) if storage is not None else new.view(torch.int32)
        code_changed = code != self.prev_code
        code_stall = nominal > code_changed
        self.prev_code = code.to(self.prev_code.dtype)  # the same codes (uint8 only where they fit: __init__)
        u = torch.stack([unit_sums(err, unit), unit_sums(err * err, unit), unit_sums(stall, unit),
                         unit_sums(nominal, unit), shadow_x2_units, unit_sums(code_stall, unit)])
        self._add(i, u)
        self.last_change.masked_fill_(code_changed, step)
        if self.n_codes:
            self._count_codes(code, nominal, stall, code_stall)
        if snapshot:
            self._snapshot(step, err, shadow_x2_units)

    def snapshot_due(self, i: int) -> bool:
        """Whether replay step t = i + 1 takes a snapshot (staleness and dimension statistics)."""
        return (i + 1) % self.snapshot_every == 0 or i + 1 == self.n_steps

    def _add(self, i: int, u: torch.Tensor) -> None:
        """u: fp32 [N_ROWS, units], this step's per-unit sums (rows S_*)."""
        self.units += u
        self.series[:, i] = u.sum(1, dtype=torch.float64)

    def on_reset(self, i: int, positions: torch.Tensor | None = None) -> None:
        """A reset before replay step t = i + 1 puts every code back to the never-written
        storage (all zero bits): codes that were not zero changed at step t. positions: a
        reset of those elements only (a tensor on its own count: gaps.py)."""
        if positions is None:
            self.last_change.masked_fill_(self.prev_code != 0, i + 1)
            self.prev_code = torch.zeros_like(self.prev_code)
            return
        was = self.prev_code.index_select(0, positions)
        self.last_change.index_fill_(0, positions[was != 0], i + 1)
        self.prev_code.index_fill_(0, positions, 0)

    def _count_codes(self, code: torch.Tensor, nominal: torch.Tensor, stall: torch.Tensor,
                     code_stall: torch.Tensor) -> None:
        fmt = self.spec.fmt
        if self.code_mode == "binade":
            code = (code >> fmt.man_bits) & (self.n_codes - 1)
        # 0: no nominal update; 1 + value stalled + 2 x code stalled (padding: always 0)
        cls = nominal.to(torch.int32) * (1 + stall.to(torch.int32) + 2 * code_stall.to(torch.int32))
        idx = (code * N_CODE_CLASSES + cls).long()
        self.codes.scatter_add_(0, idx, self._ones)  # a bincount that never waits on the host

    def _snapshot(self, step: int, err: torch.Tensor, shadow_x2_units: torch.Tensor,
                  staleness: torch.Tensor | None = None) -> None:
        """staleness: this snapshot's histogram where the step's kernel counted it already
        (kernels/cpu/replay_step.py), else counted here."""
        lay = self.layout
        if staleness is not None:
            self.staleness += staleness
        elif self._fused is not None:  # the same integer counts in one pass
            self.staleness += self._fused.staleness(step, self.last_change, lay.valid, self.staleness.numel())
        else:
            stale = (step - self.last_change).to(torch.int64) + 1
            if lay.valid is not None:
                stale = torch.where(lay.valid, stale, 0)
            self.staleness.scatter_add_(0, stale.clamp_(max=self.staleness.numel() - 1), self._ones)
        # the dimension statistic, in parts that add up across ranks (dimension_ms finishes it):
        # per tensor, sum of s^2 and of the squared chunk sums of d < unit raw errors (chunks
        # inside one unit); per unit, the raw error sum (chunks of d >= unit cross units)
        self.snap_x2.append(lay.per_tensor(shadow_x2_units.double()))
        levels = sum(d < lay.unit for d in self.dims)
        parts = self._fused.dimension(err, levels) if self._fused is not None else None
        if parts is not None:  # the per-unit sums below, in one numba pass (the same bits)
            self.snap_small.append(lay.per_tensor(parts[0]))
            self.snap_units.append(parts[1])
            return
        e = err.double().view(-1, lay.unit)
        small = []
        for d in self.dims:
            if d >= lay.unit:
                break
            small.append(lay.per_tensor((e * e).sum(1)))
            e = e[:, 0::2] + e[:, 1::2]  # pairwise, as the whole layout's chunks pair up (a sum over a
            # trailing dim of 2 gives the same bits but sign of zero, squared away, at ~5x the time)
        self.snap_small.append(torch.stack(small) if small else torch.zeros(0, lay.n_tensors, dtype=torch.float64,
                                                                             device=err.device))
        self.snap_units.append(e.sum(1))

    def collect(self) -> dict:
        """Host-side numbers: per-step arrays, staleness histogram, per-code and per-unit sums."""
        n = self.layout.n_valid
        ser = self.series.cpu().numpy()
        stale = self.staleness.cpu().numpy()[1:]  # bin 0 held padding
        if self._fused is not None:
            self.codes = self._fused.codes()
        return {"err_sum": ser[S_ERR], "err2_sum": ser[S_ERR2], "stalls": ser[S_STALL],
                "nominal": ser[S_NOMINAL], "shadow2_sum": ser[S_SHADOW2], "code_stalls": ser[S_CSTALL], "n": n,
                "staleness_counts": stale,
                "codes": self.codes.cpu().numpy().reshape(-1, N_CODE_CLASSES) if self.n_codes else None,
                "code_mode": self.code_mode, "units": self.units.cpu().numpy(),
                "dims": list(self.dims), "dim_x2": _stack(self.snap_x2), "dim_small": _stack(self.snap_small),
                "dim_units": _stack(self.snap_units)}


def _stack(parts: list) -> np.ndarray:
    return torch.stack(parts).cpu().numpy() if parts else np.zeros((0, 0))


def dimension_ms(st: dict, layout: Layout) -> np.ndarray:
    """Mean over snapshots of the mean squared chunk sum of d errors, each error over its
    tensor's shadow RMS, at every d of st["dims"] (module docstring), from StateStats'
    parts of the whole layout (summed or, per unit, concatenated across ranks). Chunks are
    aligned in the arrangement where each tensor's recorded elements are padded to whole trace
    blocks (Layout.block_padded_units), and the sum of squares is per d recorded elements
    (divided by total_valid / d: independent errors of variance s^2 give d s^2 at every d, a
    partial chunk included): so a configuration's numbers do not depend on the unit, the
    largest block of the configurations replayed beside it."""
    dims, snaps = st["dims"], st["dim_x2"].shape[0]
    out = np.zeros(len(dims))
    if snaps == 0:
        return out
    n_el = np.asarray(layout.lengths, dtype=np.float64)
    owner = layout.unit_tensor.cpu().numpy()
    at, size = layout.block_padded_units()
    per = [layout.total_valid / d for d in dims]
    for k in range(snaps):
        rms = np.sqrt(st["dim_x2"][k] / n_el)
        rms = np.where(rms > 0, rms, 1.0)
        small = st["dim_small"][k]  # [levels d < unit, tensors]
        for j, row in enumerate(small):
            out[j] += float((row / (rms * rms)).sum()) / per[j]
        e = np.zeros(size)
        e[at] = st["dim_units"][k] / rms[owner]
        for j in range(len(small), len(dims)):  # d >= unit: chunk sums across units, pairwise
            out[j] += float((e * e).sum()) / per[j]
            e = np.append(e, np.zeros(e.size % 2)).reshape(-1, 2).sum(1)
    return out / snaps


def stored_code(storage: torch.Tensor, spec: StateSpec, numel: int) -> torch.Tensor:
    """Every element's stored code as int32: the unpacked code (8 bits or fewer), the raw
    bits of a 16-bit float, or the fp32 bits of an identity state."""
    fmt = spec.fmt
    if fmt.kind == "identity":
        return storage[:numel].view(torch.int32)
    return unpack(storage, fmt.bits, numel)


def _code_mode(spec: StateSpec) -> str | None:
    if spec.fmt.kind == "identity":
        return None
    if spec.fmt.bits <= 8:
        return "code"
    return "binade" if spec.fmt.kind == "float" else None


class UpdateStats:
    """Update fidelity of one configuration against the fp32 shadow's update."""

    def __init__(self, layout: Layout, n_steps: int, fused: bool = False):
        dev = layout.device
        self.layout = layout
        self.series = torch.zeros(4, n_steps, dtype=torch.float64, device=dev)  # dot, |u|^2, |u-r|^2, |r|^2
        self.units = torch.zeros(4, layout.n_units, dtype=torch.float64, device=dev)
        self.fused = fused and dev.type == "cpu"  # products and sums in one numba pass (kernels/cpu/replay_rule.py)

    def observe(self, i: int, u: torch.Tensor, ref: torch.Tensor, ref2_units: torch.Tensor) -> None:
        unit = self.layout.unit
        if self.fused:  # the same fp32 products and sums, in one numba pass (torch's order: torch_sum.py)
            from ..kernels.cpu.replay_rule import update_sums
            from ..kernels.cpu.torch_sum import add_step

            add_step(update_sums(u, ref, ref2_units, unit), self.units, self.series, i)
            return
        d = u - ref
        s = torch.stack([unit_sums(u * ref, unit), unit_sums(u * u, unit), unit_sums(d * d, unit), ref2_units])
        self.units += s
        self.series[:, i] = s.sum(1, dtype=torch.float64)

    def collect(self) -> dict:
        """Per-step sums (add up across ranks) and per-unit sums; `fidelity` finishes them."""
        return {"sums": self.series.cpu().numpy(), "units": self.units.cpu().numpy()}


def fidelity(update: dict) -> dict:
    """UpdateStats' sums -> per-step cosine and relative error of the update direction."""
    ser = update["sums"]
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = ser[0] / np.sqrt(ser[1] * ser[3])
        rel = np.sqrt(ser[2] / ser[3])
    return {**update, "cosine": cos, "rel_error": rel}


class ModelStats:
    """The staleness model's predictions for one state (staleness.py), per step: the
    empirical and Gaussian P(stall) summed over the elements with a non-zero nominal
    update, and their count. The Gaussian row stays NaN where no Gaussian model
    applies (optimizers other than Adam; unscaled float formats of v use theory.py's curve).

    fused: the state is stored through the fused CPU codec (kernels/cpu/replay.py), so the
    empirical P(stall), the nominal mask and s's cell run in one numba pass
    (kernels/cpu/replay_model.py) and the Gaussian formulas in one more, with fp32_math's
    sqrt, erf and exp (kernels/cpu/replay_gauss.py), the same fp32 values as staleness.predict,
    and their float64 sums in numba in torch's order (kernels/cpu/torch_sum.sum64), each
    thread's range of all three in one launch (StalenessModel.sums). Under
    BReD both predictions are +0.0 per element, so the fused path writes their sums, +0.0,
    without summing."""

    def __init__(self, layout: Layout, spec: StateSpec, n_steps: int, reduce_absmax=None, fused: bool = False):
        self.spec, self.reduce_absmax = spec, reduce_absmax
        self.series = torch.full((3, n_steps), float("nan"), dtype=torch.float64, device=layout.device)
        self.valid = layout.valid
        self._fused = None
        if fused and layout.device.type == "cpu":  # its formats have block scales: reduce_absmax never applies
            from ..kernels.cpu.replay_model import StalenessModel  # no numba until the first observe
            self._fused = StalenessModel(spec, layout.n, layout.valid)
            self._rows = self.series.numpy()  # a view: a numpy store costs ~0.1 us, torch's ~20

    def observe(self, i: int, x_hat: torch.Tensor, x_new: torch.Tensor, s: torch.Tensor, gaussian) -> None:
        if self._fused is not None:  # padding already masked; #nominal: an exact integer
            rows = self._rows
            if self.spec.rounding == "bred":  # both predictions are +0.0 per element (predict): sums of +0.0
                _, _, count, _ = self._fused.predict(x_hat, x_new, None)
                rows[0, i], rows[2, i] = 0.0, float(count)
                if gaussian is not None:
                    rows[1, i] = 0.0
                return
            # emp's sum, and the sum of where(nominal, gaussian_p(s's cell), 0), in one pass per thread
            count, rows[0, i], gauss = self._fused.sums(x_hat, x_new, s, gaussian)
            rows[2, i] = float(count)
            if gaussian is not None:
                rows[1, i] = gauss
            return
        from .staleness import predict

        emp, nominal, gauss = predict(self.spec, x_hat, x_new, s, gaussian, self.reduce_absmax)
        if self.valid is not None:
            nominal = nominal & self.valid
            emp = torch.where(self.valid, emp, 0.0)
        self.series[0, i] = emp.sum(dtype=torch.float64)
        self.series[2, i] = nominal.sum(dtype=torch.float64)
        if gauss is not None:
            self.series[1, i] = torch.where(nominal, gauss, 0.0).sum(dtype=torch.float64)

    def collect(self) -> dict:
        ser = self.series.cpu().numpy()
        return {"empirical": ser[0], "gaussian": ser[1], "nominal": ser[2]}


class GradientStats:
    """What the Gaussian model assumes about the gradients, checked on the trace: per step
    sum of g^2 and count of exact zeros over the recorded elements; per element sums of g^2
    and g^4 over the steps (kurtosis n sum g^4 / (sum g^2)^2: 3 for a Gaussian of constant
    variance).

    gaps (a trace's absent rows, gaps.py): a tensor's absent steps are not gradients, so they
    count nowhere: the caller zeroes those rows (replay._loop), observe takes their zeros
    out of the step's count, and collect counts each element's kurtosis over its own steps
    and adds `present`, per step the live elements that had a gradient (assumptions.py
    divides by it)."""

    def __init__(self, layout: Layout, n_steps: int, fused: bool = False, gaps=None):
        """fused: on CPU, the whole step in one numba pass (kernels/cpu/replay_stats.gradient_step,
        the same bits); else torch ops."""
        dev = layout.device
        self.layout, self.gaps = layout, gaps
        self.series = torch.zeros(2, n_steps, dtype=torch.float64, device=dev)  # sum g^2, zeros
        self.g2 = torch.zeros(layout.n, dtype=torch.float64, device=dev)
        self.g4 = torch.zeros(layout.n, dtype=torch.float64, device=dev)
        self.n_steps = 0
        self._sq = torch.empty(layout.n, dtype=torch.float64) if fused and dev.type == "cpu" else None
        if self._sq is not None:
            from ..kernels.cpu.replay_stats import gradient_step
            self._step, self._rows = gradient_step, self.series.numpy()  # numpy stores: ~0.1 us, torch's ~20

    def observe(self, i: int, g: torch.Tensor) -> None:
        """g: step i's gradients (with gaps: 0 at the tensors absent at step i)."""
        gone = self.gaps.missing(i) if self.gaps is not None else None
        gone = 0 if gone is None else gone.numel()  # zeros that were no gradient (class docstring)
        if self._sq is not None:
            self._rows[0, i], zeros = self._step(g, self.layout.valid, self.g2, self.g4, self._sq)
            self._rows[1, i] = zeros - gone
            self.n_steps += 1
            return
        g2 = g.double() * g.double()
        self.g2 += g2
        self.g4 += g2 * g2
        zeros = g == 0
        if self.layout.valid is not None:
            zeros = zeros & self.layout.valid
        self.series[0, i] = g2.sum()
        self.series[1, i] = zeros.sum(dtype=torch.float64) - gone
        self.n_steps += 1

    def collect(self) -> dict:
        g2, g4 = self.g2, self.g4
        live = g2 > 0
        if self.layout.valid is not None:
            live &= self.layout.valid
        ser = self.series.cpu().numpy()
        n_live = int(live.sum())
        dead = self.layout.n_valid - n_live  # zero at every step: no nominal update, no stall
        if self.gaps is None:
            kurt = (self.n_steps * g4[live] / (g2[live] * g2[live])).cpu().numpy()
            return {"g2_sum": ser[0], "zeros": ser[1] - dead, "kurtosis": kurt, "n": n_live, "dead": dead}
        # each element over its own steps (class docstring); a dead element's zeros only where present
        own = self.gaps.present_counts(self.n_steps)  # per tensor
        steps = torch.zeros(self.layout.n, dtype=torch.float64, device=g2.device)
        live_of, dead_of = np.zeros(len(own)), np.zeros(len(own))
        for j, pieces in self.gaps.pieces.items():
            for at, count in pieces:
                steps[at: at + count] = float(own[j])
                k = int(live[at: at + count].sum())
                live_of[j] += k
                dead_of[j] += count - k
        kurt = (steps[live] * g4[live] / (g2[live] * g2[live])).cpu().numpy()
        here = (~self.gaps.absent[:self.n_steps]).astype(np.float64)  # [steps, tensors]
        return {"g2_sum": ser[0], "zeros": ser[1] - here @ dead_of, "kurtosis": kurt, "n": n_live, "dead": dead,
                "present": here @ live_of}
