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
(TRITON_INTERPRET=1, set before triton is imported) for CPU tensors. Triton must also be new
enough (an older one is refused here, so the optimizers step on the reference path and say
why, where it would crash at the first launch or round differently): 3.6 for CUDA
(MIN_TRITON: before 3.5 there is no triton.constexpr_function; 3.5 compiles tl.math.div_rn
to div.rn.ftz.f32, which flushes subnormals the reference keeps), 3.7 in the interpreter
(MIN_TRITON_INTERPRET: 3.6's hands a namedtuple constexpr, the kernels' options, to a
constexpr_function as a plain tuple).
"""
from __future__ import annotations

import os
import re

import torch

MIN_TRITON = (3, 6)  # compiled for CUDA (torch >= 2.10's CUDA builds ship it); see the docstring
MIN_TRITON_INTERPRET = (3, 7)  # in Triton's interpreter, for CPU tensors (torch 2.12 pins it)


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no kernels
        return f"triton is not importable: {exc}"
    return None


def triton_version_problem(version, minimum: tuple[int, int] = MIN_TRITON, where: str = "") -> str | None:
    """Why a Triton of this version (its __version__) cannot run the kernels, or None. A
    version that does not start with major.minor (a source build's) is let through."""
    found = re.match(r"(\d+)\.(\d+)", str(version or ""))
    if found is None or (int(found[1]), int(found[2])) >= minimum:
        return None
    need = ".".join(map(str, minimum))
    return f"triton {found[1]}.{found[2]} is older than {need}, which the kernels need{where}"


def unavailable_reason(device) -> str | None:
    err = _triton_import_error()
    if err:
        return err
    import triton

    version = getattr(triton, "__version__", None)
    dev = torch.device(device)
    if dev.type == "cuda":
        return triton_version_problem(version) or (None if torch.cuda.is_available() else "CUDA is not available")
    if os.environ.get("TRITON_INTERPRET") != "1":
        return f"tensors on {dev.type} need TRITON_INTERPRET=1 to run the kernels in Triton's interpreter"
    return triton_version_problem(version, MIN_TRITON_INTERPRET, " in Triton's interpreter")


def available(device) -> bool:
    return unavailable_reason(device) is None
