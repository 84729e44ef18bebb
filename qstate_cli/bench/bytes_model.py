"""The bytes an optimizer step must move through device memory (BRIEF §2), the roofline.

A fused step reads the parameter, the gradient and every stored state once and writes
the parameter and every state once. Per element, with p = parameter bytes, g = gradient
bytes, and for each state s: bits_s, block size B_s and scale bytes c_s (fp32: 4):

    bytes/elem = 2 p + g + sum_s 2 * (bits_s / 8 + c_s / B_s)

(an unscaled state has no c_s / B_s term). For AdamW's two 4-bit states at B = 128:
2p + g + 2 * 2 * (0.5 + 4/128) = 2p + g + 2.125, i.e. 8.125 with bf16 p and g and 14.125
with fp32; torch's AdamW with fp32 states: 2p + g + 16 = 22 (bf16) or 28 (fp32).

`step_bytes` counts a whole step exactly, tensor by tensor: codes are ceil(n * bits / 8)
bytes and scales ceil(n / B) * c (`quant.state_bytes`), and tensors that the optimizer
keeps in full precision (too small to quantize, or not a multiple of the block) count
with the states they really have. Time floor = bytes / measured copy bandwidth.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from ..quant.config import StateSpec
from ..quant.formats import state_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype or one of the names fp32 / bf16 / fp16."""
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    return torch.empty((), dtype=dtype).element_size()


def spec_bytes_per_element(spec: StateSpec) -> float:
    """bits / 8 + scale bytes / block (no scale term when the state is not block scaled)."""
    return spec.bytes_per_element()


def bytes_per_element(param_bytes: float, grad_bytes: float, specs: Sequence[StateSpec]) -> float:
    """2 p + g + sum over states of 2 * (bits / 8 + scale_bytes / block)."""
    return 2 * param_bytes + grad_bytes + sum(2 * spec_bytes_per_element(s) for s in specs)


def tensor_state_bytes(spec: StateSpec, numel: int) -> int:
    """Exact bytes one stored state of `numel` elements holds (codes + scales)."""
    return state_bytes(spec.fmt, numel, spec.block if spec.scaled else None, spec.scale_bytes)


def step_bytes(numels: Iterable[int], param_bytes: int, grad_bytes: int,
               specs_for: Callable[[int], Sequence[StateSpec]]) -> int:
    """Exact bytes one step moves over tensors of `numels` elements.

    specs_for(numel) -> the specs of the states that tensor really keeps.
    Per tensor: numel * (2 p + g) + sum over its states of 2 * state bytes.
    """
    total = 0
    for n in numels:
        total += n * (2 * param_bytes + grad_bytes)
        total += sum(2 * tensor_state_bytes(s, n) for s in specs_for(n))
    return total


def gbps(bytes_moved: int, time_ms: float) -> float:
    """GB/s with GB = 1e9 bytes."""
    return bytes_moved / (time_ms * 1e-3) / 1e9
