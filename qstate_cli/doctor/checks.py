"""The checks `qstate doctor` runs on optimizer states (states.py), as findings.

A finding is an `error` when it would change training after a resume (exit 1), a `warn`
when it costs memory or precision but training proceeds as before, an `info` otherwise.

Per parameter (`check_param`):

    nonfinite   error  NaN/Inf in a stored state (the update that reads it is NaN/Inf)
    flushed     error  v stored as fp16 (or fp8) with v == 0 where m != 0: in exact arithmetic
                       v >= (1 - beta2)^t * g^2 > 0 wherever m has seen a gradient, so a
                       zero is a value the storage dtype flushed (fp16 flushes below
                       2^-25 ~ 3e-8); fp32/bf16 (range to 1e-38) would have kept it, and
                       AdamW then divides m by eps alone (the ultralytics resume spike)
    zero-v      warn   the same zeros in an fp32/bf16 v, which cannot have flushed them (they
                       came in as zeros, e.g. dequantized from a format with a zero level)
    subnormal   warn   0 < |v| < the dtype's smallest normal (fp16: 6.1e-5): fewer
                       significant bits than the format's 11
    negative    error  v < 0 in a float-stored v (sqrt(v) is NaN)
    format      error  codes, scales or code book out of range (non-finite or negative
                       scales, a code book of the wrong size, unsorted or outside [-1, 1])
    dtype       error  a known state (exp_avg, exp_avg_sq, momentum_buffer, ...) stored as a
                       plain tensor of an integer or bool dtype (its values are not checked)
    shape       error  states of one parameter with different numbers of elements
    missing     error  a state its optimizer group keeps for the other parameters is absent
                       (it would restart from zero)
    step        error  a step counter that is not one number, a non-finite, negative or
                       fractional one, or a qstate state written at a later step than it
    orphan      error  a state whose param id no param group lists: a resume keeps it unused
                       (qstate's load_state_dict refuses it); qstate codes decode with the
                       settings all groups share, else stay undecoded
    layout      info   qstate states saved per element (FSDP2's elements form): the checkpoint's
                       bytes per param beside the format's in memory, so the larger number
                       does not read as an fp32 fallback
    upcast      warn   a state stored as fp32 where the optimizer keeps the others in low
                       bits (tensors of >= 4096 elements; a silent upcast: FSDP turning
                       8-bit AdamW into 32-bit, accelerate#1902)

Per optimizer (`check_optimizer`): step counters that disagree within a group (warn:
bias corrections differ; a parameter without a gradient at some steps explains it); a
param id listed more than once in the param groups (`duplicate`, error); per group
(`hparams`, error, one finding per value): an lr that is not a finite number >= 0, betas
that are not two numbers in [0, 1) (three for AdEMAMix), an eps (each, where a tuple) that
is not a finite number > 0, a non-finite weight_decay; in a qstate optimizer's groups a
missing `states` or a `seed` that is not an integer (the codes of that group's parameters
are left undecoded: no value check reads them). A parameter a group lists without a
state is no finding (before its first step it has none).

Two checkpoints (`--against`): doctor/against.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import clip
from ..quant.config import MIN_QUANT_NUMEL
from .decode import group_seed
from .states import OptimizerStates, ParamStates, StoredState, scalar

LOW_BIT_MIN_NUMEL = MIN_QUANT_NUMEL  # bitsandbytes, torchao and qstate keep smaller tensors in fp32


@dataclass
class Finding:
    severity: str  # "error" | "warn" | "info"
    check: str
    optimizer: str
    param: str
    group: int
    state: str | None
    message: str
    count: int = 0  # elements concerned (0: not a count)

    def record(self) -> dict:
        return dict(vars(self))


def finding(severity, check, opt: OptimizerStates, p: ParamStates, state, message, count=0) -> Finding:
    return Finding(severity, check, opt.path, p.key, p.group, state, message, count)


def _first_moment(p: ParamStates) -> StoredState | None:
    return next((s for s in p.states.values() if s.role == "m" and not s.non_float and s.decoded), None)


def v_state_counts(s: StoredState, m: StoredState | None) -> dict[str, int]:
    """flushed (v == 0 where m != 0), subnormal and negative counts of one float-stored v."""
    out = {"v_flushed": 0, "v_subnormal": 0, "v_negative": 0}
    if s.role != "v" or s.low_bit or s.non_float or not s.decoded:
        return out
    v = s.values.reshape(-1)
    if m is not None and m.numel == s.numel:
        out["v_flushed"] = int(((v == 0) & (m.values.reshape(-1) != 0)).sum())
    if s.float_dtype is not None:
        tiny = torch.finfo(s.float_dtype).tiny
        out["v_subnormal"] = int(((v.abs() > 0) & (v.abs() < tiny)).sum())
    out["v_negative"] = int((v < 0).sum())
    return out


def narrow_range(dtype: torch.dtype | None) -> bool:
    """A float dtype whose smallest normal is far above fp32's (fp16, fp8): it flushes
    values fp32 and bf16 keep."""
    return dtype is not None and torch.finfo(dtype).tiny > 1e-30


def v_counts(p: ParamStates) -> dict[str, int]:
    """The counts of v_state_counts summed over the parameter's v states."""
    total = {"v_flushed": 0, "v_subnormal": 0, "v_negative": 0}
    m = _first_moment(p)
    for s in p.states.values():
        for k, n in v_state_counts(s, m).items():
            total[k] += n
    return total


