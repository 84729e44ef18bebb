"""`qstate diagnose` under torchrun: the configurations split across ranks, one result.

    torchrun --nproc-per-node 2 -m qstate_cli diagnose TRACE [options]

Each rank loads the trace and replays configurations rank, rank + N, rank + 2N, ... (its
own fp32 shadow for the reset periods they use); the ConfigReplay statistics of all
ranks are gathered on rank 0 (one `gather_object`), put back in the order asked for, and
rank 0 builds the one table / JSON / report. A configuration's replay does not depend on
which other configurations run beside it, so the records equal the single-process run's
bit for bit (tested). Speed-up: at most N while there are at least N configurations
(the default seven configurations on 2 ranks: 4 + 3, so up to 7/4 = 1.75); every rank
also pays the trace load and the shadow, which one process pays once.

What is not split: the recorded elements of one configuration. A single configuration
runs on one rank (the others idle; a rank without a configuration only waits).

Process group: torchrun sets RANK / WORLD_SIZE / MASTER_ADDR; `init()` starts gloo on
CPU, NCCL when the replay runs on CUDA (each rank on cuda:LOCAL_RANK), unless the caller
already started one. Without WORLD_SIZE > 1 nothing here runs.
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch


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
    return str(dev)


def my_configs(configs: list, n_ranks: int, r: int) -> list:
    """The configurations rank r replays: r, r + N, r + 2N, ..."""
    return configs[r::n_ranks]


def merge(raw_here, gathered: list, configs: list):
    """Rank 0: its Replay with every rank's ConfigReplays in `configs` order; wall time the
    slowest rank's, CPU time and per-configuration phase times summed."""
    by_cfg = {str(c.cfg): c for part in gathered for c in part["configs"]}
    timings = dict(raw_here.timings_s)
    for part in gathered:
        for k, v in part["timings_s"].items():
            if k not in ("gather", "shadow"):
                timings[k] = v
    return replace(raw_here, configs=[by_cfg[str(c)] for c in configs], timings_s=timings,
                   wall_s=max(p["wall_s"] for p in gathered), cpu_s=sum(p["cpu_s"] for p in gathered))


def gather_replays(raw_here):
    """Every rank's ConfigReplays and times, on rank 0 (None elsewhere); raw_here None: a
    rank with no configuration to replay."""
    import torch.distributed as dist

    part = {"configs": [], "timings_s": {}, "wall_s": 0.0, "cpu_s": 0.0} if raw_here is None else {
        "configs": raw_here.configs, "timings_s": raw_here.timings_s, "wall_s": raw_here.wall_s,
        "cpu_s": raw_here.cpu_s}
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, out, dst=0)
    return out
