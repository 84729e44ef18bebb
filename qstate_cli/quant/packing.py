"""Packing integer codes into bytes, and block views of flat tensors.

4-bit codes go two per byte, element 2i in the low nibble and 2i+1 in the high nibble;
8-bit codes one per byte; 16-bit codes (bf16/fp16 bit patterns) as int16. Signed linear
codes are stored in two's complement within their bit width. Padding elements of a
short last block are never stored: storage holds ceil(numel * bits / 8) bytes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_BITS = (4, 8, 16)  # the code widths pack and unpack take (formats._register refuses others)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int32 codes (already reduced to `bits` bits, i.e. 0 <= c < 2**bits)."""
    if bits == 4:
        c = codes.to(torch.uint8)
        if c.numel() % 2:
            c = F.pad(c, (0, 1))
        c = c.view(-1, 2)
        return c[:, 0] | (c[:, 1] << 4)
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 16:
        return codes.to(torch.int32).to(torch.int16)  # wraps into the int16 bit pattern
    raise ValueError(f"cannot pack {bits}-bit codes")


def unpack(storage: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack: int32 codes in [0, 2**bits), length numel."""
    if bits == 4:
        lo = storage & 0xF
        hi = storage >> 4
        return torch.stack([lo, hi], dim=-1).view(-1)[:numel].to(torch.int32)
    if bits == 8:
        return storage[:numel].to(torch.int32)
    if bits == 16:
        return storage[:numel].to(torch.int32) & 0xFFFF
    raise ValueError(f"cannot unpack {bits}-bit codes")


def to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Flat tensor -> [nblocks, block], zero-padding a short last block."""
    n = x.numel()
    pad = (-n) % block
    if pad:
        x = F.pad(x, (0, pad))
    return x.view(-1, block)


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)
