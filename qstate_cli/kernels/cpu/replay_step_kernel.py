"""numba kernel of one AdamW configuration's whole replay step (replay_step.py says what it
computes; imports numba): the replay's own kernels (replay_rule_kernel, replay_kernel,
replay_stats_kernel), called chunk by chunk from one compiled function, so a step is one
dispatch per thread instead of ~8 kernel calls and ~100 Python and torch operations."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import codec as c  # noqa: F401 - sets numba's cache folder before anything here compiles
from . import native as nv
from .replay_kernel import replay_codec, replay_codec16
from .replay_rule_kernel import adamw_rule, update_sums
from .replay_stats_kernel import state_counts
from .torch_sum_kernel import add_step


@njit(nogil=True, cache=True, error_model="numpy")
def _state(k0, k1, part, unit, numel, x, prev, codec_step, stats_step, lanes, keep, st, counted):
    """Units k0 .. k1 - 1 of one state: store x (replay_codec: codes, scales, the value read
    back into out), then, where counted, the code statistics of x, prev and out against the
    shadow (state_counts, with a snapshot's staleness histogram where stale has bins; sums[4] =
    the shadow's per-unit squares, copied: StateStats' row)."""
    (codes, s16, out, lay, lim, table, B, plan, base, clamp0, pad0,
     bits, prev_code, last_change, sums, hist, shadow, shadow_x2, err, shift, mask, valid, stale) = st
    per = unit // B
    replay_codec(k0 * per, k1 * per, x, codes, s16, out, lay, lim, table, B, numel, plan, base, codec_step,
                 clamp0, pad0)
    if not counted:
        return
    for k in range(k0, k1):
        sums[4, k] = shadow_x2[k]
    state_counts(k0, k1, part, x, prev, out, codes, bits, prev_code, last_change, stats_step, unit, sums, hist,
                 shadow, err, shift, mask, lanes, keep, valid, stale)


@njit(nogil=True, cache=True, error_model="numpy")
def _state16(k0, k1, part, unit, numel, x, prev, codec_step, stats_step, lanes, keep, st, counted):
    """_state for an unscaled 16-bit minifloat (bf16, fp16): replay_codec16 stores x (its
    uint16 patterns, no scales), then the same statistics (the codes: the patterns)."""
    (codes, out, lay, B, plan, base, clamp0, pad0,
     bits, prev_code, last_change, sums, hist, shadow, shadow_x2, err, shift, mask, valid, stale) = st
    per = unit // B
    replay_codec16(k0 * per, k1 * per, x, codes, out, lay, B, numel, plan, base, codec_step, clamp0, pad0)
    if not counted:
        return
    for k in range(k0, k1):
        sums[4, k] = shadow_x2[k]
    state_counts(k0, k1, part, x, prev, out, codes, bits, prev_code, last_change, stats_step, unit, sums, hist,
                 shadow, err, shift, mask, lanes, keep, valid, stale)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _chunk_rows(w):
    """Rows u, m, v for one chunk of w elements (a step without the staleness model: nothing
    reads them after the chunk, so they stay in cache instead of 12 bytes an element to memory)."""
    return np.empty(w, np.float32), np.empty(w, np.float32), np.empty(w, np.float32)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _at(rows, first):
    """Views of the chunk rows in which element `first` of the layout is each row's first: the
    kernels index the layout's elements, first .. first + w - 1 then land in the rows."""
    shift = np.uint64(first) * np.uint64(4)
    return (nv.view_like(rows[0], np.uint64(rows[0].ctypes.data) - shift, first + rows[0].size),
            nv.view_like(rows[1], np.uint64(rows[1].ctypes.data) - shift, first + rows[1].size),
            nv.view_like(rows[2], np.uint64(rows[2].ctypes.data) - shift, first + rows[2].size))


