"""What each of the 2 gloo processes of tests/test_distributed.py runs (CPU, one thread).

One spawn runs every scenario, so the suite pays for process start-up once:

    fsdp-<states>   FSDP2 (fully_shard, 1-D mesh) on a model whose shards are whole
                    128-element blocks, every rank seeing the whole global batch (the
                    mean of identical gradients is exact, so the run must equal the
                    single-process one bit for bit)
    fsdp-split      the same with the global batch split across ranks (float tolerance)
    uneven          FSDP2 on a model whose shards cut blocks (audit rows, losses)
    ddp             DistributedDataParallel, whole batch per rank
    dcp             save at world size 2 (DCP), load at 2 and at 1, states and next step
    single-*        rank 0, after the process group is gone: the same runs in one process

Results are tensors saved by rank 0 under OUT/<scenario>.pt; the test compares them.
"""
from __future__ import annotations

import os
import sys

import torch

STEPS = 4
BATCH = 16
LR = 1e-2


def dcp_load_into(model, opt, ckpt) -> None:
    """Load a DCP checkpoint written by this worker into (model, opt), resharding as needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    target = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(target, checkpoint_id=ckpt)
    set_model_state_dict(model, target["model"])
    set_optimizer_state_dict(model, opt, target["optim"])


def aligned_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 128, bias=False))


def uneven_model() -> torch.nn.Module:
    torch.manual_seed(0)  # (96, 32): rank 1 starts at element 1536 = 12 blocks; (96,) and (10, 96) cut blocks
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 10))


def record_model() -> torch.nn.Module:
    torch.manual_seed(0)  # (96, 64): 3 blocks of 2048, rank 1 starts mid-block 1; (128, 96): 6, cut at block 3
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 128))


def batch(step: int, n_in: int, n_out: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, n_in, generator=g), torch.randn(BATCH, n_out, generator=g)


def train(model, opt, steps: int, rank: int = 0, world: int = 1, split: bool = False, first: int = 0):
    n_in, n_out = model[0].in_features, model[2].out_features
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step, n_in, n_out)
        if split:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss = loss.detach()
        if split:  # the global batch's loss: the mean of the ranks' equal halves
            torch.distributed.all_reduce(loss)
            loss = loss / world
        losses.append(float(loss))
    return torch.tensor(losses, dtype=torch.float64)


def optimizer(model, states):
    from qstate_cli.optim import AdamW

    return AdamW(model.parameters(), lr=LR, states=states, min_quant_numel=0)


def pack(codes, bits):
    from qstate_cli.quant.packing import pack as pack_codes

    return pack_codes(codes, bits)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(model, opt) -> dict:
    """Whole parameters and whole state codes/scales (collective for sharded ones)."""
    sd = opt.state_dict()
    out = {"params": [full(p.detach()).clone() for p in model.parameters()], "states": {}}
    for idx, st in sd["state"].items():
        for name in ("m", "v"):
            state = {f: full(t).reshape(-1).clone() for f, t in st[name].items() if f in ("codes", "scales")}
            if "block_starts" in st[name]:  # the per-element form (optim/sharded_state.py) -> packed codes
                starts = full(st[name]["block_starts"]).reshape(-1).bool()
                state["codes"] = pack(state["codes"].to(torch.int32), 4)
                state["scales"] = state["scales"][starts]
            for f, t in state.items():
                out["states"][f"{idx}.{name}.{f}"] = t
    return out


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    from qstate_cli.errors import QstateError
    from qstate_cli.trace import Recorder

    torch.set_num_threads(1)
    # the rendezvous through a file in OUT, not a TCP port (no port to find free, none to collide)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), world), rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def save(name, obj):
        if rank == 0:
            torch.save(obj, os.path.join(out, f"{name}.pt"))

    for states in ("bred-4bit", "nearest-4bit"):
        model = shard(aligned_model(), mesh)
        opt = optimizer(model, states)
        losses = train(model, opt, STEPS, rank, world)
        save(f"fsdp-{states}", {"losses": losses, **snapshot(model, opt),
                                "audit": [r.record() for r in opt.audit(dict((p, n) for n, p in model.named_parameters()))]})

    model = shard(aligned_model(), mesh)
    opt = optimizer(model, "bred-4bit")
    save("fsdp-split", {"losses": train(model, opt, STEPS, rank, world, split=True)})

    model = shard(uneven_model(), mesh)
    opt = optimizer(model, "bred-4bit")
    losses = train(model, opt, STEPS, rank, world, split=True)
    audit = [r.record() for r in opt.audit({p: n for n, p in model.named_parameters()})]
    rows = [None] * world
    dist.all_gather_object(rows, audit)
    save("uneven", {"losses": losses, "audit": rows})
    uneven_ckpt = os.path.join(out, "ckpt-uneven")
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=uneven_ckpt)
    model2 = shard(uneven_model(), mesh)
    opt2 = optimizer(model2, "bred-4bit")
    before = {k: v for k, v in opt.state_dict()["state"].items()}
    target = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(target, checkpoint_id=uneven_ckpt)
    set_optimizer_state_dict(model2, opt2, target["optim"])
    same = all(torch.equal(full(a[n][f]), full(b[n][f])) for a, b in zip(before.values(), opt2.state_dict()["state"].values())
               for n in ("m", "v") for f in a[n] if f != "written")
    save("uneven-reload-2", {"same": same})

    ddp_model = torch.nn.parallel.DistributedDataParallel(aligned_model())
    opt = optimizer(ddp_model.module, "bred-4bit")
    train_ddp = train(_Seq(ddp_model), opt, STEPS)
    save("ddp", {"losses": train_ddp, **snapshot(ddp_model.module, opt)})

    # recording: FSDP2 ranks record their pieces of the sampled blocks; DDP records once (rank 0)
    model = shard(record_model(), mesh)
    opt = optimizer(model, "fp32")  # fp32 states: the biases' shards cut blocks, and only gradients matter here
    with Recorder(opt, os.path.join(out, "rec-fsdp"), model=model, blocks_per_tensor=2, steps=3):
        train(model, opt, 3)
    model = shard(record_model(), mesh)
    opt = optimizer(model, "fp32")
    with Recorder(opt, os.path.join(out, "rec-fsdp-stream"), model=model, blocks_per_tensor=2, steps=3,
                  flush_steps=2):
        train(model, opt, 3)
    ddp_model = torch.nn.parallel.DistributedDataParallel(record_model())
    opt = optimizer(ddp_model.module, "fp32")
    with Recorder(opt, os.path.join(out, "rec-ddp.pt"), model=ddp_model.module, blocks_per_tensor=2, steps=3):
        train(_Seq(ddp_model), opt, 3)

    # DCP: 2 steps, save, continue 1 step; a fresh model loads the checkpoint and steps once
    ckpt = os.path.join(out, "ckpt")
    model = shard(aligned_model(), mesh)
    opt = optimizer(model, "bred-4bit")
    train(model, opt, 2)
    saved = snapshot(model, opt)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt)
    train(model, opt, 1, first=2)
    after = snapshot(model, opt)
    model2 = shard(aligned_model(), mesh)
    opt2 = optimizer(model2, "bred-4bit")
    dcp_load_into(model2, opt2, ckpt)
    loaded = snapshot(model2, opt2)
    train(model2, opt2, 1, first=2)
    save("dcp-2", {"saved": saved, "after": after, "loaded": loaded, "loaded_after": snapshot(model2, opt2)})
    dist.barrier()
    dist.destroy_process_group()

    if rank != 0:
        leave()
    # world size 1: a process group of one, FSDP2 on a 1-rank mesh, the same checkpoint
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh1 = init_device_mesh("cpu", (1,))
    model1 = shard(aligned_model(), mesh1)
    opt1 = optimizer(model1, "bred-4bit")
    dcp_load_into(model1, opt1, ckpt)
    loaded1 = snapshot(model1, opt1)
    train(model1, opt1, 1, first=2)
    save("dcp-1", {"loaded": loaded1, "loaded_after": snapshot(model1, opt1)})
    model1 = shard(uneven_model(), mesh1)
    opt1 = optimizer(model1, "bred-4bit")
    target = {"optim": get_optimizer_state_dict(model1, opt1)}
    dcp.load(target, checkpoint_id=os.path.join(out, "ckpt-uneven"))
    try:
        set_optimizer_state_dict(model1, opt1, target["optim"])
        refused = None
    except QstateError as e:
        refused = str(e)
    save("uneven-reload-1", {"refused": refused})
    dist.destroy_process_group()

    # the same runs in one process, no process group
    for states in ("bred-4bit", "nearest-4bit"):
        model = aligned_model()
        opt = optimizer(model, states)
        save(f"single-{states}", {"losses": train(model, opt, STEPS), **snapshot(model, opt)})
    model = uneven_model()
    opt = optimizer(model, "bred-4bit")
    save("single-uneven", {"losses": train(model, opt, STEPS)})
    model = record_model()
    opt = optimizer(model, "fp32")
    with Recorder(opt, os.path.join(out, "rec-single.pt"), model=model, blocks_per_tensor=2, steps=3):
        train(model, opt, 3)
    leave()


def leave() -> None:
    """End this rank here, without the interpreter's finalization (exit status 0).

    A gloo worker thread frees a finished collective (here the last barrier, which holds
    FSDP2's all-gathers and their tensors) after the caller has gone on. When that lands
    while the interpreter finalizes, taking the GIL ends the thread inside a noexcept
    destructor: "terminate called without an active exception", SIGABRT (gdb on the core:
    ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> TensorImpl::decref_pyobject ->
    take_gil -> pthread_exit -> std::terminate; torch 2.13, pytorch/pytorch#190489). It hit
    rank 1, which returned right after the barrier, in 1 of 20-60 spawns. The mesh and the
    DTensors still hold the group, so destroy_process_group does not join those threads.
    Every file this worker writes is closed by now.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Seq(torch.nn.Module):
    """DDP's wrapper with the Sequential's indexing (train() reads in/out features)."""

    def __init__(self, ddp):
        super().__init__()
        self.ddp = ddp

    def __getitem__(self, i):
        return self.ddp.module[i]

    def forward(self, x):
        return self.ddp(x)


def spawn(out: str, world: int = 2, timeout_s: float = 600) -> None:
    """Run `run` on `world` processes (torch.multiprocessing, spawn); raise on failure or timeout."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(run, args=(world, out), nprocs=world, join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"distributed worker took over {timeout_s} s")


if __name__ == "__main__":
    spawn(sys.argv[1])