def check_param(opt: OptimizerStates, p: ParamStates, expected: set[str], low_bit_optimizer: bool) -> list[Finding]:
    out: list[Finding] = []
    if p.group < 0:
        unstepped = f" (the groups list {', '.join(opt.unstepped[:3])} without a state)" if opt.unstepped else ""
        outcome = ("qstate's load_state_dict refuses the checkpoint" if p.written else "a resume keeps it unused")
        undecoded = ("; its codes are not decoded (no group's states configuration and seed apply to it)"
                     if any(not s.decoded for s in p.states.values()) else "")
        out.append(finding("error", "orphan", opt, p, None, f"state of param {p.key} is in no param group{unstepped}: "
                                                       f"{outcome}{undecoded}", param_numel(p)))
    for s in p.states.values():
        if not s.decoded:
            continue  # its group's finding says why (check_groups); the orphan's above
        if s.non_float:
            out.append(finding("error", "dtype", opt, p, s.name, f"{s.name} of param {p.key} is {s.storage}; "
                                                            f"{_float_states(opt, p, s.name)}", s.numel))
            continue
        bad = ~torch.isfinite(s.values)
        if bool(bad.any()):
            nan = int(torch.isnan(s.values).sum())
            n = int(bad.sum())
            out.append(finding("error", "nonfinite", opt, p, s.name, f"{s.name}: {n:,} non-finite values ({nan:,} NaN, "
                                                              f"{n - nan:,} Inf)", n))
        for problem in s.problems:
            out.append(finding("error", "format", opt, p, s.name, f"{s.name} ({s.storage}): {problem}"))
        out += _v_findings(opt, p, s)
        if low_bit_optimizer and not s.low_bit and s.role in ("m", "v") and s.numel >= LOW_BIT_MIN_NUMEL:
            out.append(finding("warn", "upcast", opt, p, s.name,
                          f"{s.name}: {s.numel:,} elements stored as {s.storage} ({s.nbytes:,} bytes) where this "
                          f"optimizer keeps its other states in low bits: stored dequantized (a silent upcast)",
                          s.numel))
    sizes = {s.name: s.numel for s in p.states.values() if s.decoded}
    if len(set(sizes.values())) > 1:
        out.append(finding("error", "shape", opt, p, None, "states of different sizes: "
                      + ", ".join(f"{k} {tuple(p.states[k].values.shape)}" for k in sizes)))
    for name in sorted(expected - set(p.states)):
        out.append(finding("error", "missing", opt, p, name, f"{name} missing (the other parameters of group {p.group} "
                                                        f"keep it; a resume restarts it from zero)", param_numel(p)))
    if p.step_problem:
        out.append(finding("error", "step", opt, p, "step", f"step counter {p.step_problem} is not a number"))
    if p.step is not None and (not math.isfinite(p.step) or p.step < 0 or p.step != int(p.step)):
        out.append(finding("error", "step", opt, p, "step", f"step counter {p.step!r} is not a count of steps"))
    for name, written in p.written.items():
        if p.step is not None and written > p.step:
            out.append(finding("error", "step", opt, p, name, f"{name} written at step {written}, after the step counter "
                                                         f"{p.step:g}"))
    per_element = [s for s in p.states.values() if s.layout == "elements" and s.low_bit and s.numel]
    if per_element:
        stored = sum(s.nbytes for s in per_element)
        held = sum(s.held_nbytes for s in per_element)
        n = max(s.numel for s in per_element)
        names = ", ".join(f"{s.name} ({s.storage.removeprefix('qstate ')})" for s in per_element)
        out.append(finding("info", "layout", opt, p, None,
                      f"{names} saved per element: FSDP2's checkpoint form where a row is not whole blocks (a "
                      f"byte per code, its block's scale and a block-start mark per element), "
                      f"{stored / n:.4g} B/param here; the format holds {held / n:.4g} B/param in memory "
                      f"(memory_bytes): a checkpoint layout, not an fp32 fallback", n))
    return out


