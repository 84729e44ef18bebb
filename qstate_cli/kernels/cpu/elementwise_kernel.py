"""numba kernels of elementwise.py: encode and decode of an unscaled 16-bit minifloat state
(bf16, fp16) over tensors laid end to end, and the steps of states that are such minifloats
or fp32 (AdamW's m and v: adamw_kernel; Lion's, SGD's or Muon's m: momentum_kernel), in runs
of RUN elements. The rounding and the read-back are the replay codec's
(replay_kernel.load_stored, round_bf16, round_float; codec.decode_value), so the codes are
quantizer.encode's and the values quantizer.decode's, bit for bit
(tests/test_kernels_cpu_elementwise.py)."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

from . import codec as c  # sets numba's cache folder before anything here compiles
from . import native as nv
from .adamw import _update
from .lion import lion_rows
from .muon import muon_rows
from .sgd import coupled_decay, sgd_rows
from .replay_kernel import is_bf16, load_stored, round_bf16, round_float

# Elements per pass of a loop: a row of each scratch array is 1 kB, so a pass's rows (up to
# six) stay in L1. Runs of 2,048 (8 kB rows, 48 kB in all) went through L2 between the loops:
# on a Zen 4, Lion bf16 7.1-7.2 -> 4.4-4.6 ms per 4 M elements at 256 (4.8-5.7 at 512), AdamW
# bf16 7.7-9.1 -> 6.0-6.1 (docs/cpu.md, "A Zen 4 EPYC").
RUN = 256


@njit(nogil=True, cache=True, error_model="numpy")
def encode16(b0, b1, part, x, codes, lay, starts, keys, numel):
    """codes[i] (uint16, the reference's int16 bits) of x[i] (fp32) for the runs b0 .. b1 - 1.
    Stochastic rounding: element i of tensor t (starts[t] <= i < starts[t + 1]) draws
    uniform16(i - starts[t]) of that tensor's keys (keys[t, 0], keys[t, 1]): the reference's
    Stream of that tensor (optim/small.Streams). Returns 0."""
    row = np.empty(RUN, np.float32)
    u = np.zeros(RUN, np.float32)
    q = np.empty(RUN, np.int32)
    bf16 = is_bf16(lay)
    t = 0
    for b in range(b0, b1):
        start = b * RUN
        cnt = min(RUN, numel - start)
        load_stored(x, np.uint64(start), cnt, lay, row)
        t = round16(row, u, q, cnt, start, t, starts, keys, 0, lay, bf16, codes)
    return 0


@njit(cache=True, forceinline=True, error_model="numpy")
def read_back(codes, i0, cnt, fresh, is32, lay, row):
    """row[:cnt] = a state's values read back from codes[i0 + j] (quantizer.decode): 0 where
    fresh; an fp32 state's as they are (the identity format); a bf16 state's bits << 16, as
    the replay's codec reads them (replay_kernel.replay_codec16), other 16-bit minifloats' by
    codec.decode_value; squared for a :sqrt state.

    A state that is not squared is read back with no float op at all, in a loop of its own:
    quantizer.decode leaves a signaling NaN's bits as they are (bf16 patterns 0x7F81-0x7FBF
    and their negatives), and any float op quiets it. decode_value's product by the unscaled
    delta 1.0 did (LLVM 14, numba 0.59, kept it; LLVM 22 folds it), and so did `v * v if sq
    else v` with sq in the loop, which LLVM 15 (numba 0.61) rewrites as v * (v if sq else
    1.0) (tests/test_kernels_cpu_elementwise.py; docs/cpu.md, "The oldest numba")."""
    sq = lay[c.SQRT] != 0
    if fresh:
        row[:cnt] = c.ZERO
    elif is32 and sq:
        for j in range(cnt):
            v = codes[i0 + np.uint64(j)]
            row[j] = v * v
    elif is32:
        for j in range(cnt):
            row[j] = codes[i0 + np.uint64(j)]
    elif is_bf16(lay) and sq:
        for j in range(cnt):
            v = c.f32_from_bits(np.uint32(np.uint16(codes[i0 + np.uint64(j)])) << np.uint32(16))
            row[j] = v * v
    elif is_bf16(lay):
        for j in range(cnt):
            row[j] = c.f32_from_bits(np.uint32(np.uint16(codes[i0 + np.uint64(j)])) << np.uint32(16))
    else:
        dp = (c.ONE, c.ZERO, c.ZERO, np.int32(0))  # decode_params of an unscaled, undithered block
        table = np.zeros(1, np.float32)  # a minifloat reads no table
        for j in range(cnt):
            row[j] = c.decode_value(np.int32(codes[i0 + np.uint64(j)]), lay, table, dp)


@njit(cache=True, forceinline=True, error_model="numpy")
def store(row, u, q, cnt, start, t, starts, keys, col, lay, bf16, is32, codes):
    """codes[start + j] of the stored values row[:cnt]: an fp32 state's as they are, a 16-bit
    minifloat's rounded (round16)."""
    if is32:
        for j in range(cnt):
            codes[np.uint64(start) + np.uint64(j)] = row[j]
    else:
        round16(row, u, q, cnt, start, t, starts, keys, col, lay, bf16, codes)


