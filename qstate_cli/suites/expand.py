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
A run may have at most MAX_POINTS points before excludes (counted, not built, first).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field

from ..errors import QstateError
from ..kinds import KINDS
from .kinds import CONFIG_AXES

MAX_AXIS_VALUES = 10_000
MAX_POINTS = 10_000  # per run, before excludes: the cross product is counted before it is built
_EPS = 1e-9


def range_values(spec: dict) -> list:
    """Values of a range mapping (inclusive stop); ints stay ints."""
    start, stop = spec["start"], spec["stop"]
    step, factor = spec.get("step"), spec.get("factor")
    for key, value in (("start", start), ("stop", stop), ("step", step), ("factor", factor)):
        if isinstance(value, float) and not math.isfinite(value):
            raise QstateError(f"{key}: must be a finite number (got {value})")
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


def count_points(run: dict) -> int:
    """Points of a run before excludes: the cross product's size plus the baseline points."""
    axes = run.get("axes") or {}
    sizes = {n: len(axis_values(v)) for n, v in axes.items()}
    other = math.prod(v for n, v in sizes.items() if n not in CONFIG_AXES)
    return math.prod(sizes.values()) + len(run.get("baselines") or []) * other


def check_points(run: dict) -> None:
    n = count_points(run)
    if n > MAX_POINTS:
        raise QstateError(f"run {run.get('name') or run.get('kind')!r} has {n:,} points (the product of its axes); "
                          f"the limit is {MAX_POINTS:,}: split it or use fewer values")


def expand_run(run: dict) -> list[Point]:
    """Every point of one run, excludes applied, in a stable order."""
    check_points(run)
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
