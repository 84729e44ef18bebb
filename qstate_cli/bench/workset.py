"""The tensors a bench group steps, and their peak estimated before any is allocated.

`bench kernels` and `bench memory` step one group at a time (a size or model, a dtype):
parameters with two random gradient sets (`Tensors`). Before allocating them, the group's
peak (`group_bytes`) is compared with the memory available now (hostmem.available_memory):
on Linux an allocation past it is not refused, the OOM killer ends the process later, with
no file and no message. `allocate` does both and returns the tensors or the reason every
row of the group fails with ("needs ~X GiB, Y GiB available", or the out-of-memory error
an allocation raised); the sweep goes on with the next group.
"""
from __future__ import annotations

import torch

from ..hostmem import available_memory
from ..runtime import free_memory, is_oom
from .bytes_model import dtype_bytes, tensor_state_bytes
from .subjects import Subject

GIB = 2**30
HEADROOM_BYTES = 256 * 2**20  # beyond the tensors: allocator slack, compiled kernels, a first step's buffers
COPY_HEADROOM_BYTES = 64 * 2**20  # the copy row: two buffers and a timing loop, nothing else
TEMP_FP32_COPIES = 4  # fp32 temporaries of a step on its largest tensor (dequantized m and v, the update, a cast)


class Tensors:
    """Parameters (random, std 0.02) and two random gradient sets for one target."""

    def __init__(self, shapes, dtype: torch.dtype, device: torch.device, seed: int):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device).mul_(0.02).to(dtype))
                       for s in shapes]
        self.grad_sets = [[torch.randn(s, generator=gen, device=device).mul_(0.01).to(dtype) for s in shapes]
                          for _ in range(2)]
        self.turn = 0
        self.rotate()

    def rotate(self) -> None:
        """Hand the next gradient set to the parameters (a pointer swap, no copy)."""
        for p, g in zip(self.params, self.grad_sets[self.turn % 2]):
            p.grad = g
        self.turn += 1


def state_bytes(subject: Subject, optimizer: str, shapes, dtype: torch.dtype) -> int:
    """Codes + scales of the states `subject` keeps on tensors of `shapes` (the bytes model;
    no counters): bench memory's expected_state_bytes, and the states in group_bytes."""
    total = 0
    for s in shapes:
        n = int(torch.Size(s).numel())
        total += sum(tensor_state_bytes(spec, n) for spec in subject.specs_for(optimizer, n, dtype))
    return total


def group_bytes(shapes, dtype: torch.dtype, states: list[int], together: bool, extra: int = 0) -> int:
    """The peak bytes of one group (a size or model, a dtype), estimated before any of it is
    allocated; n elements of b bytes, the largest tensor n_max:

        parameters and two gradient sets   3 n b, + 4 n_max (the fp32 draw a tensor is made from)
        states                             all subjects' (`together`: bench kernels builds every
                                           row's optimizer before timing them), else the largest
        a step's temporaries               TEMP_FP32_COPIES fp32 copies of n_max, and one copy of the
                                           largest subject's states (torch's foreach step sqrt()s
                                           a whole state list at once)
        extra                              the caller's (bench kernels: its references)
        HEADROOM_BYTES

    An estimate on the safe side: bench memory of llama-7b (6.7e9 fp32 parameters) with
    bred-4bit ~91 GiB, of which 75 GiB parameters and gradients; the CPU sweep's 2^18 ~0.3 GiB."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    n, largest, b = sum(numels), max(numels, default=0), dtype_bytes(dtype)
    held = sum(states) if together else max(states, default=0)
    temps = TEMP_FP32_COPIES * 4 * largest + max(states, default=0)
    return 3 * n * b + 4 * largest + held + temps + int(extra) + HEADROOM_BYTES


def memory_shortfall(device: torch.device, needed: int) -> str | None:
    """None when `needed` bytes fit in what `device` has available now (available_memory;
    unknown: assumed to fit), else a row's reason: "needs ~X GiB, Y GiB available"."""
    available = available_memory(device)
    if available is None or needed <= available:
        return None
    return f"needs ~{needed / GIB:.3g} GiB, {available / GIB:.3g} GiB available on {device.type}: not allocated"


def allocate(shapes, dtype: torch.dtype, device: torch.device, seed: int,
             needed: int) -> tuple[Tensors | None, str | None]:
    """(Tensors, None) for one group of tensors of `shapes` whose estimated peak is `needed`
    bytes, or (None, why) when it does not fit (memory_shortfall) or its allocation ran out
    of memory (the device's cache freed after); any other error is raised."""
    short = memory_shortfall(device, needed)
    if short:
        return None, short
    try:
        return Tensors(shapes, dtype, device, seed), None
    except Exception as exc:  # noqa: BLE001 - recorded on every row of this group
        if not is_oom(exc):
            raise
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        why = f"out of memory allocating {numel:,} elements: {exc}"
    free_memory(device)  # out of the except: its traceback held the partly made tensors
    return None, why
