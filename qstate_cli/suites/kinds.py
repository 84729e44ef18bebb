"""What each suite kind runs: its engine hook, its CLI command, how baselines are passed.

A suite point is a dict of parameters whose keys mirror the CLI option names of the
kind's command with underscores (`--warmup-ms` -> `warmup_ms`, `TRACE` -> `trace`).
The runner calls the kind's hook with it:

    hook(params: dict) -> {"records": [flat rows], <extra>: [flat rows], ...}

and raises QstateError on a parameter it does not know. Hooks are imported lazily, by
kind, so a build without an engine still validates and runs the other kinds.

Baselines. `kernels` and `memory` pass both `config` and `baseline` to every point as
lists: a config point has `config: [NAME]` and `baseline: []`, a baseline point has
`config: []` and `baseline: [NAME]`; the hook runs exactly what it is given (an empty
list means none, not the command's defaults). For `diagnose` and `train` a baseline is a
configuration like any other (e.g. `torchao-4bit`), so a baseline point sets `config`.
Baseline points are made once per combination of the axes other than `config` and
`rounding`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..errors import QstateError

KIND_NAMES = ("kernels", "memory", "diagnose", "train")
CONFIG_AXES = ("config", "rounding")  # dropped from baseline points
OUTPUT_OPTIONS = ("json", "csv", "html", "markdown", "out", "output")  # the runner writes results itself


@dataclass(frozen=True)
class Kind:
    name: str
    hook: str  # "module:function", imported on first use
    command: tuple[str, ...]  # the CLI command whose options the params mirror
    baseline_param: str  # the param a baseline point sets
    list_params: tuple[str, ...] = ()  # params always passed as lists


KINDS: dict[str, Kind] = {
    "kernels": Kind("kernels", "qstate_cli.bench.suite:kernels_point", ("bench", "kernels"), "baseline",
                    ("config", "baseline")),
    "memory": Kind("memory", "qstate_cli.bench.suite:memory_point", ("bench", "memory"), "baseline",
                   ("config", "baseline")),
    "diagnose": Kind("diagnose", "qstate_cli.diagnose.suite:diagnose_point", ("diagnose",), "config"),
    "train": Kind("train", "qstate_cli.train.suite:train_point", ("bench", "train"), "config"),
}

_overrides: dict[str, Callable[[dict], dict]] = {}


def register_hook(kind: str, hook: Callable[[dict], dict] | None) -> None:
    """Replace the hook of `kind` (tests, plug-ins); None restores the built-in one."""
    if kind not in KINDS:
        raise QstateError(f"unknown suite kind {kind!r}; use one of {', '.join(KIND_NAMES)}")
    if hook is None:
        _overrides.pop(kind, None)
    else:
        _overrides[kind] = hook


def is_overridden(kind: str) -> bool:
    return kind in _overrides


def hook_for(kind: str) -> Callable[[dict], dict]:
    """The engine function of `kind`, imported now; a missing engine is a clear error."""
    if kind in _overrides:
        return _overrides[kind]
    if kind not in KINDS:
        raise QstateError(f"unknown suite kind {kind!r}; use one of {', '.join(KIND_NAMES)}")
    module_name, func_name = KINDS[kind].hook.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise QstateError(f"suite kind {kind!r} needs {module_name}.{func_name}, which this build does not have "
                          f"({exc})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise QstateError(f"suite kind {kind!r} needs {module_name}.{func_name}, which {module_name} does not define")
    return func


def command_params(kind: str) -> set[str] | None:
    """Parameter names of the kind's CLI command (`--warmup-ms` -> warmup_ms, argument
    TRACE -> trace), without output options; None when the command is not in this build."""
    import typer

    from ..cli import app

    # duck-typed: Typer >= 0.20 vendors its own click, so no isinstance on click classes
    cmd = typer.main.get_command(app)
    for part in KINDS[kind].command:
        commands = getattr(cmd, "commands", None)
        if commands is None or part not in commands:
            return None
        cmd = commands[part]
    names: set[str] = set()
    for param in cmd.params:
        long_opts = [opt[2:].replace("-", "_") for opt in param.opts if opt.startswith("--")]
        names.update(long_opts if param.param_type_name == "option" else [param.name])
    return names - set(OUTPUT_OPTIONS) - {"help"}
