"""qstate's AdamW under FSDP2 with DCP checkpoints: the example of docs/distributed.md.

    torchrun --standalone --nproc-per-node 2 scripts/fsdp2_example.py [CHECKPOINT_DIR]

CPU + gloo here; on GPUs the same script runs with NCCL (the backend follows the device).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import qstate_cli.optim as qoptim

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
mesh = init_device_mesh(device.type, (world,))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)).to(device)
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = qoptim.AdamW(model.parameters(), lr=1e-3, states="bred-4bit")

for step in range(3):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(64, 512, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]  # this rank's half of the global batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    loss = loss.detach()
    dist.all_reduce(loss)
    if rank == 0:
        print(f"step {step + 1}: loss {float(loss) / world:.4f}")

names = {p: n for n, p in model.named_parameters()}
for r in range(world):
    if r == rank:
        for row in opt.audit(names):
            print(f"rank {row.rank} {row.name:9s} {row.state} {row.global_shape:>8s} -> {row.local_shape:>8s} "
                  f"{row.format:17s} {row.local_bytes:7,d} B  {row.path:9s} blocks={row.blocks:6s} {row.reason}")
    dist.barrier()

if len(sys.argv) > 1:
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=sys.argv[1])
    if rank == 0:
        print(f"saved {sys.argv[1]}")
dist.destroy_process_group()
