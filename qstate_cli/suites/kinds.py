"""What a suite point runs: its kind's engine, on the kind's options (qstate_cli/kinds.py).

A suite point is a dict of parameters whose keys are the fields of the kind's options
dataclass, i.e. the command's long options with underscores (`--warmup-ms` -> `warmup_ms`,
`TRACE` -> `trace`). The runner calls the kind's hook with it:

    hook(params: dict) -> {"records": [flat rows], <extra>: [flat rows], ...}

The built-in hook fills the options (`point_options`: an unknown name or a bad value is a
QstateError, which stops the suite) and runs `execute(options)`; `check_point` runs the
same options' checks without the work (`suite validate`, and `run` for every point
before it creates any file). Engines are imported
by kind when first needed, so a build without one still validates and runs the other
kinds. Tests and plug-ins may replace a kind's hook (`register_hook`).

A suite gives `kernels` and `memory` their `config` and `baseline` lists explicitly: an
empty list means none (not the command's defaults), so a config point runs no baseline.
"""
from __future__ import annotations

from typing import Callable

from ..errors import QstateError
from ..kinds import KINDS, Kind, load, runnable_kinds
from ..progress import Progress

CONFIG_AXES = ("config", "rounding")  # dropped from baseline points
NONE = "none"  # what an explicit empty baseline list means to the bench engines

_overrides: dict[str, Callable[[dict], dict]] = {}


def _suite_kind(name: str) -> Kind:
    if name not in runnable_kinds():
        raise QstateError(f"unknown suite kind {name!r}; use one of {', '.join(runnable_kinds())}")
    return KINDS[name]


def register_hook(kind: str, hook: Callable[[dict], dict] | None) -> None:
    """Replace the hook of `kind` (tests, plug-ins); None restores the built-in one."""
    _suite_kind(kind)
    if hook is None:
        _overrides.pop(kind, None)
    else:
        _overrides[kind] = hook


def is_overridden(kind: str) -> bool:
    return kind in _overrides


def options_class(kind: str):
    """The options dataclass of `kind` (imported now)."""
    k = _suite_kind(kind)
    return load(k.options, f"suite kind {kind!r}")


def point_options(kind: str, params: dict):
    """The options a point of `kind` runs with, built as its hook builds them (QstateError
    for a bad name or value)."""
    k = _suite_kind(kind)
    params = dict(params)
    if k.baseline_param in k.list_params:  # an empty list means none, not the command's defaults:
        base = params.get(k.baseline_param)
        if base == []:  # a configuration point: no baselines
            params[k.baseline_param] = [NONE]
        elif base:  # a baseline point: none of our configurations
            params.update({n: [NONE] for n in k.list_params if n != k.baseline_param and params.get(n) == []})
    return options_class(kind).from_params(params, k.command)


def check_point(kind: str, params: dict, here: bool = True) -> None:
    """What the point's engine would refuse, found without doing any work (Options.check;
    here=False: a device by name only). A kind whose hook is replaced is not checked."""
    if not is_overridden(kind):
        point_options(kind, params).check(here)


def hook_for(kind: str, progress: Progress | None = None) -> Callable[[dict], dict]:
    """The function that runs one point of `kind`, with its engine imported now (a missing
    engine is a clear error before anything is measured)."""
    if kind in _overrides:
        return _overrides[kind]
    k = _suite_kind(kind)
    execute = load(k.engine, f"suite kind {kind!r}")
    options_class(kind)

    def run_point(params: dict) -> dict:
        return execute(point_options(kind, params), progress).parts()

    run_point.__qualname__ = f"{k.engine}"
    return run_point
