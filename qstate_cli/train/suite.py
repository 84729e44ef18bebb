"""Suite hook: one `bench train` point from a YAML suite's parameters.

    train_point({"config": ["bred-4bit", "nearest-4bit@reset=auto"], "steps": 200, "seeds": 2})
      -> {"records": [...], "series": [...]}

Keys mirror `qstate bench train`'s options with underscores (config, optimizer, steps,
model, seeds, seed, reset, lr, batch_size, eval_every, min_quant_numel, device,
backend, threads: 0 for torch's default); `config` is one name or a list. Unknown keys raise QstateError (with the
closest key), so a typo in a suite never silently runs the defaults.
"""
from __future__ import annotations

from ..errors import QstateError
from .study import TrainSettings, run_study

KEYS = ("config", "optimizer", "steps", "model", "seeds", "seed", "reset", "lr", "batch_size", "eval_every",
        "min_quant_numel", "device", "backend", "threads")
TYPES = {"steps": int, "seeds": int, "seed": int, "batch_size": int, "eval_every": int, "min_quant_numel": int,
         "threads": int, "lr": float, "optimizer": str, "model": str, "reset": str, "device": str, "backend": str}


def train_point(params: dict) -> dict:
    """Run the study for one suite point; returns its records, series and summary."""
    from ..quant.formats import suggest

    params = dict(params or {})
    unknown = [k for k in params if k not in KEYS]
    if unknown:
        raise QstateError(f"bench train: unknown parameter {unknown[0]!r}{suggest(unknown[0], KEYS)}")
    configs = params.pop("config", None)
    if isinstance(configs, str):
        configs = [configs]
    if configs is not None and not (isinstance(configs, list) and all(isinstance(c, str) for c in configs)):
        raise QstateError(f"bench train: config must be a name or a list of names, got {configs!r}")
    kwargs = {}
    for key, value in params.items():
        if value is None:
            continue
        try:
            kwargs[key] = TYPES[key](value)
        except (TypeError, ValueError):
            raise QstateError(f"bench train: {key} must be {TYPES[key].__name__}, got {value!r}") from None
    if "optimizer" in kwargs:
        kwargs["optimizer"] = kwargs["optimizer"].lower()
    kwargs.setdefault("device", "auto")
    if kwargs.get("threads") == 0:
        kwargs["threads"] = None
    doc = run_study(TrainSettings(**kwargs), configs)
    return {"records": doc["records"], "series": doc["series"], "summary": doc["summary"]}
