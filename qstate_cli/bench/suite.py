"""Hooks for the YAML suite runner: one benchmark point from a dict of parameters.

    kernels_point({"numel": [4096], "config": ["bred-4bit"], "baseline": ["none"]})
    memory_point({"model": "small-lm"})

Keys mirror the CLI options with underscores (bits, optimizer, config, rounding, numel,
model, dtype, device, baseline, backend, warmup_ms, rep_ms, cuda_graph; memory: model,
numel, config, optimizer, dtype, device, baseline) plus `seed`; a scalar is accepted
where a list is expected, counts may be written 1e6 or 2^20. Output paths are the
runner's business (json/csv are not parameters). An unknown key raises QstateError.
Returns {"records": [...]} as in docs/results.md (kinds "kernels" and "memory").
"""
from __future__ import annotations

from dataclasses import fields

from ..errors import QstateError
from ..quant.formats import suggest
from . import kernels, memory
from .shapes import parse_count


def _options(cls, params: dict, what: str):
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in (params or {}).items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise QstateError(f"unknown parameter {key!r} for {what}{suggest(name, list(known))}")
        if "list" in str(known[name].type) and not isinstance(value, (list, tuple)):
            value = [value]
        if name == "numel":
            value = [parse_count(v) for v in value]
        elif name in ("dtype", "baseline", "backend", "rounding", "model", "config") and isinstance(value, list):
            value = [str(v) for v in value]
        values[name] = value
    return cls(**values)


def _no_default_baselines(params: dict) -> dict:
    """The runner passes `baseline: []` to a config point: none, not the command's defaults."""
    params = dict(params or {})
    if "baseline" in params and params["baseline"] in ([], ()):
        params["baseline"] = ["none"]
    return params


def kernels_point(params: dict) -> dict:
    """Run `qstate bench kernels` with these parameters; returns {"records": [...]}."""
    p = kernels.plan(_options(kernels.KernelsOptions, _no_default_baselines(params), "bench kernels"))
    return {"records": kernels.run(p)}


def memory_point(params: dict) -> dict:
    """Run `qstate bench memory` with these parameters; returns {"records": [...]}."""
    p = memory.plan(_options(memory.MemoryOptions, _no_default_baselines(params), "bench memory"))
    return {"records": memory.run(p)}
