"""One replay step (replay.py runs them): the fp32 shadow's and one configuration's.

    step_shadow  : fp32 states reset when their schedule says so, then the rule:
                   u_ref, s = rule(g, s_prev); per-unit sums of s^2 and u_ref^2 for the statistics
                   (the fused AdamW rule: all of it in one pass, FusedAdamRule.shadow_step)
    step_config  : a reset when the configuration's schedule says so, then the rule on the
                   states read back, the staleness model (on its steps), each state stored
                   (store: encode + decode, v clamped at 0, padding 0) and its statistics
                   against the shadow, then the update's; on CPU, where every part is fused,
                   the whole step in one kernel call (fused_step.py)

A step of one configuration writes only its own ConfigState and reads the shadow and the
gradients, so the configurations of a step can run on several threads
(ReplayOptions.config_threads) with the same records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels.cpu import PATH as CPU_PATH  # the fused CPU codec's path (no numba imported)
from ..quant import Stream
from ..quant.config import StateConfig
from . import fused_step
from .layout import Layout
from .recursions import Recursion
from .stats import UpdateStats, unit_sums


@dataclass
class Shadow:
    """fp32 states under one reset schedule (period None: never reset)."""

    period: int | None
    x: dict
    since: int = 0
    prev: dict = field(default_factory=dict)  # the states before this step (after a reset: zeros)
    reset_now: bool = False
    x2_units: dict = field(default_factory=dict)
    update: torch.Tensor | None = None
    ref2_units: torch.Tensor | None = None
    rows: list = field(default_factory=list)  # the fused step's two sets of output rows (shadow_rows)
    sigma2: torch.Tensor | None = None  # this step's bias-corrected v before it (gaussian_arg), once for all
    counts: object = None  # a trace with absent rows: each tensor's own step count (gaps.py)


@dataclass
class ConfigState:
    """One configuration's quantized states, statistics and schedule during a replay."""

    cfg: StateConfig
    period: int | None
    period_reason: str
    states: dict  # name -> QuantizedState
    x_hat: dict
    stats: dict  # name -> StateStats
    update: UpdateStats
    clamp: dict  # name -> bool (v on a grid that can read back below 0: clamped, as base.py does)
    models: dict  # name -> ModelStats (quantized states only)
    shadow: int | None  # key of the fp32 shadow it is measured against
    codec: dict  # name -> [path, why the reference ran or None] (codec.py)
    since: int = 0  # steps since the start or the last reset (with gaps: replayed steps; c.counts resets)
    fused: object | None = None  # the whole step in one kernel call (fused_step.py), or None
    counted: bool = True  # the states' statistics taken (ReplayOptions.state_stats; else they stay at 0)
    counts: object = None  # a trace with absent rows: each tensor's own step count (gaps.py)


def step_shadow(sh: Shadow, rec: Recursion, g: torch.Tensor, layout: Layout, rule: Callable, gaps=None,
                i: int = 0) -> None:
    """fp32 states: reset when the schedule says so, then one step of the rule (with `gaps`,
    a trace's absent rows: each tensor at its own step count and reset on it, held where
    absent; sh.since keeps the global schedule for the Gaussian model; gaps.py)."""
    sh.reset_now = sh.period is not None and sh.since >= sh.period
    if sh.reset_now:  # the global schedule (with gaps: the Gaussian model's build-up only, gaps.py)
        sh.since = 0
        if gaps is None:
            sh.x = {s: torch.zeros_like(x) for s, x in sh.x.items()}
    if gaps is not None:  # each tensor's own reset (gaps.py)
        if sh.counts is None:
            sh.counts = gaps.counts()
        due = gaps.due(i, sh.counts, sh.period)
        if due:
            idx = gaps.index(due)
            sh.x = {s: x.index_fill(0, idx, 0.0) for s, x in sh.x.items()}
    first = {s: sh.since == 0 for s in rec.states}
    sh.prev = sh.x
    sh.since += 1
    sh.sigma2 = None
    if gaps is not None:  # the reference rule (gaps.py), then the sums as below
        sh.update, sh.x = gaps.step(rule, g, sh.x, sh.counts, i)
        sh.x2_units = {s: unit_sums(sh.x[s] * sh.x[s], layout.unit) for s in rec.states}
        sh.ref2_units = unit_sums(sh.update * sh.update, layout.unit)
        return
    owner = getattr(rule, "__self__", None)  # the fused rule: the step and its sums in one pass
    fused = owner.shadow_step(g, sh.x, sh.since, layout.unit, shadow_rows(sh, layout)) \
        if hasattr(owner, "shadow_step") else None
    if fused is not None:
        sh.update, sh.x, sh.x2_units, sh.ref2_units = fused
        return
    sh.update, sh.x = rule(g, sh.x, sh.since, first)
    sh.x2_units = {s: unit_sums(sh.x[s] * sh.x[s], layout.unit) for s in rec.states}
    sh.ref2_units = unit_sums(sh.update * sh.update, layout.unit)