@njit(cache=True, forceinline=True, error_model="numpy")
def round16(row, u, q, cnt, start, t, starts, keys, col, lay, bf16, codes):
    """codes[start + j] of the stored values row[:cnt] (finite, as codec.stored_value leaves
    them); stochastic: uniforms of each piece of the run that lies in one tensor (a loop that
    packs), keys[t, col], keys[t, col + 1] of tensor t. Returns the tensor of the run's start."""
    rounding = lay[c.ROUND]
    while starts[t + 1] <= start:
        t += 1
    if rounding == c.STOCHASTIC:
        lo, tt = 0, t
        while lo < cnt:
            while starts[tt + 1] <= start + lo:
                tt += 1
            hi = min(cnt, starts[tt + 1] - start)
            k1, k2, first = keys[tt, col], keys[tt, col + 1], start - starts[tt]
            for j in range(lo, hi):
                u[j] = c.uniform16(first + j, k1, k2)
            lo = hi
    if bf16:
        round_bf16(row, u, cnt, rounding, lay[c.MAXORD], q)
    else:
        round_float(row, u, cnt, lay, rounding, c.ZERO, q)
    for j in range(cnt):
        codes[np.uint64(start) + np.uint64(j)] = np.uint16(q[j])
    return t


@njit(nogil=True, cache=True, error_model="numpy")
def decode16(b0, b1, part, codes, out, lay, numel):
    """out[i] = the stored value of codes[i] (uint16) for the runs b0 .. b1 - 1: its ordinal's
    value, signed, squared for a :sqrt state (quantizer.decode, unscaled). Returns 0."""
    for b in range(b0, b1):
        i0 = np.uint64(b * RUN)
        read_back(codes, i0, min(RUN, numel - b * RUN), False, False, lay, out[b * RUN:])
    return 0


F32 = np.empty(0, np.float32)  # the parameters' and gradients' arrays (tensor_views)


@njit(cache=True, inline="always", error_model="numpy")
def tensor_views(at, t, starts, like_m, like_v):
    """Tensor t's p, g (fp32), m and v codes (arrays like like_m, like_v) as views in which
    element i of the concatenation (starts[t] <= i < starts[t + 1]) is element i - starts[t]
    of the tensor: each base address at[t, k] moved back by starts[t] elements, so the pass
    indexes the concatenation whether the tensors lie end to end (flat arrays: at[t, k] is
    the array's start plus the tensor's offset) or each in its own memory."""
    n, s = starts[t + 1], np.uint64(starts[t])
    return (nv.view_like(F32, np.uint64(at[t, 0]) - s * np.uint64(4), n),
            nv.view_like(F32, np.uint64(at[t, 1]) - s * np.uint64(4), n),
            nv.view_like(like_m, np.uint64(at[t, 2]) - s * np.uint64(like_m.itemsize), n),
            nv.view_like(like_v, np.uint64(at[t, 3]) - s * np.uint64(like_v.itemsize), n))


@lru_cache(maxsize=None)
def adamw_kernel(mlay: tuple, vlay: tuple):
    """The AdamW / Adam step of flat fp32 parameters whose m and v are unscaled 16-bit
    minifloats or fp32 (lay tuples: compile-time constants, one compilation per pair, cached
    on disk): per run of at most RUN elements of one tensor, read m and v back (read_back),
    adamw._update (the fused path's rule, op for op rules.adamw, with its non-finite policy),
    store both (store; uniforms per tensor as encode16)."""
    mbf, vbf = is_bf16.py_func(mlay), is_bf16.py_func(vlay)  # closure constants
    m32, v32 = mlay[c.BITS] == 32, vlay[c.BITS] == 32  # fp32 states: read and stored as they are

    @njit(nogil=True, cache=True, error_model="numpy")
    def _adamw_pass(b0, b1_, part, at, like_m, like_v, runs, starts, keys, bad, scal, beta1, omb1, beta2, omb2, eps,
                    l2_wd, fresh_m, fresh_v):
        """Runs b0 .. b1_ - 1 (runs[r] = (first element, tensor): RUN elements or the rest of
        its tensor) of the tensors whose p, g, m codes and v codes start at at[t] (tensor_views:
        each tensor's own memory, or flat arrays' at the tensor's offset). p, g: fp32 (p
        updated in place; a non-finite g counts in bad[part, tensor] and steps as 0,
        adamw._update); m and v codes (arrays like like_m, like_v): uint16, read unless fresh,
        then written (an fp32 state's: fp32 values as they are); keys: uint32 [tensors + 1, 4],
        each tensor's (k1, k2) of m, of v."""
        b1, ob1, b2, ob2 = np.float32(beta1), np.float32(omb1), np.float32(beta2), np.float32(omb2)
        eps32, l2 = np.float32(eps), np.float32(l2_wd)
        decay, step_size, ibc2 = scal[1], scal[2], scal[3]
        mrow = np.empty(RUN, np.float32)
        vrow = np.empty(RUN, np.float32)
        u = np.zeros(RUN, np.float32)
        q = np.empty(RUN, np.int32)
        has_l2 = l2 != c.ZERO
        for b in range(b0, b1_):
            start, t = runs[b, 0], runs[b, 1]
            cnt = min(RUN, starts[t + 1] - start)
            i0 = np.uint64(start)
            p, g, mc, vc = tensor_views(at, t, starts, like_m, like_v)
            read_back(mc, i0, cnt, fresh_m, m32, mlay, mrow)
            read_back(vc, i0, cnt, fresh_v, v32, vlay, vrow)
            if has_l2:
                nb = _update(p, g, mrow, vrow, start, cnt, b1, ob1, b2, ob2, eps32, l2, decay, step_size, ibc2,
                             mlay, vlay, True)[0]
            else:
                nb = _update(p, g, mrow, vrow, start, cnt, b1, ob1, b2, ob2, eps32, l2, decay, step_size, ibc2,
                             mlay, vlay, False)[0]
            bad[part, t] += nb
            store(mrow, u, q, cnt, start, t, starts, keys, 0, mlay, mbf, m32, mc)
            store(vrow, u, q, cnt, start, t, starts, keys, 2, vlay, vbf, v32, vc)
        return 0

    return _adamw_pass


