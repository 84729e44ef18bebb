"""qstate's optimizers on 2 FSDP2 ranks (gloo, CPU), where the shards must talk to each other
(optim/collectives.py, optim/sharded_state.py):

    te-fp8     one scale per tensor: the absmax is all-reduced, so both ranks hold the whole
               tensor's scale; codes and scales equal single-process, and a DCP round trip
               keeps every rank's states (DCP keeps one copy of a plain tensor: rank 0's)
    mismatch   a rank built with other states or another seed is refused at the first step,
               on every rank, in one line naming the rank and the field; so is state_dict()
    dim1       fully_shard(..., shard_placement_fn=Shard(1)): state_dict() works (per-element
               form), DCP saves and loads at the same world size bit for bit, the audit says
               the codes depend on the world size
    hsdp       a 2-D mesh (replicate 2 x shard 1): a NaN gradient element is counted once in
               the state dict, not once per replica

One `torch.distributed.run` of this file (2 ranks, ~20-40 s on a loaded 2-core machine) runs
every scenario; the tests read what rank 0 wrote. The single-process references run here.
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
LR = 1e-2


def aligned_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 128, bias=False))


def train(model, opt, steps: int, first: int = 0, poison: int | None = None) -> None:
    """Every rank sees the whole batch (the mean of equal gradients is exact)."""
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(16, 128, generator=g), torch.randn(16, 128, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if step == poison:  # one NaN gradient element, on every rank (HSDP: each replica's copy)
            _local(model[0].weight.grad).view(-1)[3] = float("nan")
        opt.step()


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_states(opt) -> dict:
    """{param index: {state: {codes, scales}}}: this rank's stored tensors."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {i: {n: {f: t.clone() for f, t in opt.state[p][n].items() if f in ("codes", "scales")}
                for n in ("m", "v")} for i, p in enumerate(params) if opt.state.get(p)}


def same_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[i][n][f], b[i][n][f]) for i in a for n in a[i] for f in a[i][n])


# ---- what each rank runs -----------------------------------------------------------------------
def worker(out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from qstate_cli.errors import QstateError
    from qstate_cli.optim import AdamW

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results = {}

    def shard(model, mesh=mesh, **kw):
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, **kw)
        return fully_shard(model, mesh=mesh, **kw)

    def gathered(obj):
        everyone = [None] * world
        dist.all_gather_object(everyone, obj)
        return everyone

    def dcp_round_trip(model, opt, make, name, **kw):
        """Save, load into a fresh (model, opt) at this world size: (states equal, next step equal)."""
        ckpt = os.path.join(out, name)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=ckpt)
        model2 = shard(aligned_model(), **kw)
        opt2 = make(model2)
        target = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(target, checkpoint_id=ckpt)
        set_model_state_dict(model2, target["model"])
        set_optimizer_state_dict(model2, opt2, target["optim"])
        loaded = same_states(local_states(opt), local_states(opt2))
        train(model, opt, 1, first=STEPS)
        train(model2, opt2, 1, first=STEPS)
        stepped = same_states(local_states(opt), local_states(opt2)) and all(
            torch.equal(_local(a.detach()), _local(b.detach())) for a, b in zip(model.parameters(), model2.parameters()))
        return gathered(loaded), gathered(stepped)

    # te-fp8: one scale per tensor, the whole tensor's on every rank
    def te(model):
        return AdamW(model.parameters(), lr=LR, states="te-fp8", min_quant_numel=0)

    model = shard(aligned_model())
    opt = te(model)
    train(model, opt, STEPS)
    sd = opt.state_dict()
    whole = {i: {n: DTensor.full_tensor(st[n]["codes"]).reshape(-1) for n in ("m", "v")} for i, st in sd["state"].items()}
    results["te"] = {"codes": whole, "scales": gathered({i: {n: st[n]["scales"] for n in ("m", "v")}
                                                         for i, st in local_states(opt).items()}),
                     "params": [p.detach().full_tensor() for p in model.parameters()],
                     "audit": [r.record() for r in opt.audit()]}
    results["te"]["dcp"] = dcp_round_trip(model, opt, te, "te.dcp")

    # mismatched configurations across ranks: refused at the first step and in state_dict()
    def refused(make, after=None):
        model = shard(aligned_model())
        opt = make(model)
        try:
            train(model, opt, 1)
            if after is not None:
                after(opt)
                opt.state_dict()
        except Exception as e:  # noqa: BLE001  (what else a rank raised is shown in the test's failure)
            return str(e) if isinstance(e, QstateError) else f"{type(e).__name__}: {e}"
        return None

    results["mismatch"] = {
        "states": gathered(refused(lambda m: AdamW(m.parameters(), states="bnb-8bit" if rank == 1 else "bred-4bit"))),
        "seed": gathered(refused(lambda m: AdamW(m.parameters(), seed=7 if rank == 1 else 0))),
        "state_dict": gathered(refused(lambda m: AdamW(m.parameters()),  # no tensor changes format
                                       after=lambda o: o.param_groups[0].update(min_quant_numel=4096 + rank))),
        "agreeing": gathered(refused(lambda m: AdamW(m.parameters()), after=lambda o: None)),
    }

    # dim 1 sharded (shard_placement_fn): the per-element form
    def dim1(p):
        return Shard(1) if p.ndim == 2 else Shard(0)

    def bred(model):
        return AdamW(model.parameters(), lr=LR, states="bred-4bit", min_quant_numel=0)

    model = shard(aligned_model(), shard_placement_fn=dim1)
    opt = bred(model)
    train(model, opt, STEPS)
    try:
        opt.state_dict()
        error = None
    except Exception as e:  # noqa: BLE001  (the old code: a reshape's RuntimeError)
        error = f"{type(e).__name__}: {e}"
    results["dim1"] = {"state_dict": gathered(error), "audit": gathered([r.record() for r in opt.audit()])}
    if error is None:
        results["dim1"]["dcp"] = dcp_round_trip(model, opt, bred, "dim1.dcp", shard_placement_fn=dim1)

    # HSDP: replicate x shard; the NaN is in both replicas' (equal) gradients
    mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = shard(aligned_model(), mesh=mesh2)
    opt = bred(model)
    train(model, opt, 2, poison=1)
    counted = sum(int(st["nonfinite"]) for st in opt.state_dict()["state"].values())
    results["hsdp"] = {"state_dict": gathered(counted), "local": gathered(opt.nonfinite_count())}

    if rank == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort a normal exit (docs/distributed.md)


