"""Whether a tensor read from a file holds plain values: the check traces (schema.py) and
`qstate doctor` (doctor/states.py, doctor/safeload.py) make before any operation on it.

`torch.load(weights_only=True)` rebuilds more than dense tensors: sparse (COO, CSR, ...),
nested and quantized tensors, meta tensors (a shape with no data: every operation on them
"succeeds" until a value is read), and views whose sizes and strides reach the same
bytes many times (a 1 KB file holding `torch.zeros(1).expand(2**20, 2**20)`: reading its
4 TiB of values would allocate them). None of them is what a recorder or an optimizer
writes, so each is named in one line instead of failing deep inside an operation.
"""
from __future__ import annotations

import torch


def tensor_kind(t: torch.Tensor) -> str:
    """'' for a dense tensor whose storage holds each of its elements; else a short word for
    what it is instead: "nested", its layout ("sparse_coo", "sparse_csr", ...), "meta",
    "quantized", "view" (elements beyond its storage) or "storage-less"."""
    if t.is_nested:
        return "nested"
    if t.layout != torch.strided:
        return str(t.layout).removeprefix("torch.")
    if t.device.type == "meta":
        return "meta"
    if t.is_quantized:
        return "quantized"
    try:
        held = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    except (RuntimeError, NotImplementedError, TypeError):
        return "storage-less"
    return "view" if t.numel() * t.element_size() > held else ""


def tensor_problem(t: torch.Tensor) -> str:
    """'' for a plain tensor (tensor_kind); else what it is, for a message ("a sparse_coo
    tensor", "a meta tensor (a shape without data)", ...)."""
    kind = tensor_kind(t)
    if kind == "meta":
        return "a meta tensor (a shape without data)"
    if kind == "quantized":
        return f"a quantized ({str(t.dtype).removeprefix('torch.')}) tensor"
    if kind == "view":
        held = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        return (f"a view of {t.numel():,} elements over {max(held, 0):,} bytes of storage (strides that reuse "
                f"the same bytes; reading it would allocate {t.numel() * t.element_size():,})")
    if kind == "storage-less":
        return "a tensor without storage"
    return f"a {kind} tensor" if kind else ""
