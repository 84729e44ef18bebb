"""A sharded parameter's quantized states in a state dict: DTensors that DCP can reshard.

In `optimizer.state` a sharded (DTensor) parameter's states are the local shard's flat
codes and scales (plain tensors: the step runs on them). `state_dict()` hands each state
to torch.distributed.checkpoint as a DTensor in one of two forms, chosen from the whole
tensor's shape and the spec alone, so the same form is chosen at every world size:

    rows   the shard is whole blocks at *every* world size (a row of the parameter is
           whole blocks: optim/sharding.py `world_independent`) and a row's codes are
           whole bytes. codes become a [rows, row_bytes] tensor and scales a
           [rows, row_blocks] one, sharded exactly as the parameter (same mesh,
           placements, dim-0 chunks). DCP reshards them like the parameter: saved at
           world size 2, they load at 1, 2 or any other size, bit for bit, and the loaded
           codes decode with the same global dither counters.
    elements  otherwise (a row is not whole blocks: 1-D biases and norms, odd widths).
           Each state is saved per *element*, shaped and sharded like the parameter:
           its code (one uint8/int16 per element, unpacked), its block's scale, and a
           uint8 mark on the first element of every block. DCP reshards these like the
           parameter. A rank loads them when its new shard is whole blocks whose starts
           are exactly the saved marks; so a checkpoint saved from shards that were whole
           blocks (e.g. (256,) at world size 2) loads bit for bit at any world size whose
           shards are whole blocks too (1, 2, 4), and one saved on local blocks loads at
           the world size it was saved at. Anything else is refused with the reason,
           never decoded on the wrong blocks. Cost: 5-6 bytes per element in the
           checkpoint for these (usually small) parameters.

`nonfinite` (the per-rank count of NaN/Inf gradient elements) is summed over the mesh
when saved (one all-reduce: state_dict is collective for sharded parameters, as
torch's get_optimizer_state_dict is) and restored on the mesh's first rank.
"""
from __future__ import annotations

import torch

from ..errors import QstateError
from ..quant.packing import pack, unpack
from . import sharding


def rows_form(spec, layout: sharding.ShardLayout) -> bool:
    """Whether a state of `spec` is saved in the rows form (module docstring)."""
    if not layout.world_independent(sharding.position_block(spec)):
        return False
    return (layout.row_numel * spec.fmt.bits) % 8 == 0


def _row_lengths(spec, layout) -> dict:
    """Per-row length of codes and scales (rows form); codes are elements of their dtype."""
    per_elem = 1 if spec.fmt.bits >= 16 else 8 // spec.fmt.bits  # 32/16-bit: one element; 4-bit: 2 per byte
    out = {"codes": layout.row_numel // per_elem}
    if spec.scaled:
        out["scales"] = layout.row_numel // spec.block
    return out


def to_saved(p, value: dict, specs: dict) -> dict:
    """A new state-dict entry for sharded parameter p: its states as DTensors."""
    layout = sharding.layout_of(p)
    out = {}
    for key, v in value.items():
        if key == "nonfinite":
            total = v.clone()
            torch.distributed.all_reduce(total, group=_mesh_group(p.device_mesh))
            out[key] = total
        elif key in specs:
            spec = specs[key]
            out[key] = (_rows(p, layout, spec, dict(v)) if rows_form(spec, layout)
                        else _elements(p, layout, spec, dict(v)))
        else:
            out[key] = v
    return out


def _rows(p, layout, spec, state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    rows = layout.local_shape[0] if layout.local_shape else 0
    for f, length in _row_lengths(spec, layout).items():
        state[f] = DTensor.from_local(state[f].reshape(rows, length), p.device_mesh, p.placements, run_check=False,
                                      shape=torch.Size((layout.global_shape[0], length)), stride=(length, 1))
    return state


def _elements(p, layout, spec, state: dict) -> dict:
    n, block = layout.local_numel, sharding.position_block(spec)
    codes = state["codes"]
    if spec.fmt.bits < 8:
        codes = unpack(codes, spec.fmt.bits, n).to(torch.uint8)
    state["codes"] = _like(p, layout, codes)
    first = torch.arange(n, device=codes.device) // block
    if spec.scaled:
        state["scales"] = _like(p, layout, state["scales"][first])
    state["block_starts"] = _like(p, layout, (torch.arange(n, device=codes.device) % block == 0).to(torch.uint8))
    return state


def _like(p, layout, local_flat: torch.Tensor):
    """A DTensor shaped, placed and strided like parameter p, from this rank's values."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_flat.reshape(layout.local_shape), p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def from_saved(p, value: dict, specs: dict) -> dict:
    """Inverse of to_saved on this rank (possibly another world size): local flat tensors."""
    layout = sharding.layout_of(p)
    mesh = p.device_mesh
    out = {}
    for key, v in value.items():
        if key == "nonfinite":
            first = mesh.get_coordinate() is None or all(c == 0 for c in mesh.get_coordinate())
            out[key] = _local(v).clone() if first else torch.zeros_like(_local(v))
        elif key in specs:
            spec, state = specs[key], {f: _local(t) for f, t in v.items()}
            if rows_form(spec, layout):
                for f in _row_lengths(spec, layout):
                    state[f] = state[f].reshape(-1).contiguous()
            else:
                state = _from_elements(p, layout, spec, key, state)
            out[key] = state
        else:
            out[key] = v
    return out


def _from_elements(p, layout, spec, key: str, state: dict) -> dict:
    n, block = layout.local_numel, sharding.position_block(spec)
    starts = state.pop("block_starts").reshape(-1)
    want = torch.arange(n, device=starts.device) % block == 0
    if not torch.equal(starts.bool(), want):
        raise QstateError(
            f"state {key} of the parameter of shape {tuple(layout.global_shape)} was saved on other blocks than "
            f"this rank's shard ({layout.why_unaligned(block) or 'a saved block starts inside it'}): load it at a "
            "world size whose shards hold whole blocks (qstate audit shows which), or at the size it was saved at")
    codes = state["codes"].reshape(-1)
    state["codes"] = pack(codes.to(torch.int32), spec.fmt.bits) if spec.fmt.bits < 8 else codes.contiguous()
    if spec.scaled:
        state["scales"] = state["scales"].reshape(-1)[::block].contiguous()
    return state


def _local(t):
    return t.to_local() if sharding.is_dtensor(t) else t


def _mesh_group(mesh):
    return mesh.get_group() if mesh.ndim == 1 else None