@njit(nogil=True, cache=True, error_model="numpy")
def adamw_config_step(k0, k1, part, unit, chunk, numel, g, m_hat, v_hat, u, m, v, sc, ref, ref2, upd,
                      codec_step, stats_step, lanes, keep, ruled, counted, st_m, st_v, finish, lanes64, series):
    """Units k0 .. k1 - 1 of one replay step, `chunk` units at a time (so a chunk's rows stay
    in cache between the passes): the AdamW rule (u, m, v from g, m_hat, v_hat: adamw_rule),
    then each state stored and counted (_state, st_m / st_v: its arrays), then UpdateStats'
    per-unit sums of u against the shadow's update ref (upd[3] = ref2, copied). ruled: u, m
    and v hold this step's rule already (a step that evaluates the staleness model in between);
    else the rule writes into rows of one chunk (_chunk_rows), and u, m, v stay as they were.
    counted: the states' statistics too (else the states are stored and only the update's
    sums are taken: validate.py's replays read no more). finish (one thread holds every
    unit): the step's sums added into the series as well (add_steps; series = the three
    (units, series) pairs, column stats_step - 1; the states' only where counted)."""
    rows = (u, m, v) if ruled else _chunk_rows(chunk * unit)
    for c0 in range(k0, k1, chunk):
        c1 = min(c0 + chunk, k1)
        cu, cm, cv = (u, m, v) if ruled else _at(rows, c0 * unit)
        if not ruled:
            adamw_rule(c0, c1, g, m_hat, v_hat, cu, cm, cv, sc, unit, numel)
        _state(c0, c1, part, unit, numel, cm, m_hat, codec_step, stats_step, lanes, keep, st_m, counted)
        _state(c0, c1, part, unit, numel, cv, v_hat, codec_step, stats_step, lanes, keep, st_v, counted)
        for k in range(c0, c1):
            upd[3, k] = ref2[k]
        update_sums(c0, c1, cu, ref, upd, unit, lanes)
    if finish:  # st_*[14]: the state's per-unit sums (replay_step.FusedAdamStep.step's tuple)
        add_steps(stats_step - 1, lanes64, counted, st_m[14], series[0], series[1], st_v[14], series[2], series[3],
                  upd, series[4], series[5])
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def adamw_config_step16(k0, k1, part, unit, chunk, numel, g, m_hat, v_hat, u, m, v, sc, ref, ref2, upd,
                        codec_step, stats_step, lanes, keep, ruled, counted, st_m, st_v, finish, lanes64, series):
    """adamw_config_step for states m and v both unscaled 16-bit minifloats (_state16; st_*[11]:
    a state's per-unit sums)."""
    rows = (u, m, v) if ruled else _chunk_rows(chunk * unit)
    for c0 in range(k0, k1, chunk):
        c1 = min(c0 + chunk, k1)
        cu, cm, cv = (u, m, v) if ruled else _at(rows, c0 * unit)
        if not ruled:
            adamw_rule(c0, c1, g, m_hat, v_hat, cu, cm, cv, sc, unit, numel)
        _state16(c0, c1, part, unit, numel, cm, m_hat, codec_step, stats_step, lanes, keep, st_m, counted)
        _state16(c0, c1, part, unit, numel, cv, v_hat, codec_step, stats_step, lanes, keep, st_v, counted)
        for k in range(c0, c1):
            upd[3, k] = ref2[k]
        update_sums(c0, c1, cu, ref, upd, unit, lanes)
    if finish:
        add_steps(stats_step - 1, lanes64, counted, st_m[11], series[0], series[1], st_v[11], series[2], series[3],
                  upd, series[4], series[5])
    return 0


@njit(nogil=True, cache=True, error_model="numpy")
def add_steps(i, lanes64, counted, a, a_units, a_series, b, b_units, b_series, d, d_units, d_series):
    """torch_sum_kernel.add_step for the step's three sets of per-unit sums (state m, state v,
    the update; the states' only where counted), in one call."""
    if counted:
        add_step(a, a_units, a_series, i, lanes64)
        add_step(b, b_units, b_series, i, lanes64)
    add_step(d, d_units, d_series, i, lanes64)
    return 0


# ---- team launches: one step split over numba's OpenMP threads (team.py) ------------------------
# A prange body becomes a gufunc whose arguments may be arrays and scalars only, not tuples, so
# each state's tuple is unpacked before the loop and built again inside it (the same values).
# The step is called by its address (native.call_compiled: `step` is adamw_config_step's, or
# adamw_config_step16's, compiled for these arguments), not linked in: linking it would
# optimize the whole step's code again, ~80 s a wrapper on first use.