def param_numel(p: ParamStates) -> int:
    return p.numel


def _float_states(opt: OptimizerStates, p: ParamStates, state: str) -> str:
    """What stores `state` instead, by who wrote it (torch's class from its group's keys)."""
    if state in ("state1", "state2"):
        return "bitsandbytes keeps its states as uint8 codes or floating point"
    if state in ("m", "v"):
        return "qstate keeps its states as codes and scales or floating point"
    group = opt.groups[p.group] if 0 <= p.group < len(opt.groups) else {}
    if "decoupled_weight_decay" in group:
        who = "AdamW" if group["decoupled_weight_decay"] else "Adam"
    elif "momentum" in group and "betas" not in group:
        who = "SGD"
    else:
        who = "torch.optim"
    return f"{who}'s states are floating point"


def _v_findings(opt: OptimizerStates, p: ParamStates, s: StoredState) -> list[Finding]:
    if s.role != "v" or s.low_bit:
        return []
    out = []
    m = _first_moment(p)
    counts = v_state_counts(s, m)
    dtype = s.float_dtype
    if counts["v_flushed"] and narrow_range(dtype):
        out.append(finding("error", "flushed", opt, p, s.name,
                      f"{s.name} stored as {s.storage}: {counts['v_flushed']:,} values are zero where {m.name} is not "
                      f"(flushed by {s.storage}; fp32 or bf16 would have kept them, and the update there is "
                      f"m / eps)", counts["v_flushed"]))
    elif counts["v_flushed"]:
        out.append(finding("warn", "zero-v", opt, p, s.name,
                      f"{s.name} stored as {s.storage}: {counts['v_flushed']:,} values are zero where {m.name} is not "
                      f"({s.storage} did not flush them: they came in as zeros, e.g. dequantized from a format "
                      f"with a zero level)", counts["v_flushed"]))
    if counts["v_subnormal"] and dtype is not None:
        out.append(finding("warn", "subnormal", opt, p, s.name,
                      f"{s.name} stored as {s.storage}: {counts['v_subnormal']:,} values below its normal range "
                      f"({torch.finfo(dtype).tiny:.2g}), kept with fewer significant bits", counts["v_subnormal"]))
    if counts["v_negative"]:
        out.append(finding("error", "negative", opt, p, s.name, f"{s.name}: {counts['v_negative']:,} negative values "
                                                           f"(sqrt(v) is NaN)", counts["v_negative"]))
    return out


def expected_states(opt: OptimizerStates) -> dict[int, set[str]]:
    """Per group: the states most of its parameters keep (what a parameter should have)."""
    by_group: dict[int, list[set[str]]] = {}
    for p in opt.params:
        by_group.setdefault(p.group, []).append(set(p.states))
    out = {}
    for group, sets in by_group.items():
        names = set().union(*sets)
        out[group] = {n for n in names if sum(n in s for s in sets) * 2 > len(sets)}
    return out


