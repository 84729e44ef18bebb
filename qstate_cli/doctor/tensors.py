"""States whose tensors hold no values the doctor can read (their findings: run.py).

A checkpoint read with `weights_only=True` may hold sparse, nested or quantized tensors,
meta tensors (a shape without data: what a model or optimizer saved before its tensors
were materialized holds) or views that reach the same bytes many times (trace/plain.py).
No optimizer keeps a state like that, and every check (and `--against`) would fail on
its first operation, so such a state is kept undecoded, its storage named
("fp32 sparse_coo", "fp32 meta"), and reported as one `tensor` error per state:

    tensor   error  a state (or a part of one: qstate codes, torchao fields, bitsandbytes
                    qmap/absmax) that is not a dense tensor with data: its values cannot
                    be checked, and a resume cannot step it; with --against, such a state
                    of the other checkpoint is named too (it is not compared)
"""
from __future__ import annotations


import torch

from ..trace.plain import tensor_kind, tensor_problem
from .decode import FLOAT_NAMES, ROLES, StoredState, dtype_name, is_torchao



def parts(kind: str, key: str, value, entry: dict) -> list[tuple[str, torch.Tensor]]:
    """(label, tensor) of each tensor a state of this kind reads."""
    if kind == "qstate":
        return [(f"{key}.{k}", v) for k, v in value.items() if isinstance(v, torch.Tensor)]
    if kind == "torchao":
        return [(f"{key}.{k}", v) for k, v in vars(value).items() if isinstance(v, torch.Tensor)]
    if kind == "bnb":
        n = key[-1]
        aux = [(k, entry.get(k)) for k in (f"qmap{n}", f"absmax{n}", f"max{n}")]
        return [(key, value)] + [(k, v) for k, v in aux if isinstance(v, torch.Tensor)]
    return [(key, value)]


def unreadable_state(kind: str, key: str, value, entry: dict) -> StoredState | None:
    """None where every tensor of the state is plain; else an undecoded StoredState that
    says what is not (module docstring)."""
    for label, t in parts(kind, key, value, entry):
        what = tensor_kind(t)
        if not what:
            continue
        dtype = FLOAT_NAMES.get(t.dtype, dtype_name(t.dtype))
        try:
            numel = value.numel() if isinstance(value, torch.Tensor) and kind != "torchao" else t.numel()
        except (RuntimeError, NotImplementedError):
            numel = 0
        storage = f"{kind} ({label}: {dtype} {what})" if kind in ("qstate", "torchao") else f"{dtype} {what}"
        problem = tensor_problem(t) if label == key else f"{label} is {tensor_problem(t)}"
        return StoredState(key, ROLES.get(key, "other"), storage, kind != "plain", torch.zeros(0), 0,
                           shape_known=False, decoded=False, stored_numel=numel, unreadable=problem)
    return None


def kind_of(key: str, value) -> str:
    """Which reader a parameter's entry `key` goes to ('' where it is not a state)."""
    if isinstance(value, dict) and "codes" in value:
        return "qstate"
    if is_torchao(value):
        return "torchao"
    if isinstance(value, torch.Tensor) and key in ("state1", "state2") and value.dtype == torch.uint8:
        return "bnb"
    if isinstance(value, torch.Tensor) and (key in ROLES or (value.dim() > 0 and (value.is_floating_point()
                                                                                  or value.is_complex()))):
        return "plain"
    return ""
