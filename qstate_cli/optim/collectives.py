"""What a qstate optimizer exchanges with the other ranks of a sharded parameter's mesh.

A sharded (DTensor) parameter's local shard steps alone (optim/sharding.py); three things
need the other shards of the same tensor, and only they:

    tensor scales     a state with one scale per tensor (`te-fp8` = `e4m3:nearest:tensor`)
                      is scaled by the *whole* tensor's absmax: each step the shard's absmax
                      is all-reduced (MAX) over the mesh dims that shard the parameter (one
                      float per state and step), so every rank holds the same scale, the
                      codes equal the single process's, and the one copy of the scale that
                      DCP or a full state dict keeps (a plain tensor) is every rank's
    agreement         every rank must step with the same configuration: `check_ranks_agree`
                      all-gathers, per param group holding DTensors, the state specs (format,
                      rounding, block size), the seed, min_quant_numel, the reset policy and
                      the parameters' whole shapes over the mesh, at the first step and in
                      every state_dict() (already collective), and raises one line naming the
                      first rank and field that differ (else DCP fails later with "out of
                      bounds chunk", or states load under another rank's seed)
    counts            `nonfinite` is summed over the shard dims only (optim/sharded_state.py):
                      under HSDP (a 2-D mesh, replicate x shard) each replica counts the same
                      gradients, so a sum over the whole world counted them once per replica

Replicated mesh dims (HSDP's replicate dim) hold equal values and take part in none of these
reductions.
"""
from __future__ import annotations

import torch

from ..errors import QstateError
from . import sharding

AGREED = "_ranks_agreed"  # optimizer.__dict__ key: the configuration was checked across ranks


def shard_groups(p) -> list:
    """The process groups of the mesh dims along which DTensor p is sharded ([] if none)."""
    from torch.distributed.tensor import Shard

    mesh = p.device_mesh
    return [mesh.get_group(d) for d, pl in enumerate(p.placements) if isinstance(pl, Shard)]


def sum_over_shards(p, t: torch.Tensor) -> torch.Tensor:
    """t summed over the shards of p (a new tensor; replicas are not added)."""
    out = t.clone()
    for group in shard_groups(p):
        torch.distributed.all_reduce(out, group=group)
    return out


def first_shard(p) -> bool:
    """Whether this rank holds p's first shard along every dim that shards it (one such rank
    per replica): a loaded count goes there, zeros elsewhere."""
    from torch.distributed.tensor import Shard

    coord = p.device_mesh.get_coordinate()
    return coord is None or all(c == 0 for c, pl in zip(coord, p.placements) if isinstance(pl, Shard))


def max_over_shards(p):
    """quantizer.encode's `reduce_absmax` for a state of DTensor p: the shard's absmax -> the
    whole tensor's (all-reduce MAX over the shard dims; exact, so codes equal single-process)."""
    groups = shard_groups(p)

    def reduce(absmax: torch.Tensor) -> torch.Tensor:
        out = absmax.clone()
        for group in groups:
            torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=group)
        return out

    return reduce


def with_tensor_scales(p, states: dict) -> dict:
    """states ({name: QuantizedState} of p) with a tensor-scaled state of a sharded p scaled
    by the whole tensor's absmax (module docstring)."""
    scaled = [q for q in states.values() if q.spec.tensor_scale and q.spec.fmt.kind != "identity"]
    if scaled and sharding.is_dtensor(p) and shard_groups(p):
        reduce = max_over_shards(p)
        for q in scaled:
            q.reduce_absmax = reduce
    return states


def refuse_shards(opt) -> None:
    """An optimizer whose rule needs whole tensors (Muon: not `elementwise`) refuses DTensors."""
    for group in opt.param_groups:
        for p in group["params"]:
            if sharding.is_dtensor(p):
                raise QstateError(f"{type(opt).__name__} cannot step a sharded (DTensor) parameter of shape "
                                  f"{tuple(p.shape)}: its update needs the whole tensor (a rule that is elementwise "
                                  f"says so with `elementwise = True` beside its `update`: optim/rule_traits.py)")


def check_ranks_agree(opt) -> None:
    """Raise (on every rank) where the ranks of a sharded parameter's mesh hold another
    configuration for its param group (module docstring); nothing where no group holds a
    DTensor. Collective over those meshes."""
    by_mesh: dict[int, tuple] = {}  # id(mesh) -> (mesh, [(group index, fields)])
    for i, group in enumerate(opt.param_groups):
        shards = [p for p in group["params"] if sharding.is_dtensor(p)]
        if shards:
            mesh = shards[0].device_mesh
            by_mesh.setdefault(id(mesh), (mesh, []))[1].append((i, _fields(opt, group)))
    for mesh, mine in by_mesh.values():
        if mesh.get_coordinate() is None:
            continue
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            ranks = torch.distributed.get_process_group_ranks(group)
            everyone = [None] * len(ranks)
            torch.distributed.all_gather_object(everyone, mine, group=group)
            _compare(type(opt).__name__, ranks, everyone)
    opt.__dict__[AGREED] = True


def agree_once(opt) -> None:
    """check_ranks_agree at the first step (and again after load_state_dict/add_param_group,
    which drop the mark on every rank)."""
    if not opt.__dict__.get(AGREED):
        check_ranks_agree(opt)


def _fields(opt, group) -> dict:
    config = opt.config(group)
    out = {f"states ({name})": str(config.spec(name)) for name in opt.state_names}
    out.update(seed=group["seed"], min_quant_numel=group["min_quant_numel"], reset=str(opt.reset_policy),
               parameters=[tuple(p.shape) for p in group["params"]])
    return out


def _compare(name: str, ranks: list, everyone: list) -> None:
    first = dict(everyone[0])
    for rank, theirs in zip(ranks[1:], everyone[1:]):
        if [i for i, _ in theirs] != list(first):
            raise QstateError(f"{name}: rank {rank} holds DTensor parameters in param groups "
                              f"{[i for i, _ in theirs]}, rank {ranks[0]} in {list(first)}: every rank must build "
                              "the optimizer with the same param groups")
        for i, fields in theirs:
            for key, value in fields.items():
                if first[i].get(key) != value:
                    raise QstateError(f"{name}: param group {i}'s {key} is {value!r} on rank {rank} but "
                                      f"{first[i].get(key)!r} on rank {ranks[0]} of the same FSDP2 mesh: every rank "
                                      "must build the optimizer with the same states, seed and min_quant_numel")