@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def adamw_config_team(step, nparts, units, unit, chunk, numel, g, m_hat, v_hat, u, m, v, sc, ref, ref2, upd,
                      codec_step, stats_step, lanes, keep, ruled, counted, st_m, st_v, lanes64, series):
    """adamw_config_step over units 0 .. units - 1 split into nparts contiguous ranges, one per
    thread of numba's team (part p: its own histogram row), then add_steps: the same values
    as one thread's call (every sum is per unit, every count an integer)."""
    (a0, a1, a2, a_lay, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
     a22) = st_m
    (b0, b1, b2, b_lay, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15, b16, b17, b18, b19, b20, b21,
     b22) = st_v
    (la0, la1, la2, la3, la4, la5, la6, la7, la8, la9, la10, la11) = a_lay
    (lb0, lb1, lb2, lb3, lb4, lb5, lb6, lb7, lb8, lb9, lb10, lb11) = b_lay
    s0, s1, s2, s3, s4, s5 = series
    finish = False
    for p in prange(nparts):
        sm = (a0, a1, a2, (la0, la1, la2, la3, la4, la5, la6, la7, la8, la9, la10, la11), a4, a5, a6, a7, a8, a9,
              a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22)
        sv = (b0, b1, b2, (lb0, lb1, lb2, lb3, lb4, lb5, lb6, lb7, lb8, lb9, lb10, lb11), b4, b5, b6, b7, b8, b9,
              b10, b11, b12, b13, b14, b15, b16, b17, b18, b19, b20, b21, b22)
        nv.call_compiled(step, (units * p // nparts, units * (p + 1) // nparts, p, unit, chunk, numel, g, m_hat,
                                v_hat, u, m, v, sc, ref, ref2, upd, codec_step, stats_step, lanes, keep, ruled,
                                counted, sm, sv, finish, lanes64, (s0, s1, s2, s3, s4, s5)))
    add_steps(stats_step - 1, lanes64, counted, a14, s0, s1, b14, s2, s3, upd, s4, s5)
    return 0


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def adamw_config_team16(step, nparts, units, unit, chunk, numel, g, m_hat, v_hat, u, m, v, sc, ref, ref2, upd,
                        codec_step, stats_step, lanes, keep, ruled, counted, st_m, st_v, lanes64, series):
    """adamw_config_team for adamw_config_step16 (a state's tuple: _state16's)."""
    (a0, a1, a_lay, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19) = st_m
    (b0, b1, b_lay, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15, b16, b17, b18, b19) = st_v
    (la0, la1, la2, la3, la4, la5, la6, la7, la8, la9, la10, la11) = a_lay
    (lb0, lb1, lb2, lb3, lb4, lb5, lb6, lb7, lb8, lb9, lb10, lb11) = b_lay
    s0, s1, s2, s3, s4, s5 = series
    finish = False
    for p in prange(nparts):
        sm = (a0, a1, (la0, la1, la2, la3, la4, la5, la6, la7, la8, la9, la10, la11), a3, a4, a5, a6, a7, a8, a9,
              a10, a11, a12, a13, a14, a15, a16, a17, a18, a19)
        sv = (b0, b1, (lb0, lb1, lb2, lb3, lb4, lb5, lb6, lb7, lb8, lb9, lb10, lb11), b3, b4, b5, b6, b7, b8, b9,
              b10, b11, b12, b13, b14, b15, b16, b17, b18, b19)
        nv.call_compiled(step, (units * p // nparts, units * (p + 1) // nparts, p, unit, chunk, numel, g, m_hat,
                                v_hat, u, m, v, sc, ref, ref2, upd, codec_step, stats_step, lanes, keep, ruled,
                                counted, sm, sv, finish, lanes64, (s0, s1, s2, s3, s4, s5)))
    add_steps(stats_step - 1, lanes64, counted, a11, s0, s1, b11, s2, s3, upd, s4, s5)
    return 0


@njit(parallel=True, nogil=True, cache=True)
def team_probe(out):
    """out[p] = 1 + p on each of numba's threads: a first parallel launch, after which
    numba.threading_layer() says which layer runs the team (team.py)."""
    for p in prange(out.size):
        out[p] = 1 + p
    return 0
