"""Encode and decode of the elementwise states optim/small.py steps together, on the CPU path:
an unscaled 16-bit minifloat (bf16, fp16, their :sqrt forms) rounded to nearest or
stochastically, the `bf16`, `bf16-sr` and `fp16` presets' states. small.py laid each run's
tensors end to end and stepped them with the reference's torch ops; quantizer.encode and
decode were most of that time (bf16: ~7 ms, bf16-sr: 20-27 ms a step for 262,144 elements,
2 threads, of which the stochastic draws' 32-bit hash emulated in torch ~14 ms). Here each is
one numba pass (elementwise_kernel.py), threads over runs of elements (host.run_parts), the
same bits. The rule stays small.py's torch ops (Lion, SGD and Muon's momentum alike).
No numba at import; the kernels compile on first use (cached on disk).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ...quant import hash as qhash
from . import unavailable_reason
from .host import layout_arrays, run_parts
from .replay import _unscaled_layout, unscaled16

_KERNELS: list = []


def covers(spec) -> str | None:
    """None if these kernels encode and decode `spec`'s state on the CPU path, else why not."""
    if not unscaled16(spec) or spec.per_element_division:
        return f"{spec}: not an unscaled 16-bit minifloat"
    if spec.rounding not in ("nearest", "stochastic"):
        return f"{spec}: {spec.rounding} rounding of an unscaled state (a dither per block)"
    return unavailable_reason("cpu")


def _kernels():
    if not _KERNELS:
        from .elementwise_kernel import RUN, decode16, encode16
        _KERNELS.extend([RUN, encode16, decode16])
    return _KERNELS


@lru_cache(maxsize=64)
def _lay(spec) -> tuple:
    return layout_arrays(_unscaled_layout(spec, 1), None)[0]


def encode(x: torch.Tensor, spec, seed: int, tensor_ids: list, state_id: int, step: int, sizes: list) -> torch.Tensor:
    """int16 codes of the flat fp32 CPU tensor x (tensors of `sizes` elements laid end to end):
    quantizer.encode(x, spec, step, stream)[0] with each tensor's Stream(seed, tensor id,
    state id), as small.Streams draws them."""
    run, enc, _ = _kernels()
    x = x.detach().to(torch.float32).contiguous().reshape(-1)
    n = x.numel()
    codes = torch.empty(n, dtype=torch.int16)
    starts = np.zeros(len(sizes) + 2, np.int64)
    starts[1:-1] = np.cumsum(sizes)
    starts[-1] = np.iinfo(np.int64).max  # past the last tensor: never reached
    keys = [qhash.stream_keys(seed, t, state_id, step) for t in tensor_ids] if spec.rounding == "stochastic" else []
    k1 = np.array([k[0] for k in keys] + [0], np.uint32)
    k2 = np.array([k[1] for k in keys] + [0], np.uint32)
    if n:
        run_parts(enc, n, run, (x.numpy(), codes.numpy().view(np.uint16), _lay(spec), starts, k1, k2, n))
    return codes


def decode(codes: torch.Tensor, spec) -> torch.Tensor:
    """The stored values (fp32, flat) of int16 codes: quantizer.decode(codes, None, spec, n, step)."""
    run, _, dec = _kernels()
    codes = codes.contiguous().reshape(-1)
    n = codes.numel()
    out = torch.empty(n, dtype=torch.float32)
    if n:
        run_parts(dec, n, run, (codes.numpy().view(np.uint16), out.numpy(), _lay(spec), n))
    return out
