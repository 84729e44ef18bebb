"""One AdamW configuration's whole replay step on CPU in one numba call per thread.

Per replay step, a configuration whose rule, codec and statistics all run on the fused CPU
path (replay_rule.py, replay.py, replay_stats.py) calls, in this order,

    adamw_rule      u, m, v   = the rule on g and the states read back (m_hat, v_hat)
    replay_codec    m's codes, scales and value read back;  then v's
    state_counts    m's code statistics against the shadow;  then v's
    update_sums     UpdateStats' per-unit sums of u against the shadow's update
    add_step x 3    the per-unit sums into StateStats' / UpdateStats' series

Each is one numba kernel; between them the host spends ~100 Python and torch operations per
step (allocations, numpy views, checks, a dispatch each), which on the demo trace cost more
than the kernels themselves (docs/diagnose.md, "Replay throughput"). FusedAdamStep runs
the same kernels from one compiled function (replay_step_kernel.adamw_config_step), a
chunk of units at a time over each thread's range of units, and the add_steps at its end
where one thread holds every unit (else in one more call), so every value is computed by
the same code as before and every record is the same, bit for bit. Its output rows (u, m,
v, and each state's codes, scales and value read back, two of each so the previous step's
stay intact) are allocated once and reused; u, m and v are written on a step with the
staleness model only (`rule`, which the model reads), else the kernel keeps them in rows of
one chunk (at 2**20 elements: 12 bytes an element-step less to memory, the 1 M trace's
replay 3-5% faster). States: the block-scaled 4- and 8-bit formats (codes packed in
uint8), or both unscaled 16-bit minifloats (bf16, fp16: their uint16 patterns,
replay_codec16; adamw_config_step16); anything else keeps the separate calls
(diagnose/fused_step.py decides). No numba at import: the kernel is imported on first use.
"""
from __future__ import annotations

import numpy as np
import torch

from . import torch_sum
from .replay_stats import NO_STALE, NO_VALID
from .host import parts_of, run_parts
from .layout import STALE_COPIES
from .team import launched, team_parts
from .replay_rule import adamw_rule

CHUNK_ELEMENTS = 16384  # units per chunk: this many elements (or one unit); ~1 MB of a thread's rows, in L2
# or L3 between the chunk's passes (8192 before: the step kernel 3-5% slower on the Zen 4, docs/diagnose.md)
_NO_ERR = np.zeros((2, 0), np.float32)
_KERNELS: list = []


def _kernels():
    if not _KERNELS:
        from .replay_step_kernel import (add_steps, adamw_config_step, adamw_config_step16, adamw_config_team,
                                         adamw_config_team16)
        _KERNELS.extend([adamw_config_step, add_steps, adamw_config_step16, adamw_config_team, adamw_config_team16])
    return _KERNELS


def _wide(q) -> bool:
    """An unscaled 16-bit state on the fused codec (its codes: int16 patterns, no scales)."""
    return hasattr(q, "plan") and getattr(q, "_scale_dtype", 0) is None and q.spec.fmt.bits == 16


def why_not(states: list, counts: list, n: int, unit: int) -> str | None:
    """Why FusedAdamStep cannot step these (FusedReplayState, CodeCounts) pairs, or None."""
    if torch_sum.lanes() is None:
        return "torch's sum order was not found (torch_sum.lanes)"
    wide = [_wide(q) for q in states]
    if any(wide) and not all(wide):
        return "one state is 16-bit unscaled and the other is not"
    for q, cc in zip(states, counts):
        if not wide[0] and (getattr(q, "_scale_dtype", None) is None or q.spec.fmt.bits not in (4, 8)):
            return f"{q.spec} is not a block-scaled 4- or 8-bit state"
        if cc is None or cc.bits != q.spec.fmt.bits or cc.n != n or cc.unit != unit or unit % q.block:
            return "the code statistics do not match the state"
    return None


