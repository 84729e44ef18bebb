"""`qstate diagnose` under torchrun: the recorded elements split across ranks, one result.

    torchrun --nproc-per-node N -m qstate_cli diagnose TRACE [options]

What is split (the default, `--split elements`): the replay's flat layout (layout.py) on
unit boundaries (the unit is the largest block of any configuration, so no quantization
or dither block is cut): rank r replays units floor(rU/N) .. floor((r+1)U/N) - 1 of every
configuration, with its own share of the fp32 shadow and the gradients. Random bits
(stochastic rounding, BReD dithers) are keyed on each element's index in its own tensor
and each block's index there (layout.LayoutStream), so a rank draws exactly the bits the
single process draws for those elements. A rank with no units (more ranks than units)
replays empty tensors and still takes part in every collective.

Collectives: per step, one all-reduce MAX of a 1-element tensor for every state with one
scale per tensor (te-fp8: `e4m3:tensor`): the replay scales the whole layout by one absmax
(quantizer.encode), so each rank's absmax of its part becomes the global one before the
state is encoded (and before the staleness model reads the grid, staleness.windows). No
other collective runs inside the step loop. At the end, one all_gather_object of every
rank's statistics (replay.ReplayPart: per-step sums, histograms, per-unit arrays; no
per-element state); every rank merges them (merge.py: sums add, per-unit arrays
concatenate in rank order) and holds the same Replay, so the reset check (validate.py)
replays its candidate periods element-split on all ranks in lockstep. Rank 0 writes the
table / JSON / report; the other ranks print nothing.

Equal to one process: counts exactly; float sums add in another order (relative
differences ~1e-15, tested to 1e-9).

Scaling (docs/distributed.md, 2 near-idle cores): the element split divides the
per-element work, but every rank still issues every operation. Replay 1.98x (whole
command 1.78x, 0.89 N) on a 162,560-element trace; 1.15x on the demo's 24,320 elements,
where the per-operation overhead dominates (there `--split configs`: 1.86x).

`--split configs` (fallback): rank r replays configurations r, r + N, ... on the whole
layout, as qstate did before the element split: no overhead added, so it scales better
on small traces with many configurations (at most N while there are N configurations).

Process group: torchrun sets RANK / WORLD_SIZE / MASTER_ADDR; `init()` starts gloo on CPU,
NCCL when the replay runs on CUDA (each rank on cuda:LOCAL_RANK), unless the caller
already started one; a group it started it destroys at exit (`finish`). Without
WORLD_SIZE > 1 nothing here runs.
"""
from __future__ import annotations

import atexit
import os
import weakref
from dataclasses import dataclass

import torch

MODES = ("auto", "elements", "configs")
# --split auto: the element split from this many recorded elements per rank, else the
# configuration split (while there are at least as many configurations as ranks). Measured on
# 2 near-idle cores (docs/distributed.md): 12,160 elements per rank, elements 1.15x vs configs
# 1.86x (per-operation overhead dominates); 81,280 per rank, elements 1.98x.
AUTO_ELEMENTS_PER_RANK = 65_536


def auto_mode(recorded_elements: int, n_configs: int, world: int) -> str:
    """What --split auto splits: elements when each rank gets AUTO_ELEMENTS_PER_RANK or more
    of them, or when there are fewer configurations than ranks; configs otherwise."""
    if recorded_elements >= AUTO_ELEMENTS_PER_RANK * world or n_configs < world:
        return "elements"
    return "configs"


def launched() -> bool:
    """Whether this process is one of several that torchrun (or the caller) started."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def init(device: str) -> str:
    """Start the process group if needed; the device this rank replays on."""
    import torch.distributed as dist

    from ..runtime import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        atexit.register(finish, weakref.ref(dist.group.WORLD))  # weak: the registry must not keep it alive
    return str(dev)


def finish(started: weakref.ref) -> None:
    """Destroy the process group `init` started (`started`), if it is still the default one.

    Run by atexit, before the interpreter finalizes: destroying the group joins its worker
    threads while they can still take the GIL. Left to finalization, a gloo worker that
    frees a finished collective's tensors after the main thread has gone on aborts the
    process ("terminate called without an active exception", pytorch/pytorch#190489; seen
    in tests/distributed_worker.py), and NCCL warns that destroy_process_group was not
    called. A group the caller started, or replaced, is left to the caller.
    """
    import torch.distributed as dist

    if dist.is_initialized() and dist.group.WORLD is started():
        dist.destroy_process_group()


@dataclass(frozen=True)
class Split:
    """This rank's share of a replay and the two collectives the replay uses
    (replay.ReplayOptions.split). `mode`: elements (the default) or configs."""

    rank: int
    size: int
    mode: str = "elements"

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        out = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out

    def max_(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of `x` over the ranks (a tensor scale's absmax)."""
        x = x.clone()
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
        return x

    def elements(self) -> "Split":
        return Split(self.rank, self.size, "elements")


def split(mode: str = "elements") -> Split:
    """This process's Split (the process group must be started: `init`)."""
    return Split(torch.distributed.get_rank(), torch.distributed.get_world_size(), mode)