LION, SGD, MUON = 0, 1, 2  # the one-state rules momentum_kernel steps (kernels/cpu/lion.py, sgd.py, muon.py)


@lru_cache(maxsize=None)
def momentum_kernel(mlay: tuple):
    """The step of flat fp32 parameters whose one state m (Lion's momentum, SGD's or Muon's
    buffer) is an unscaled 16-bit minifloat or fp32 (lay: a compile-time constant, one
    compilation per layout, cached on disk; the rule an argument, tested once per run: one
    compilation serves the three rules): per run of at most RUN elements of one tensor, the
    gradient (non-finite -> 0, counted), m read back, the fused path's rule over the rows
    (lion_rows, sgd_rows, muon_rows: op for op rules.lion, rules.sgd, rules.muon_momentum),
    m stored (the value codec.stored_value gives, then rounded as encode16)."""
    mbf = is_bf16.py_func(mlay)  # a closure constant
    m32 = mlay[c.BITS] == 32

    @njit(nogil=True, cache=True, error_model="numpy")
    def _momentum_pass(b0, b1_, part, at, like_m, out, runs, starts, keys, bad, rule, scal, hyp, nesterov, use_wd,
                       fresh):
        """Runs b0 .. b1_ - 1 (runs[r] = (first element, tensor)) of rule LION, SGD or MUON,
        over the tensors whose p, g and m codes start at at[t, 0 .. 2] (tensor_views; column 3
        unused). p, g: fp32 (p updated in place by Lion and SGD; Muon writes its update to
        out, fp32, flat, and leaves p); m codes (arrays like like_m): uint16 (fp32 values for
        an fp32 state), read unless fresh, then written;
        keys: uint32 [tensors + 1, 2]; scal: rules.packed_scalars [lr, decay, ...];
        hyp: fp32 [4]: Lion (b1, 1 - b1, b2, 1 - b2), SGD (momentum, 1 - dampening, weight
        decay, 0), Muon (momentum, 1 - momentum, 0, 0); use_wd: SGD's weight decay != 0."""
        lr, decay = scal[0], scal[1]
        h0, h1, h2, h3 = hyp[0], hyp[1], hyp[2], hyp[3]
        prow = np.empty(RUN, np.float32)
        grow = np.empty(RUN, np.float32)
        mrow = np.empty(RUN, np.float32)
        urow = np.empty(RUN, np.float32)
        u = np.zeros(RUN, np.float32)
        q = np.empty(RUN, np.int32)
        for b in range(b0, b1_):
            start, t = runs[b, 0], runs[b, 1]
            cnt = min(RUN, starts[t + 1] - start)
            p, g, mc, _ = tensor_views(at, t, starts, like_m, like_m)
            bad[part, t] += c.load_grad(g, start, cnt, grow)
            read_back(mc, np.uint64(start), cnt, fresh, m32, mlay, mrow)
            if rule == MUON:
                muon_rows(grow, mrow, urow, cnt, h0, h1, nesterov)
                c.store_row(urow if nesterov else mrow, start, cnt, out)
            else:
                c.load_row(p, start, cnt, prow)
                if rule == LION:
                    lion_rows(prow, grow, mrow, cnt, h0, h1, h2, h3, lr, decay)
                else:
                    if use_wd:
                        coupled_decay(prow, grow, cnt, h2)
                    sgd_rows(prow, grow, mrow, cnt, h0, h1, nesterov, fresh, lr)
                c.store_row(prow, start, cnt, p)
            for j in range(cnt):
                mrow[j] = c.stored_value(mrow[j], mlay, False)
            store(mrow, u, q, cnt, start, t, starts, keys, 0, mlay, mbf, m32, mc)
        return 0

    return _momentum_pass
