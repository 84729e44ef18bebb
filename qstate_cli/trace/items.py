"""What a Recorder holds per recorded tensor (recorder.py): the parameter, its chosen
blocks, the rows copied so far and the rows at which it had no gradient."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import QstateError
from ..optim import sharding
from .schema import recorded_elements


@dataclass
class Recorded:
    param: torch.Tensor
    name: str
    index: int  # position in the optimizer's parameter list
    blocks: torch.Tensor
    elements: torch.Tensor | None  # flat indices to copy (None: the whole tensor); local ones for a shard
    rows: list = field(default_factory=list)
    global_elements: torch.Tensor | None = None  # a shard's piece: the whole tensor's indices of `elements`
    nonzero: bool = False  # any recorded gradient element was non-zero
    absent: list = field(default_factory=list)  # positions in `rows` where .grad was None (schema.py `absent`)

    @property
    def n_recorded(self) -> int:
        return self.param.numel() if self.elements is None else self.elements.numel()


def shard_item(p, name: str, index: int, blocks: torch.Tensor) -> Recorded:
    """This rank's piece of the sampled blocks of sharded parameter p (module docstring)."""
    layout = sharding.layout_of(p)
    if not layout.contiguous:
        raise QstateError(f"cannot record {name}: its shard is not one range of the flattened tensor "
                          f"(placements {p.placements}); FSDP2 shards dim 0")
    wanted = recorded_elements(blocks, p.numel())
    mine = wanted[(wanted >= layout.offset) & (wanted < layout.offset + layout.local_numel)]
    local = (mine - layout.offset).to(sharding.local_tensor(p).device)
    return Recorded(p, name, index, blocks, local, global_elements=mine)


def names_text(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def pick(t: torch.Tensor, idx, dtype) -> torch.Tensor:
    flat = t.reshape(-1)
    if idx is not None:
        flat = flat[idx]
    return flat.to(device="cpu", dtype=dtype, copy=True)