# ---- the tests -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) is not available")
    out = tmp_path_factory.mktemp("fsdp-ranks")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(Path(__file__)), str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return torch.load(out / "results.pt", weights_only=True)


pytestmark = [pytest.mark.distributed, pytest.mark.fsdp2_on_gloo]


def test_a_tensor_scale_is_the_whole_tensors_on_every_rank_and_equals_single_process(ranks):
    te = ranks["te"]
    model = aligned_model()
    from qstate_cli.optim import AdamW

    opt = AdamW(model.parameters(), lr=LR, states="te-fp8", min_quant_numel=0, backend="reference")
    train(model, opt, STEPS)
    single = local_states(opt)
    rank0, rank1 = te["scales"]
    for i in single:
        for n in ("m", "v"):
            assert torch.equal(rank0[i][n], single[i][n]["scales"]), f"param {i} {n}: rank 0's scale"
            assert torch.equal(rank1[i][n], single[i][n]["scales"]), f"param {i} {n}: rank 1's scale"
            assert torch.equal(te["codes"][i][n], single[i][n]["codes"]), f"param {i} {n}: codes"
    for a, b in zip(te["params"], model.parameters()):
        assert torch.equal(a, b.detach())
    reasons = [r["reason"] for r in te["audit"]]
    assert all("all-reduced (MAX)" in r for r in reasons), reasons
    assert all(r["world_independent"] for r in te["audit"])


def test_a_tensor_scale_survives_a_dcp_round_trip_on_every_rank(ranks):
    loaded, stepped = ranks["te"]["dcp"]
    assert loaded == [True, True] and stepped == [True, True]


def test_ranks_with_another_configuration_are_refused_in_one_line(ranks):
    mm = ranks["mismatch"]
    for field, want in (("states", "states (m) is 'de8:nearest:b256' on rank 1 but 'int4:bred:b128' on rank 0"),
                        ("seed", "seed is 7 on rank 1 but 0 on rank 0"),
                        ("state_dict", "min_quant_numel is 4097 on rank 1 but 4096 on rank 0")):
        for msg in mm[field]:  # every rank raises the same line (none hangs)
            assert msg is not None and want in msg and "\n" not in msg, (field, msg)
    assert mm["agreeing"] == [None, None]


def test_a_dim1_sharded_parameter_saves_and_loads_at_its_world_size(ranks):
    d = ranks["dim1"]
    assert d["state_dict"] == [None, None]
    assert d["dcp"] == ([True, True], [True, True])
    rows = [r for rank_rows in d["audit"] for r in rank_rows if r["name"] == "param0"]  # 256x128, Shard(1)
    assert rows and all(r["blocks"] == "local" and not r["world_independent"] for r in rows)
    assert all("a dim other than 0 is sharded" in r["reason"] for r in rows)


def test_hsdp_counts_a_nonfinite_gradient_once_not_once_per_replica(ranks):
    h = ranks["hsdp"]
    assert h["local"] == [1, 1]  # each replica's rank saw the element
    assert h["state_dict"] == [1, 1]


if __name__ == "__main__":
    worker(sys.argv[1])