def check_optimizer(opt: OptimizerStates) -> list[Finding]:
    """Every finding of one optimizer's states (module docstring)."""
    expected = expected_states(opt)
    low_bit = any(s.low_bit for p in opt.params for s in p.states.values())
    out: list[Finding] = []
    for p in opt.params:
        out += check_param(opt, p, expected.get(p.group, set()), low_bit)
    for key, groups in opt.duplicates.items():
        p = next((p for p in opt.params if p.key == key), None)
        out.append(Finding("error", "duplicate", opt.path, key, groups[0], None,
                           f"param {key} listed {len(groups)} times in param_groups (groups "
                           f"{', '.join(map(str, groups))}): one id per parameter; a resume gives its state to one "
                           f"of those places only", param_numel(p) if p else 0))
    out += check_groups(opt)
    steps: dict[int, list[ParamStates]] = {}
    for p in opt.params:
        if p.step is not None:
            steps.setdefault(p.group, []).append(p)
    for group, params in steps.items():
        values = sorted({p.step for p in params})
        if len(values) > 1:
            top = max(values)
            behind = [p for p in params if p.step != top]
            worst = min(behind, key=lambda p: p.step)
            out.append(Finding("warn", "steps", opt.path, worst.key, group, "step",
                               f"group {group}: step counters disagree ({len(behind)} of {len(params)} parameters "
                               f"behind {top:g}, {worst.key} at {worst.step:g}): their bias corrections differ",
                               len(behind)))
    return out


def check_groups(opt: OptimizerStates) -> list[Finding]:
    """One `hparams` error per bad hyper-parameter of a group (module docstring); in a
    qstate optimizer's groups also a missing `states` and a `seed` that is not an integer."""
    out = []
    qstate = any(p.written for p in opt.params)
    for gi, group in enumerate(opt.groups):
        problems = list(hparam_problems(group)) + (list(qstate_group_problems(opt, gi, group)) if qstate else [])
        for name, problem in problems:
            out.append(Finding("error", "hparams", opt.path, f"param_groups[{gi}]", gi, name, problem,
                               sum(p.numel for p in opt.params if p.group == gi) if name in QSTATE_KEYS else 0))
    return out


QSTATE_KEYS = ("states", "seed")


def qstate_group_problems(opt: OptimizerStates, gi: int, group: dict):
    """(name, message) for a qstate group without a `states` configuration or whose `seed`
    is not an integer: its codes cannot be decoded, and qstate's load_state_dict refuses it
    (a missing `states`) or its steps fail (a bad `seed`)."""
    undecoded = sum(not s.decoded for p in opt.params if p.group == gi for s in p.states.values())
    codes = f"; {undecoded} state(s) of its parameters left undecoded" if undecoded else ""
    if group.get("states") is None:
        yield "states", (f"group {gi} names no states configuration (no 'states' entry): the format of its codes is "
                         f"unknown, and qstate's load_state_dict refuses the checkpoint{codes}")
        codes = ""
    if "seed" in group and group_seed(group) is None:
        yield "seed", (f"seed {clip(repr(group['seed']))} ({type(group['seed']).__name__}) of group {gi} is not an "
                       f"integer: the replay streams its codes were rounded with cannot be drawn{codes}")


def hparam_problems(g: dict):
    """(name, message) of each of lr, betas, eps, weight_decay that no optimizer could use."""
    def show(x) -> str:
        return clip(repr(x))

    def finite(x) -> float | None:
        v = scalar(x)
        return v if v is not None and math.isfinite(v) else None

    if g.get("lr") is not None and not (finite(g["lr"]) is not None and finite(g["lr"]) >= 0):
        yield "lr", f"lr {show(g['lr'])} is not a finite learning rate >= 0"
    if "betas" in g:
        b = g["betas"]
        vals = [scalar(x) for x in b] if isinstance(b, (list, tuple)) else []
        if len(vals) not in (2, 3) or not all(v is not None and 0 <= v < 1 for v in vals):
            yield "betas", f"betas {show(b)} are not two numbers in [0, 1)"
    if g.get("eps") is not None:
        eps = g["eps"] if isinstance(g["eps"], (list, tuple)) else [g["eps"]]  # Adafactor's: a pair
        if not eps or not all(finite(e) is not None and finite(e) > 0 for e in eps):
            yield "eps", f"eps {show(g['eps'])} is not a finite number > 0 (v's floor in the update's denominator)"
    if g.get("weight_decay") is not None and finite(g["weight_decay"]) is None:
        yield "weight_decay", f"weight_decay {show(g['weight_decay'])} is not a finite number"
