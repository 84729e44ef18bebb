"""The sharding-eligibility audit: for every parameter and state, what is stored and why.

One AuditRow per (parameter, state) on this rank: the whole and the local shape, what
steps it (triton / triton-interpreter / reference), the format (chosen from the whole
tensor's size, never from the shard's), the bytes this rank holds, and how its blocks
lie (optim/sharding.py):

    blocks   "global"  whole blocks of the whole tensor: codes equal single-process
             "local"   quantized on blocks that start at the shard: codes depend on the
                       world size (reason says where the shard cuts a block)
             "none"    nothing depends on position (fp32, or nearest rounding unscaled)
             "empty"   this rank holds no element of the tensor
    fp32     True where the state is kept in fp32, with the reason (a small tensor under
             min_quant_numel, or a configuration that asks for fp32): never silent

`audit_optimizer` reads a live optimizer (its DTensor parameters' real layouts);
`plan_shapes` answers the same for a list of shapes sharded on dim 0 at a world size
without a process group (FSDP2's torch.chunk rows), for `qstate audit`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import QstateError
from ..quant.config import StateConfig, parse_spec
from ..quant.formats import state_bytes
from ..runtime import rank_and_world
from . import aliasing, rule_traits, sharding

FP32_SPEC = parse_spec("fp32")
FP32_REASON_SMALL = "{numel} elements < min_quant_numel={limit}: fp32 states (as bitsandbytes)"


@dataclass(frozen=True)
class AuditRow:
    name: str
    tensor_id: int
    state: str
    global_shape: str
    local_shape: str
    rank: int
    world_size: int
    path: str
    format: str
    fp32: bool
    local_bytes: int
    blocks: str
    world_independent: bool  # the stored codes are the same at every world size (dim-0 sharding)
    reason: str

    def record(self) -> dict:
        return asdict(self)


def state_row(name: str, tensor_id: int, state: str, layout: sharding.ShardLayout, spec, min_quant_numel: int,
              path: str, path_reason: str | None, rank: int, world_size: int) -> AuditRow:
    """The audit of one state of one parameter on one rank (see module docstring)."""
    block = sharding.position_block(spec)
    fp32 = spec.fmt.kind == "identity"
    reasons = []
    if fp32:
        if layout.numel < min_quant_numel:
            reasons.append(FP32_REASON_SMALL.format(numel=layout.numel, limit=min_quant_numel))
        else:
            reasons.append("the configuration asks for fp32")
    unaligned = layout.why_unaligned(block)
    if layout.sharded and layout.local_numel == 0:
        blocks = "empty"
        reasons.append("this rank holds no element of the tensor")
    elif block is None:
        blocks = "none"
    elif unaligned is None:
        blocks = "global"
        if layout.sharded and layout.other_dim and not layout.world_independent(block):
            reasons.append("whole blocks at this world size only: a dim other than 0 is sharded, which cuts "
                           "every row at more ranks")
        elif layout.sharded and not layout.world_independent(block):
            reasons.append(f"whole blocks at this world size only: a row of {layout.row_numel} elements "
                           f"is not whole {block}-element blocks")
    else:
        blocks = "local"
        reasons.append(f"{unaligned}: quantized on local blocks, codes depend on the world size")
    if spec.tensor_scale and layout.sharded and not fp32:
        reasons.append("one scale per tensor: the shards' absmax is all-reduced (MAX) every step, so every rank "
                       "holds the whole tensor's scale, as one process does")
    if path_reason:
        reasons.append(f"path: {path_reason}")
    scaled_block = spec.block if spec.scaled else None
    return AuditRow(name=name, tensor_id=tensor_id, state=state, global_shape=_shape(layout.global_shape),
                    local_shape=_shape(layout.local_shape), rank=rank, world_size=world_size, path=path,
                    format=str(spec), fp32=fp32,
                    local_bytes=state_bytes(spec.fmt, layout.local_numel, scaled_block, spec.scale_bytes),
                    blocks=blocks, world_independent=layout.world_independent(block), reason="; ".join(reasons))


def audit_optimizer(opt, names: dict | None = None) -> list[AuditRow]:
    """Every state of every parameter of a QuantizedOptimizer, on this rank."""
    rank, world = rank_and_world()
    names = {id(p): n for p, n in (names or {}).items()}
    ids = opt.tensor_ids()
    rows = []
    for group in opt.param_groups:
        shared = aliasing.overlapping(group["params"])  # once per group, not per parameter
        for p in group["params"]:
            layout = sharding.layout_of(p)
            path, why = opt._route_of(p, group, shared)[:2]  # opt.path_for(p), opt.why_reference(p)
            path_reason = why if path == "reference" and opt.backend != "reference" else None
            if layout.sharded and not rule_traits.elementwise(type(opt)):
                path, path_reason = "refused", whole_tensor_reason(type(opt).__name__)
            tid = ids[id(p)]
            for state in opt.state_names:
                spec = opt.spec_for(group, p, state)
                rows.append(state_row(names.get(id(p), f"param{tid}"), tid, state, layout, spec,
                                      group["min_quant_numel"], path,
                                      None if spec.fmt.kind == "identity" and path != "refused" else path_reason,
                                      rank, world))
    return rows


def plan_shapes(shapes, config: StateConfig, state_names, world_size: int, rank: int = 0,
                min_quant_numel: int = 4096, names=None, optimizer: str | None = None,
                elementwise: bool = True) -> list[AuditRow]:
    """The audit of tensors of `shapes` sharded on dim 0 over `world_size` ranks, as rank
    `rank` sees them (no process group; the reference path: CPU). An optimizer whose rule
    needs whole tensors (`elementwise` False: Muon) refuses every sharded one: its rows
    say so."""
    rows = []
    for tid, shape in enumerate(shapes):
        layout = sharding.dim0_layout(shape, world_size, rank)
        name = names[tid] if names else f"param{tid}"
        path, why = "reference", None
        if layout.sharded and not elementwise:
            path, why = "refused", whole_tensor_reason(optimizer or "this optimizer")
        for state in state_names:
            spec = FP32_SPEC if layout.numel < min_quant_numel else config.spec(state)
            rows.append(state_row(name, tid, state, layout, spec, min_quant_numel, path, why, rank, world_size))
    return rows


def whole_tensor_reason(optimizer: str) -> str:
    return (f"{optimizer} cannot step a sharded parameter (its update needs the whole tensor): keep it out of "
            "the sharding (replicated), or shard only what an elementwise optimizer steps")


def summary_line(rows: list[AuditRow]) -> str:
    """One line: how many states lie on global blocks, local blocks, fp32, per world size."""
    n = len(rows)
    count = {k: sum(r.blocks == k for r in rows) for k in ("global", "local", "none", "empty")}
    fp32 = sum(r.fp32 for r in rows)
    indep = sum(r.world_independent for r in rows)
    world = rows[0].world_size if rows else 1
    refused = sum(r.path == "refused" for r in rows)
    return (f"{n} states at world size {world}: {count['global']} on global blocks (equal to single-process), "
            f"{count['local']} on local blocks (depend on the world size), {count['none'] + count['empty']} "
            f"position-free or empty; {indep} the same at every world size; {fp32} fp32 (each with its reason)"
            + (f"; {refused} REFUSED: the optimizer cannot step them sharded" if refused else ""))


def _shape(shape) -> str:
    return "x".join(str(s) for s in shape) if shape else "scalar"
