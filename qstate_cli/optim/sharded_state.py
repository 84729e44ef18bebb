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

A parameter sharded on a dim other than 0 (`other_dim`: Shard(1)) always takes the
elements form: its shards are not ranges of rows. A tensor scale (`te-fp8`) stays one plain
(1,) tensor in either form: it is the whole tensor's on every rank (optim/collectives.py).

`nonfinite` (the per-rank count of NaN/Inf gradient elements) is summed over the dims that
shard the parameter when saved (not over HSDP's replicas, which count the same gradients;
state_dict is collective for sharded parameters, as torch's get_optimizer_state_dict is)
and restored on the first shard of each replica.

`from_gathered` reads either form back for a plain (non-DTensor) parameter: a full state
dict gathered from FSDP2 (`get_optimizer_state_dict(..., full_state_dict=True)`) resumes in
one process, bit for bit, where its blocks are the whole tensor's.
"""
from __future__ import annotations

import torch

from ..errors import QstateError
from ..quant.packing import pack, unpack
from . import collectives, sharding


def rows_form(spec, layout: sharding.ShardLayout) -> bool:
    """Whether a state of `spec` is saved in the rows form (module docstring)."""
    if layout.other_dim or not layout.world_independent(sharding.position_block(spec)):
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
            out[key] = collectives.sum_over_shards(p, v)
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
    n, block = layout.local_numel, sharding.position_block(spec) or 1
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
    out = {}
    for key, v in value.items():
        if key == "nonfinite":
            out[key] = _local(v).clone() if collectives.first_shard(p) else torch.zeros_like(_local(v))
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
    n, block = layout.local_numel, sharding.position_block(spec) or 1
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


def from_gathered(p, value, specs: dict, name=None):
    """A plain parameter's state from a state dict in either form (module docstring): the
    rows form flattened, the elements form converted back; a single-process state (flat
    codes) as it is. An elements form that is not this tensor's blocks (or format) is a
    ValueError naming the cause."""
    if not isinstance(value, dict):
        return value  # checkpoint.state_problem says what it is
    layout = sharding.layout_of(p)
    out = dict(value)
    for key, spec in specs.items():
        state = out.get(key)
        if not isinstance(state, dict) or not isinstance(state.get("codes"), torch.Tensor):
            continue  # what is missing is said by checkpoint.state_problem
        state = dict(state)
        if isinstance(state.get("block_starts"), torch.Tensor):
            problem = _elements_problem(spec, layout.numel, state)
            if problem:
                raise ValueError(f"load_state_dict: parameter {name!r} (shape {tuple(p.shape)}): state {key} ({spec}) "
                                 f"was saved by FSDP2 in the per-element layout: {problem}")
            state = _from_elements(p, layout, spec, key, state)
        else:
            for f in ("codes", "scales"):
                if isinstance(state.get(f), torch.Tensor) and state[f].dim() > 1:  # the rows form
                    state[f] = state[f].reshape(-1)
        out[key] = state
    return out


def _elements_problem(spec, numel: int, state: dict) -> str | None:
    """Why a per-element state cannot be this whole tensor's (None: it can)."""
    codes, starts = state["codes"], state["block_starts"].reshape(-1).bool()
    if codes.numel() != numel or starts.numel() != numel:
        return f"{codes.numel():,} elements, where this parameter has {numel:,} (another parameter's)"
    if spec.fmt.bits < 8 and codes.numel() and int(codes.max()) >> spec.fmt.bits:
        return f"codes above the {spec.fmt.bits}-bit range (saved with another format)"
    block = sharding.position_block(spec) or 1
    at = starts.nonzero().reshape(-1)
    if torch.equal(at, torch.arange(0, numel, block, device=at.device)):
        return None
    if at.numel() > 1 and at[0] == 0 and torch.equal(at, torch.arange(0, numel, int(at[1]), device=at.device)):
        return f"its blocks are {int(at[1])} elements, where {spec} has {block} (saved with another block size)"
    return ("its blocks start inside this tensor's blocks: a shard that cut a block, or one sharded on a dim other "
            "than 0, was quantized on its own blocks; resume it under FSDP2 at the world size it was saved at")


def _local(t):
    return t.to_local() if sharding.is_dtensor(t) else t
