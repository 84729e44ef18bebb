"""`qstate doctor --against`: two checkpoints' states, element by element.

Every state dequantized and compared element-wise; a difference names its worst element
by index in the state's shape; a different step or a different shape is an error
(`against`), as is a parameter or state present in this checkpoint only (`only-here`) or
in the other only (`only-there`); a state named differently on the two sides (torch's
`exp_avg`, qstate's `m`) is matched by its role when that role is left once on each side;
when one keys its parameters by index and the other by name (param_names, DCP) nothing
can be matched, which one `keys` error says; a different storage with equal values is a
warn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import Finding, finding, param_numel
from .states import OptimizerStates, StoredState


@dataclass
class StateDiff:
    """How one state differs between two checkpoints (values dequantized to fp32)."""

    differing: int
    max_abs_diff: float
    worst: tuple[int, ...]  # index of the worst element in the state's shape
    value_a: float
    value_b: float


def diff_state(a: StoredState, b: StoredState) -> StateDiff | None:
    """None when the dequantized values are equal (NaN equals NaN); else the difference."""
    va, vb = a.values.reshape(-1), b.values.reshape(-1)
    both_nan = torch.isnan(va) & torch.isnan(vb)
    neq = (va != vb) & ~both_nan
    if not bool(neq.any()):
        return None
    gap = torch.where(neq, (va - vb).abs(), torch.zeros(()))
    gap = torch.where(torch.isnan(gap), torch.full((), float("inf")), gap)
    flat = int(torch.argmax(gap))
    shape = a.values.shape if a.shape_known else b.values.shape
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if len(shape) else ()
    return StateDiff(int(neq.sum()), float(gap[flat]), worst, float(va[flat]), float(vb[flat]))


def where(index: tuple[int, ...]) -> str:
    return "(" + ",".join(str(i) for i in index) + ")"


def compare(a: OptimizerStates, b: OptimizerStates, name_b: str) -> tuple[list[Finding], dict[str, dict]]:
    """Findings of `a` against `b` and, per parameter of `a`, {differing, max_abs_diff}."""
    out: list[Finding] = []
    stats: dict[str, dict] = {}
    b_params = {p.key: p for p in b.params}
    if {a.keyed_by, b.keyed_by} == {"name", "index"} and not set(b_params) & {p.key for p in a.params}:
        out.append(Finding("error", "keys", a.path, "all", -1, None,
                           f"parameters are keyed by {a.keyed_by} here ({_keys(a)}), by {b.keyed_by} in {name_b} "
                           f"({_keys(b)}): none can be matched (an index is a position in the param groups, not "
                           f"a name; save both optimizers with param_names, or both without)"))
    for p in a.params:
        q = b_params.pop(p.key, None)
        if q is None:
            out.append(finding("error", "only-here", a, p, None, f"has states here but none in {name_b}", param_numel(p)))
            continue
        differing, max_abs = 0, 0.0
        if p.step != q.step:
            out.append(finding("error", "against", a, p, "step", f"step {_num(p.step)} here, {_num(q.step)} in {name_b}"))
        for name, sa, sb in _pairs(p.states, q.states):
            if sa is None or sb is None:
                only = "this checkpoint" if sb is None else name_b
                check = "only-here" if sb is None else "only-there"
                out.append(finding("error", check, a, p, name, f"{name} only in {only}", (sa or sb).numel))
                continue
            if not (sa.decoded and sb.decoded):  # a group's finding says why; nothing to compare
                continue
            if sa.numel != sb.numel:
                out.append(finding("error", "against", a, p, name, f"{name} has {sa.numel:,} elements here, {sb.numel:,} "
                                                              f"in {name_b}"))
                continue
            d = diff_state(sa, sb)
            if d is not None:
                differing += d.differing
                max_abs = max(max_abs, d.max_abs_diff)
                out.append(finding("error", "against", a, p, name,
                              f"{name}: {d.differing:,} of {sa.numel:,} elements differ; worst element "
                              f"{where(d.worst)} of {p.key}: {d.value_a:.6g} here, {d.value_b:.6g} in {name_b} "
                              f"(|diff| {d.max_abs_diff:.3g})", d.differing))
            if sa.storage != sb.storage:
                out.append(finding("warn" if d is None else "error", "storage", a, p, name,
                              f"{name} stored as {sa.storage} here, {sb.storage} in {name_b}"
                              + (" (values equal)" if d is None else ""), sa.numel))
        stats[p.key] = {"differing": differing, "max_abs_diff": max_abs}
    for q in b_params.values():
        out.append(Finding("error", "only-there", a.path, q.key, q.group, None, f"has states in {name_b} but none here",
                           param_numel(q)))
    return out, stats


def _pairs(here: dict, there: dict) -> list[tuple[str, object, object]]:
    """(label, state here, state there) for every state of one parameter in either checkpoint.

    States match by name; a state whose name the other side lacks matches by role (m, v)
    when that role is left exactly once on each side: torch's `exp_avg` against qstate's `m`,
    bitsandbytes' `state2` against torch's `exp_avg_sq`. Its label names both."""
    names = set(here) | set(there)
    lone_a = {n: here[n] for n in sorted(names) if n not in there}
    lone_b = {n: there[n] for n in sorted(names) if n not in here}
    pairs = [(n, here[n], there[n]) for n in sorted(names) if n in here and n in there]
    for role in ("m", "v"):
        a = [n for n, s in lone_a.items() if s.role == role]
        b = [n for n, s in lone_b.items() if s.role == role]
        if len(a) == 1 and len(b) == 1:
            pairs.append((f"{role} ({a[0]} here, {b[0]} there)", lone_a.pop(a[0]), lone_b.pop(b[0])))
    pairs += [(n, s, None) for n, s in lone_a.items()] + [(n, None, s) for n, s in lone_b.items()]
    return pairs


def _keys(o: OptimizerStates) -> str:
    keys = [p.key for p in o.params]
    return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")


def _num(x) -> str:
    return "none" if x is None else f"{x:g}"
