"""The replay's whole configuration step in one numba call (kernels/cpu/replay_step.py), for
an AdamW/Adam trace replayed on CPU through the fused rule, codec and statistics.

step.step_config calls the rule, then per state the staleness model, the codec and
StateStats, then UpdateStats: ~8 kernels and ~100 Python and torch operations a step. Where
every one of those runs on the fused CPU path (the fused rule, both states block-scaled 4-
or 8-bit on the fused codec with its code statistics, UpdateStats fused, torch's sum order
found), `step` does the same step with one kernel call (and one more for the per-step
series), bit for bit: the same kernels compute every value. A step that evaluates the
staleness model, which reads the new states before they are stored, runs the rule alone
first (`rule`), then the model, then the rest of the step.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..kernels.cpu import PATH as CPU_PATH


def fused_step_for(c, rule, layout):
    """A kernels/cpu/replay_step.FusedAdamStep for configuration c (step.ConfigState), or None
    where its step does not run wholly on the fused CPU path (module docstring)."""
    from .recursions import FusedAdamRule

    owner = getattr(rule, "__self__", None)
    if not isinstance(owner, FusedAdamRule) or layout.device.type != "cpu" or set(c.states) != {"m", "v"}:
        return None
    if not c.update.fused or any(c.codec[s][0] != CPU_PATH or c.stats[s]._fused is None for s in c.states):
        return None
    from ..kernels.cpu.replay_step import FusedAdamStep, why_not

    counts = {s: c.stats[s]._fused for s in c.states}
    if why_not([c.states[s] for s in ("m", "v")], [counts[s] for s in ("m", "v")], layout.n, layout.unit):
        return None
    series = [(c.stats[s].units, c.stats[s].series) for s in ("m", "v")] + [(c.update.units, c.update.series)]
    step = FusedAdamStep(layout.n, layout.unit, c.states, counts, c.clamp, layout.valid is not None, series,
                         layout.valid, {s: c.stats[s].staleness.numel() for s in ("m", "v")})
    step.rule_of = owner  # its per-step scalars
    return step


def torch_aside(configs, device):
    """kernels/cpu/host.torch_aside(torch's thread count) where torch runs more than one
    intra-op thread on CPU and every configuration steps wholly on the fused path (c.fused),
    so torch's own few ops there (the gradients' cast) run on one thread and do not spin on
    the cores the kernels use next; else a no-op. Not
    where torch's sum order at that count was not found (the records follow it)."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n < 2 or not configs or any(c.fused is None for c in configs):
        return nullcontext()
    from ..kernels.cpu import host, torch_sum

    return host.torch_aside(n) if torch_sum.split_found() else nullcontext()


def rule(c, g) -> dict:
    """The new states of this step (the rule alone), for the staleness model to read before
    `step(..., ruled=True)` stores them."""
    _, m, v = c.fused.rule(g, c.x_hat["m"], c.x_hat["v"], c.fused.rule_of.scalars(c.since))
    return {"m": m, "v": v}


def step(c, sh, g, i: int, codec_step: int, ruled: bool = False) -> None:
    """Replay step t = i + 1 of configuration c against shadow sh, as step.step_config
    does it (c.since already counts this step; ruled: `rule` ran for it)."""
    fs, st = c.fused, c.stats
    keep = c.counted and st["m"].snapshot_due(i)
    x_hat, snap = fs.step(
        codec_step, i + 1, g, c.x_hat["m"], c.x_hat["v"], fs.rule_of.scalars(c.since), sh.update, sh.ref2_units,
        sh.x, sh.x2_units, {s: st[s].prev_code for s in ("m", "v")}, {s: st[s].last_change for s in ("m", "v")},
        keep, ruled, c.counted)
    for s in ("m", "v"):
        if keep:  # the errors, and the staleness histogram the kernel counted
            st[s]._snapshot(i + 1, snap[s][0], sh.x2_units[s], staleness=snap[s][1])
        c.x_hat[s] = x_hat[s]
