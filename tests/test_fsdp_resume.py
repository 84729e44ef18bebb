"""A full (gathered) FSDP2 optimizer state dict resumes in one process without FSDP2, bit for bit.

`get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))` gathers
a sharded parameter's states in the form DCP reshards (optim/sharded_state.py): the rows form
(codes [rows, row bytes], scales [rows, row blocks]) or the per-element form (one code and
one scale per element, `block_starts`). A plain optimizer reads both back
(sharded_state.from_gathered); an elements form whose blocks are not the tensor's, or that
was saved with another block size or format, is refused with that cause.

The FSDP2 run is a one-rank gloo mesh in a subprocess (as tests/test_doctor_sharded.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# one thread, as the FSDP2 run: the same sums (conftest.py)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.fsdp2_on_gloo]
ROOT = Path(__file__).resolve().parents[1]
LR = 1e-2


def model_of() -> torch.nn.Module:
    torch.manual_seed(0)  # 0.weight 64x128: rows form; 0.bias, 2.weight (a row of 64 < 128), 2.bias: elements form
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))


def train(model, opt, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(100 + step)
        loss = model(torch.randn(8, 128, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def optimizer(params, states="bred-4bit", backend="reference"):
    from qstate_cli.optim import AdamW

    return AdamW(params, lr=LR, states=states, min_quant_numel=0, backend=backend)


def decoded(opt) -> list:
    """Every state of every parameter, decoded (whole: one rank holds the whole tensor)."""
    ids, out = opt.tensor_ids(), []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append({n: q.decode().reshape(-1).clone() for n, q in opt.load_states(group, p, ids[id(p)]).items()})
    return out


def fsdp2_full_state_dict(out: str) -> None:
    """Run in a subprocess: 2 steps under FSDP2 (one rank), the full state dicts saved, then 2
    more steps (the continuous run: its parameters and decoded states)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = model_of()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer(model.parameters())
    train(model, opt, 2)
    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    torch.save({"model": get_model_state_dict(model, options=o), "optimizer": get_optimizer_state_dict(model, opt, options=o)},
               os.path.join(out, "full.pt"))
    train(model, opt, 2, first=2)
    torch.save({"params": [p.detach().full_tensor() for p in model.parameters()], "states": decoded(opt)},
               os.path.join(out, "continuous.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see docs/distributed.md: gloo's threads can abort a normal exit


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out = tmp_path_factory.mktemp("fsdp-full")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = f"from test_fsdp_resume import fsdp2_full_state_dict as f; f({str(out)!r})"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out / "full.pt", weights_only=True), torch.load(out / "continuous.pt", weights_only=True)


def test_the_gathered_state_dict_holds_both_forms(saved):
    st = saved[0]["optimizer"]["state"]
    assert st["0.weight"]["m"]["codes"].shape == (64, 64)  # rows form: 128 4-bit codes a row
    assert "block_starts" in st["0.bias"]["m"] and "block_starts" in st["2.weight"]["v"]


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_full_fsdp2_state_dict_resumes_in_one_process_bit_for_bit(saved, backend):
    full, continuous = saved
    model = model_of()
    model.load_state_dict(full["model"])
    opt = optimizer(model.parameters(), backend=backend)
    opt.load_state_dict(full["optimizer"])
    for p in model.parameters():
        for n in ("m", "v"):
            assert opt.state[p][n]["codes"].dim() == 1  # the flat layout every path steps
    train(model, opt, 2, first=2)
    if backend != "reference":  # a fused path: parameters equal up to fp32 rounding (BRIEF §4)
        for a, b in zip(continuous["params"], model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)
        return
    for i, (a, b) in enumerate(zip(continuous["params"], model.parameters())):
        assert torch.equal(a, b.detach()), f"parameter {i}"
    for i, (a, b) in enumerate(zip(continuous["states"], decoded(opt))):
        for n in ("m", "v"):
            assert torch.equal(a[n], b[n]), f"parameter {i} state {n}"


def _load(sd, states="bred-4bit"):
    model = model_of()
    opt = optimizer(model.parameters(), states=states)
    opt.load_state_dict(sd)
    return opt


def test_a_per_element_state_on_other_blocks_is_refused_with_its_cause(saved):
    import copy

    sd = copy.deepcopy(saved[0]["optimizer"])
    starts = sd["state"]["2.weight"]["m"]["block_starts"].reshape(-1)
    starts.zero_()
    starts[::100] = 1  # blocks of 100 elements: another block size
    with pytest.raises(ValueError, match=r"'2\.weight' .*per-element layout: its blocks are 100 elements, where "
                                         r"int4:bred:b128 has 128 \(saved with another block size\)"):
        _load(sd)
    starts.zero_()
    starts[0], starts[70], starts[198] = 1, 1, 1  # a shard's own blocks
    with pytest.raises(ValueError, match="per-element layout: its blocks start inside this tensor's blocks.*"
                                         "resume it under FSDP2 at the world size it was saved at"):
        _load(sd)
    with pytest.raises(ValueError, match=r"'0\.bias' .*per-element layout: codes above the 4-bit range "
                                         r"\(saved with another format\)"):
        sd = copy.deepcopy(saved[0]["optimizer"])
        sd["state"]["0.bias"]["m"]["codes"][5] = 200
        _load(sd)
