"""Parameters that share memory: views of one tensor registered as parameters of their own.

The reference steps a group's parameters one after another, each reading what the ones
before it wrote, so where two parameters overlap the second one's step sees the first
one's update (as torch.optim's for-loop and foreach steps do). The fused launches and the
together pass split the tensors over threads that read and write at once, so on overlapping
parameters their values depend on the threads' timing (two views of 2**20 elements
overlapping by half, AdamW, three steps: 6e-6 apart from the reference with bf16, 4-bit or
8-bit states, 1e-2 with fp32 states). base.step therefore routes every
parameter that overlaps another of its group to the reference, in the group's order;
`why_reference(p)` says so (OVERLAP_REASON).

Overlap is by byte span: [data_ptr, data_ptr + the bytes from its first element to its
last], so views that interleave (x[0::2], x[1::2]) count as overlapping too (the reference
steps them, the same values as any order).
"""
from __future__ import annotations

import torch

OVERLAP_REASON = ("shares memory with another parameter of its group: the reference steps them one after "
                  "another, each reading the update before it")


def byte_span(p: torch.Tensor) -> tuple[int, int]:
    """(first byte, one past the last) of p's elements in memory (strides are never negative in torch)."""
    start, n = p.data_ptr(), p.numel()
    if p.is_contiguous():
        return start, start + n * p.element_size()
    last = sum((s - 1) * st for s, st in zip(p.shape, p.stride()))
    return start, start + (last + 1) * p.element_size()


def overlapping(params) -> set[int]:
    """ids of the tensors among `params` whose byte span meets another's. Empty tensors and
    tensors without an address of their own (data_ptr 0: a DTensor's wrapper, whose shard the
    reference steps anyway, a meta tensor) meet nothing. Sorted by start, span i meets an
    earlier one iff it starts before the furthest end so far, and a later one iff the next
    span starts before its end."""
    spans = sorted(span + (id(p),) for p in params if p.numel() and (span := byte_span(p))[0])
    found, furthest = set(), -1
    for i, (start, end, key) in enumerate(spans):
        if start < furthest or (i + 1 < len(spans) and spans[i + 1][0] < end):
            found.add(key)
        furthest = max(furthest, end)
    return found
