"""What a trace keeps of the optimizer that trained it: its name, the hyper-parameters the
replay uses, and how many steps it had taken (trace/recorder.py).

A trace holds one set of hyper-parameters: those of the parameter group holding the first
recorded tensor (groups.py). The replay steps every recorded tensor with it, so another
recorded group that differs in a key the replay reads (betas, eps, momentum, ...) is
replayed with values it did not train with; `differing_groups` says which, for the
recorder's warning.
"""
from __future__ import annotations

import torch

from ..optim.registry import OPTIMIZERS
from ..quant.config import StateConfig

def _recorded_keys() -> tuple:
    """torch's usual keys, then every hyper-parameter a registered optimizer's constructor
    takes (a new rule's own, e.g. RMSprop's alpha, is recorded and so replayed as trained)."""
    keys = ["lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "decoupled", "amsgrad",
            "maximize", "states", "seed"]
    for info in OPTIMIZERS.values():
        keys += [k for k in info.hparams() if k not in keys and k not in ("min_quant_numel", "backend", "reset")]
    return tuple(keys)


HPARAM_KEYS = _recorded_keys()
# the keys the replay's rules read (optim/optimizers.py, replay_notes): a recorded group differing in one is
# replayed with values it did not train with. Not lr (the statistics are relative), not weight decay (the
# replay has no parameters to decay), not states (diagnose picks the configurations).
REPLAYED_KEYS = ("betas", "eps", "momentum", "dampening", "nesterov", "amsgrad", "maximize")


def name_of(optimizer) -> str:
    """'adamw', 'adam', 'sgd', 'lion', 'muon', ...: the optimizer's class name, lower case."""
    return type(optimizer).__name__.lower()


def group_hparams(group: dict) -> dict:
    """JSON-able values of HPARAM_KEYS in one parameter group."""
    out = {}
    for key in HPARAM_KEYS:
        if key in group:
            val = group[key]
            if isinstance(val, torch.Tensor):
                val = val.item()
            if isinstance(val, StateConfig):  # qstate's optimizers hold their states parsed
                val = str(val)
            if isinstance(val, (tuple, list)):
                val = [float(v.item() if isinstance(v, torch.Tensor) else v) for v in val]
            if isinstance(val, (int, float, str, bool, list)) or val is None:
                out[key] = val
    return out


def differing_groups(optimizer, recorded: set[int], kept: int = 0) -> list[str]:
    """One line per parameter group other than `kept` (the one whose hyper-parameters the
    trace keeps) that holds a recorded tensor (`recorded`: ids of the parameters) and
    differs from group `kept` in a key the replay reads."""
    first = group_hparams(optimizer.param_groups[kept])
    out = []
    for i, group in enumerate(optimizer.param_groups):
        if i == kept or not any(id(p) in recorded for p in group["params"]):
            continue
        other = group_hparams(group)
        keys = [k for k in REPLAYED_KEYS if other.get(k) != first.get(k)]
        if keys:
            out.append(f"param_groups[{i}]: " + ", ".join(f"{k} {other.get(k)} (group {kept}: {first.get(k)})"
                                                          for k in keys))
    return out


def optimizer_step(optimizer) -> int:
    """Steps the optimizer has taken before recording began (torch and qstate optimizers keep
    a per-parameter 'step'); 0 for a fresh optimizer."""
    for st in optimizer.state.values():
        if isinstance(st, dict) and "step" in st:
            return int(st["step"])
    return 0
