"""Fused Triton kernels (one module per op) that reproduce quant/ and optim/rules.py bit for bit.

    common.py    Triton helpers' constants (Format, ...), the hash, the format math
    memory.py    Triton helpers: addresses, tiles, exact loads/stores, non-finite counting
    codes.py     Triton helpers: the state codec (decode_state / encode_state)
    launch.py    host side: which specs are covered, the multi-tensor launch tables, tiles
    adamw.py     fused AdamW/Adam step (two states)
    lion.py      fused Lion step (one state)
    sgd.py       fused SGD-momentum step (one state)
    muon.py      fused Muon momentum update (one state + fp32 update for Newton-Schulz)
    tiles.py     the one-state kernels' tile (Lion, SGD, Muon), written once
    codec.py     the replay's state codec: encode and read back a flat vector (diagnose/codec_triton.py)

Triton code and its launchers only: kernels import quant/ (the spec they reproduce) and
nothing above it. The optimizers reach them through one seam, optim/fused.py, and the
replay through diagnose/codec_triton.py; both import the kernel modules (and so Triton)
on first use; the math never imports them.
Measurements of the kernels live in bench/ (`qstate bench headline`, `bench kernels`).
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
