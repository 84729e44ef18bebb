"""Fused Triton kernels (one module per op) that reproduce quant/ and optim/rules.py bit for bit.

`available(device)` says whether kernels can run for tensors on `device`: Triton must
import, and the device must be CUDA, or Triton's interpreter must be on
(TRITON_INTERPRET=1, set before triton is imported) for CPU tensors.
"""
from __future__ import annotations

import os

import torch


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no kernels
        return f"triton is not importable: {exc}"
    return None


def unavailable_reason(device) -> str | None:
    err = _triton_import_error()
    if err:
        return err
    dev = torch.device(device)
    if dev.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"tensors on {dev.type} need TRITON_INTERPRET=1 to run the kernels in Triton's interpreter"


def available(device) -> bool:
    return unavailable_reason(device) is None
