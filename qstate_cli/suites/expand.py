"""Axes to points: ranges, the cross product, excludes, baseline points, stable keys.

Works on plain dicts (a validated run, see schema.py), so running a suite needs no
pydantic. A run is

    {"name", "kind", "defaults": {param: value}, "axes": {param: [values] | range},
     "excludes": [{param: value | [values]}], "baselines": [name]}

A range is inclusive of `stop`: `{start, stop, step}` gives start, start+step, ...;
`{start, stop, factor}` gives start, start*factor, ... (sizes sweep geometrically).
Points are the cross product of the axes in the order written (the last axis varies
fastest), then one baseline point per baseline and per combination of the axes other
than `config` and `rounding`. An exclude drops every point whose values match all its
keys (a list in an exclude matches any of its values; `baseline` matches baseline points).
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field

from ..kinds import KINDS
from .kinds import CONFIG_AXES

MAX_AXIS_VALUES = 10_000
_EPS = 1e-9


def range_values(spec: dict) -> list:
    """Values of a range mapping (inclusive stop); ints stay ints."""
    start, stop = spec["start"], spec["stop"]
    step, factor = spec.get("step"), spec.get("factor")
    integral = all(isinstance(v, int) for v in (start, stop, step if step is not None else factor))
    values, k = [], 0
    while len(values) <= MAX_AXIS_VALUES:
        value = start + k * step if step is not None else start * factor ** k
        if value > stop * (1 + _EPS) + _EPS:
            break
        values.append(int(round(value)) if integral else float(f"{value:.12g}"))
        k += 1
    return values


def axis_values(spec) -> list:
    return range_values(spec) if isinstance(spec, dict) else list(spec)


def point_key(params: dict) -> str:
    """A stable id of a point: sha1 of its parameters as canonical JSON (12 hex digits)."""
    text = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _matches(exclude: dict, assignment: dict) -> bool:
    for key, want in exclude.items():
        if key not in assignment:
            return False
        options = want if isinstance(want, list) else [want]
        if assignment[key] not in options:
            return False
    return True


@dataclass(frozen=True)
class Point:
    """One call of a hook: `params` go to the engine; `assignment` is what the axes chose."""

    run: str
    kind: str
    params: dict
    assignment: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return point_key(self.params)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.assignment.items()) or "defaults"


def _params(kind: str, defaults: dict, assignment: dict) -> dict:
    info = KINDS[kind]
    params = {**defaults}
    for key, value in assignment.items():
        params[info.baseline_param if key == "baseline" else key] = value
    for key in info.list_params:
        value = params.get(key, [])
        params[key] = list(value) if isinstance(value, (list, tuple)) else [value]
    return params


def expand_run(run: dict) -> list[Point]:
    """Every point of one run, excludes applied, in a stable order."""
    kind, axes = run["kind"], run.get("axes") or {}
    names = list(axes)
    values = [axis_values(axes[n]) for n in names]
    excludes = run.get("excludes") or []
    assignments = [dict(zip(names, combo)) for combo in itertools.product(*values)]
    other = [n for n in names if n not in CONFIG_AXES]
    seen, base_assignments = set(), []
    for baseline in run.get("baselines") or []:
        for combo in itertools.product(*(axis_values(axes[n]) for n in other)):
            a = {"baseline": baseline, **dict(zip(other, combo))}
            marker = json.dumps(a, sort_keys=True, default=str)
            if marker not in seen:
                seen.add(marker)
                base_assignments.append(a)
    points, keys = [], set()
    for a in assignments + base_assignments:
        if any(_matches(ex, a) for ex in excludes):
            continue
        defaults = dict(run.get("defaults") or {})
        if "baseline" in a:  # a baseline replaces the configurations
            for name in CONFIG_AXES:
                defaults.pop(name, None)
        point = Point(run["name"], kind, _params(kind, defaults, a), a)
        if point.key not in keys:  # the same parameters twice run once
            keys.add(point.key)
            points.append(point)
    return points
