"""Where a parameter's local values sit in the whole tensor, and whether its blocks align.

A sharded parameter (a DTensor: FSDP2's `fully_shard` shards dim 0, as `torch.chunk`
does: rank r holds rows [r*c, min((r+1)*c, R)) with c = ceil(R / world size)) is
stepped on its local shard. Its states are quantized on the local values, but with
*global* positions: the shard's first element has flat index `offset` in the whole
(row-major) tensor, so random counters (quant/quantizer.py: element offset + i, block
offset // B + b) are the whole tensor's.

The rule (per state, block size B; `ShardLayout.aligned`):

    aligned  <=>  the shard is one contiguous range [offset, offset + n) of the flattened
                  tensor (only dim 0 is sharded), offset % B == 0, and
                  n % B == 0 or offset + n == numel (the tensor's own short last block)

An aligned shard holds whole blocks of the whole tensor: its codes, scales and dithers
equal, bit for bit, the single-process ones for those elements. Under dim-0 sharding this
holds at every world size when a row is whole blocks (numel / rows % B == 0:
`world_independent`); otherwise it depends on where this world size cuts the rows. An
unaligned shard is still quantized in the chosen format (never a silent fp32 fallback):
on *local* blocks that start at its first element, with block counter offset // B + b;
its codes then depend on the world size, and the optimizer's audit says so. A parameter
sharded on another dim (`fully_shard(..., shard_placement_fn=lambda p: Shard(1))`) is cut
inside every row: its states are quantized on the shard's own blocks (its random counters
start at the flat index of its first element, so two ranks' shards can replay the same
dithers, as a larger dither block would), `world_independent` is False, and its
checkpoints use the per-element form (optim/sharded_state.py).

Nothing here does I/O; DTensor is imported lazily (torch without distributed still works).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardLayout:
    """One rank's piece of one parameter (see module docstring)."""

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    offset: int  # flat index in the whole tensor of the first local element
    contiguous: bool  # the local values are one range of the flattened whole tensor
    sharded: bool  # a DTensor with at least one Shard placement
    other_dim: bool = False  # a placement shards a dim other than 0 (so at every world size)

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def row_numel(self) -> int:
        """Elements per dim-0 row of the whole tensor (1 for a 1-D tensor)."""
        return math.prod(self.global_shape[1:])

    def aligned(self, block: int | None) -> bool:
        """This shard holds whole blocks of `block` elements (position_block: 1 = only
        element counters matter, None = nothing depends on position)."""
        return self.why_unaligned(block) is None

    def why_unaligned(self, block: int | None) -> str | None:
        if not self.sharded or self.local_numel == 0 or block is None:
            return None
        if not self.contiguous:
            return "the shard is not one range of the flattened tensor (a dim other than 0 is sharded)"
        end = self.offset + self.local_numel
        if self.offset % block:
            return f"the shard starts at element {self.offset}, not on a {block}-element block boundary"
        if self.local_numel % block and end != self.numel:
            return f"the shard ends at element {end}, not on a {block}-element block boundary"
        return None

    def world_independent(self, block: int | None) -> bool:
        """Dim-0 sharding at any world size keeps whole blocks: each row is whole blocks.
        Sharding another dim (`other_dim`: shard_placement_fn=Shard(1)) cuts every row, so
        its blocks are the shard's own at every world size above 1."""
        return not self.sharded or block is None or (not self.other_dim and self.row_numel % block == 0)


def position_block(spec) -> int | None:
    """What a state's stored values depend on besides the values: blocks of B elements
    (block scales or BReD dithers: B), element counters (stochastic rounding: 1), or
    nothing (nearest rounding without scales, fp32: None)."""
    if spec.fmt.kind == "identity":
        return None
    if spec.scaled or spec.rounding == "bred":
        return spec.dither_block
    if spec.rounding == "stochastic":
        return 1
    return None


def is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def layout_of(p: torch.Tensor) -> ShardLayout:
    """The ShardLayout of parameter p on this rank (a plain tensor: the whole tensor)."""
    shape = tuple(p.shape)
    if not is_dtensor(p):
        return ShardLayout(shape, shape, 0, True, False)
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, start = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local, start = tuple(local), tuple(start)
    dims = {pl.dim for pl in p.placements if isinstance(pl, Shard)}
    return ShardLayout(shape, local, _flat_offset(shape, start), local[1:] == shape[1:], bool(dims),
                       any(d % len(shape) for d in dims))


def dim0_layout(global_shape, world_size: int, rank: int) -> ShardLayout:
    """FSDP2's layout of rank `rank` (torch.chunk of dim 0) without a process group."""
    shape = tuple(int(s) for s in global_shape)
    if not shape:
        return ShardLayout(shape, shape, 0, True, False)
    rows = shape[0]
    chunk = -(-rows // world_size)
    lo, hi = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    local = (hi - lo,) + shape[1:]
    return ShardLayout(shape, local, lo * math.prod(shape[1:]), True, world_size > 1)


def _flat_offset(shape, start) -> int:
    offset, stride = 0, 1
    for size, s in zip(reversed(shape), reversed(start)):
        offset += int(s) * stride
        stride *= int(size)
    return offset


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local values of a DTensor (the tensor itself otherwise); writes go to the shard."""
    return t.to_local() if is_dtensor(t) else t