def shadow_rows(sh: Shadow, layout: Layout) -> tuple:
    """What the fused shadow step writes (u, m, v fp32 [n], per-unit sums fp32 [3, n / unit]):
    of two sets made once, the one the states before this step (sh.x, read through sh.prev
    during the step) are not in. A new set each step paid its page faults: 0.48 -> 0.16 s per
    100 steps of 2**20 elements replayed with seven configurations (docs/diagnose.md)."""
    if not sh.rows:
        n, f32 = layout.n, torch.float32
        sh.rows = [tuple(torch.empty(n, dtype=f32) for _ in range(3)) + (torch.empty(3, n // layout.unit, dtype=f32),)
                   for _ in range(2)]
    return sh.rows[1] if sh.x["m"] is sh.rows[0][1] else sh.rows[0]


def step_config(c: ConfigState, sh: Shadow, rec: Recursion, g: torch.Tensor, i: int, step: int,
                 padding, layout: Layout, model: bool, rule: Callable, gaps=None) -> None:
    """One optimizer step of a quantized configuration, as QuantizedOptimizer._step_param
    does it, then its statistics against the shadow (with `gaps`: each tensor at its own step
    count and reset on it, an absent tensor's states and codes held as read back; gaps.py)."""
    if gaps is not None:  # each tensor resets on its own count (gaps.py)
        if c.counts is None:
            c.counts = gaps.counts()
        due = gaps.due(i, c.counts, c.period)
        if due:
            idx = gaps.index(due)
            for s, q in c.states.items():
                c.stats[s].on_reset(i, idx)
                gaps.clear(q, due)
                c.x_hat[s] = c.x_hat[s].index_fill(0, idx, 0.0)
    elif c.period is not None and c.since >= c.period:
        c.since = 0
        for s, q in c.states.items():
            c.stats[s].on_reset(i)
            q.reset()
            c.x_hat[s] = torch.zeros_like(c.x_hat[s])
    c.since += 1  # with gaps: replayed steps, unused (each tensor's count is c.counts)
    if c.fused is not None:  # the whole step in one kernel call, the model's reads before it (fused_step.py)
        if model:
            observe_models(c, sh, rec, i, fused_step.rule(c, g))
        return fused_step.step(c, sh, g, i, step, ruled=model)
    if gaps is not None:
        u, new = gaps.step(rule, g, c.x_hat, c.counts, i)
    else:
        first = {s: q.written == 0 for s, q in c.states.items()}
        u, new = rule(g, c.x_hat, c.since, first)
    if model:  # before x_hat moves on: the step's own nominal update
        observe_models(c, sh, rec, i, new)
    for s, q in c.states.items():
        saved = gaps.save(i, q) if gaps is not None else None
        x_hat = store(q, new[s], step, c.clamp[s], padding, c.codec[s][0] == CPU_PATH)
        if gaps is not None:  # an absent tensor's state: the value read back and the codes before, bit for bit
            gaps.hold(i, x_hat, c.x_hat[s])
            gaps.restore(q, saved)
        if c.counted:
            c.stats[s].observe(i, new[s], c.x_hat[s], x_hat, sh.x[s], sh.x2_units[s], q.codes)
        c.x_hat[s] = x_hat

    c.update.observe(i, u, sh.update, sh.ref2_units)


def observe_models(c: ConfigState, sh: Shadow, rec: Recursion, i: int, new: dict) -> None:
    """The staleness model of each quantized state on this step's nominal update (x_hat -> new)."""
    for s, m in c.models.items():
        m.observe(i, c.x_hat[s], new[s], sh.prev[s], gaussian_arg(rec, c.cfg.spec(s), s, sh))


def store(q, x: torch.Tensor, step: int, clamp: bool, padding, fused: bool) -> torch.Tensor:
    """Encode x into q and return the value read back as the optimizer keeps it: a v read
    back below 0 clamped to 0 (base.py), the layout's padding 0. The fused CPU codec does
    both in its pass (kernels/cpu/replay.py: the same bits as the two torch ops)."""
    if fused:
        q.encode(x, step, clamp_zero=clamp, zero_padding=padding is not None)
        return q.decode()
    q.encode(x, step)
    x_hat = q.decode()
    if clamp:
        x_hat = x_hat.clamp(min=0.0)
    if padding is not None:
        x_hat.index_fill_(0, padding, 0.0)
    return x_hat


def gaussian_arg(rec: Recursion, spec, state: str, sh: Shadow):
    """The Gaussian model's argument for staleness.predict (Adam only; an unscaled float v
    keeps theory.py's curve): ("v", beta2, c_t) or ("m", beta1, sigma^2 = bias-corrected v)."""
    if not rec.adam_moments:
        return None
    b2 = rec.betas["v"]
    c = 1.0 - b2 ** (sh.since - 1)
    if state == "v":
        return None if spec.fmt.kind == "float" and not spec.has_scales else ("v", b2, c)
    model_inputs(rec, sh)
    return ("m", rec.betas["m"], sh.sigma2)


def model_inputs(rec: Recursion, sh: Shadow) -> None:
    """What the Gaussian model of every configuration measured against shadow sh reads on this
    step, made once (the replay's shadow phase of a model step): sigma^2 = v / c_t, the
    bias-corrected v before the step (Adam; a new fp32 [n] each time: ~1-3 ms at 2**20
    elements, which each configuration paid)."""
    if sh.sigma2 is None and rec.adam_moments:
        c = 1.0 - rec.betas["v"] ** (sh.since - 1)
        sh.sigma2 = sh.prev["v"] / c if c > 0 else torch.zeros_like(sh.prev["v"])


def stream_for(layout: Layout, spec, seed: int, state_id: int):
    if spec.rounding == "stochastic":
        return layout.stream(seed, state_id, "element", 1)
    if spec.rounding == "bred":
        return layout.stream(seed, state_id, "block", spec.dither_block)
    return Stream(seed, 0, state_id)  # nearest draws no random bits