class _Rows:
    """One state's output rows, two of each (the previous step's value read back is the
    next step's input), and its per-unit sums."""

    def __init__(self, q, n: int, n_units: int):
        self.q, self.wide = q, _wide(q)
        self.out = [torch.empty(n, dtype=torch.float32) for _ in range(2)]
        self.sums = torch.empty(6, n_units, dtype=torch.float32)
        self.sums_np = self.sums.numpy()
        if self.wide:  # 16-bit patterns as the reference stores them (int16), no scales
            self.codes = [torch.empty(n, dtype=torch.int16) for _ in range(2)]
            self.scales = [None, None]
            self.np = [(c.numpy().view(np.uint16), o.numpy()) for c, o in zip(self.codes, self.out)]
            self.fixed = (q.lay, int(q.block), q.plan, q.base)
            return
        self.codes = [torch.empty(n * q.spec.fmt.bits // 8, dtype=torch.uint8) for _ in range(2)]
        self.scales = [torch.empty(n // q.block, dtype=q._scale_dtype) for _ in range(2)]
        self.np = [(c.numpy(), s.view(torch.int16).numpy().view(np.uint16), o.numpy())
                   for c, s, o in zip(self.codes, self.scales, self.out)]
        self.fixed = (q.lay, q.lim, q.table, int(q.block), q.plan, q.base)


class FusedAdamStep:
    """The replay step of one AdamW configuration with states m and v (module docstring)."""

    def __init__(self, n: int, unit: int, states: dict, counts: dict, clamp: dict, pad0: bool, series: list,
                 valid: torch.Tensor | None = None, stale_bins: dict | None = None):
        """states / counts / clamp: per state ("m", "v") its FusedReplayState, its CodeCounts and
        whether a value read back below 0 is clamped to 0; pad0: the layout's padding read back as 0;
        series: the (units, series) fp64 tensors the step's per-unit sums go into (torch_sum.add_step),
        StateStats' of m and of v, then UpdateStats'; valid (bool [n], the recorded elements, or
        None) and stale_bins (per state its staleness histogram's bins): a snapshot step counts
        the histogram in the same pass (replay_stats_kernel.state_counts), else the caller does."""
        why = why_not([states[s] for s in ("m", "v")], [counts[s] for s in ("m", "v")], n, unit)
        if why is not None:
            raise ValueError(f"no fused replay step: {why}")
        self.n, self.unit, self.n_units = n, unit, n // unit
        self.chunk = max(1, CHUNK_ELEMENTS // unit)
        self.counts, self.clamp, self.pad0 = counts, {s: bool(clamp[s]) for s in ("m", "v")}, bool(pad0)
        self.rows = {s: _Rows(states[s], n, self.n_units) for s in ("m", "v")}
        self.wide = self.rows["m"].wide  # both 16-bit unscaled (why_not): adamw_config_step16
        self.u, self.m, self.v = (torch.empty(n, dtype=torch.float32) for _ in range(3))
        self.upd = torch.empty(4, self.n_units, dtype=torch.float32)
        self.lanes = torch_sum.lanes()
        self.series = tuple(t.numpy() for pair in series for t in pair)
        self.rows_np = tuple(t.numpy() for t in (self.u, self.m, self.v, self.upd))
        self._held: dict = {}  # (state, j) -> (the tensors it was made of, its leading arguments)
        self._err: dict = {}  # state -> its snapshot rows (_err_rows)
        self._step_at = None  # the address of the step's compiled code, for a team launch
        self.valid = NO_VALID if valid is None else valid.cpu().contiguous().numpy()
        self.stale_bins = dict(stale_bins or {})
        self._stale: dict = {}  # state -> int64 [parts, bins]: a snapshot's staleness counts per thread

    def _err_rows(self, s: str) -> torch.Tensor:
        """State s's rows for a snapshot's errors, fp32 [2, n] (the kernel writes row 0; row 1 is
        its unsummed e * e, unused here), made once: a fresh tensor each snapshot paid its page
        faults (~8 MB at 2**20 elements). step's caller reads them before the next snapshot."""
        if s not in self._err:
            self._err[s] = torch.empty(2, self.n, dtype=torch.float32)
        return self._err[s]

    def _stale_rows(self, s: str, parts: int) -> np.ndarray:
        """State s's staleness counts for a snapshot, int64 [parts, STALE_COPIES, bins] (copies
        per thread: replay_stats_kernel.state_counts), zeroed (made once)."""
        rows = self._stale.get(s)
        if rows is None or rows.shape[0] < parts:
            rows = self._stale[s] = np.zeros((parts, STALE_COPIES, self.stale_bins[s]), np.int64)
        rows.fill(0)
        return rows

    def _head(self, s: str, j: int, prev_code: torch.Tensor, last_change: torch.Tensor) -> tuple:
        """State s's kernel arguments up to its histogram, with output rows j: made once and
        reused while prev_code, last_change and the histogram are the same objects (a reset
        replaces prev_code): each .numpy() costs ~1 us, and with the views of the values read
        back (step's prev_np) a step makes 7 of them instead of 13."""
        r, cc = self.rows[s], self.counts[s]
        key = (prev_code, last_change, cc.hist)
        held = self._held.get((s, j))
        if held is None or any(a is not b for a, b in zip(held[0], key)):
            head = (*r.np[j], *r.fixed, self.clamp[s], self.pad0, cc.bits, prev_code.numpy(), last_change.numpy(),
                    r.sums_np, cc.hist)
            held = self._held[(s, j)] = (key, head)
        return held[1]

    def step(self, codec_step: int, stats_step: int, g: torch.Tensor, m_hat: torch.Tensor, v_hat: torch.Tensor,
             sc: np.ndarray, ref: torch.Tensor, ref2_units: torch.Tensor, shadow: dict, shadow_x2: dict,
             prev_code: dict, last_change: dict, keep_err: bool, ruled: bool = False, counted: bool = True):
        """One step (module docstring), replay step stats_step = i + 1: returns ({state: value
        read back}, and with keep_err (a snapshot step) {state: (fp32 [n] error new - shadow,
        int64 [bins] the staleness histogram of the new last_change, or None where the state
        has no stale_bins)}, else None). Each state's codes, scales and
        `written` are set (stored at codec_step); prev_code and last_change are updated in
        place; the step's per-unit sums are added into column i of the series; ruled: `rule`
        ran for this step already. The inputs are the replay's own: contiguous fp32 / int32 CPU
        tensors of the layout's size (not checked again here); the errors are rows held for the
        next snapshot too (_err_rows). counted False: the states are stored, their statistics
        not taken (prev_code, last_change and their series stay as they are; the update's are)."""
        prev = {"m": m_hat, "v": v_hat}
        parts = parts_of(self.n)
        team = team_parts(self.n) if parts == 1 else 1  # a small layout: numba's team (team.py)
        st, x_hat, snap, prev_np = {}, {}, {}, {}
        for s, r in self.rows.items():
            j = 1 if r.out[0].data_ptr() == prev[s].data_ptr() else 0  # never the previous step's rows
            cc = self.counts[s]
            cc.ensure_parts(max(parts, team))
            e = self._err_rows(s) if keep_err else None
            stale = self._stale_rows(s, max(parts, team)) if keep_err and s in self.stale_bins else NO_STALE
            st[s] = self._head(s, j, prev_code[s], last_change[s]) + (
                shadow[s].numpy(), shadow_x2[s].numpy(), _NO_ERR if e is None else e.numpy(), cc.shift, cc.mask,
                self.valid, stale)
            r.q.codes, r.q.scales, r.q.written, r.q._read_back = r.codes[j], r.scales[j], int(codec_step), None
            x_hat[s], snap[s] = r.out[j], ((e[0], stale) if keep_err else None)
            # the value read back last step is normally this state's other output row: its view is held
            prev_np[s] = r.np[1 - j][-1] if prev[s] is r.out[1 - j] else prev[s].numpy()
        u, m, v, upd = self.rows_np
        args = (self.unit, self.chunk, self.n, g.numpy(), prev_np["m"], prev_np["v"], u, m, v, sc, ref.numpy(),
                ref2_units.numpy(), upd, int(codec_step), int(stats_step), self.lanes[0], bool(keep_err), bool(ruled),
                bool(counted), st["m"], st["v"])
        if not (team > 1 and launched(lambda: self._team_launch(team, args))):
            run_parts(_kernels()[2 if self.wide else 0], self.n, self.unit,
                      args + (parts == 1, self.lanes[1], self.series), parts=parts)
        if parts > 1:  # the series need every thread's units: one more call
            add = self.series
            _kernels()[1](int(stats_step) - 1, self.lanes[1], bool(counted), self.rows["m"].sums_np, add[0], add[1],
                          self.rows["v"].sums_np, add[2], add[3], upd, add[4], add[5])
        if not keep_err:
            return x_hat, None
        return x_hat, {s: (e, torch.from_numpy(stale.sum((0, 1))) if stale.shape[2] else None)
                       for s, (e, stale) in snap.items()}

    def _team_launch(self, team: int, args: tuple) -> bool:
        """The step over `team` threads of numba's team (team.py), the series added after the
        ranges; the step called by its address (native.call_compiled), taken on first use."""
        k = _kernels()
        if self._step_at is None:
            from .native import compiled_address
            self._step_at = compiled_address(k[2 if self.wide else 0],
                                             (0, 0, 0) + args + (False, self.lanes[1], self.series))
        k[4 if self.wide else 3](self._step_at, team, self.n_units, *args, self.lanes[1], self.series)
        return True

    def rule(self, g: torch.Tensor, m_hat: torch.Tensor, v_hat: torch.Tensor, sc: np.ndarray) -> tuple:
        """(u, m, v): the AdamW rule alone into this step's rows (replay_rule.adamw_rule), for
        a step that reads the new states before they are stored; `step(..., ruled=True)` then
        stores them."""
        return adamw_rule(g, m_hat, v_hat, sc, out=(self.u, self.m, self.v))
