"""`qstate doctor` on what a 2-rank FSDP2 run (torchrun, gloo, CPU) saves: a DCP directory
(`{"model", "optim"}`), each rank's own `torch.save({"model", "optimizer"})` (DTensors),
and the single-process run of the same training (`{"model", "optimizer"}`):

- `--against` pairs the one optimizer each file holds whatever its key (`optimizer`,
  `optim`), says so, and still finds a real difference;
- one rank's file of DTensor shards is refused in one line naming the rank (read with
  weights_only=True, never anything else); replicated DTensors read as whole tensors;
- states the checkpoint keeps per element (FSDP2's elements form) report the format's
  in-memory bytes beside the checkpoint's, with an info finding naming the layout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.distributed, pytest.mark.fsdp2_on_gloo]
ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor
import qstate_cli.optim as qoptim

torch.set_num_threads(1)
out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


def build():
    # 0.weight 48x256: rows of whole 128-blocks (rows form); 2.weight 96x48 (4,608 elements, quantized):
    # a row of 48 is not whole blocks (elements form); the biases are under 4096 elements: fp32
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 48), torch.nn.Tanh(), torch.nn.Linear(48, 96))


def train(model, opt):
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        loss = model(torch.randn(8, 256, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


model = build()
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = qoptim.AdamW(model.named_parameters(), lr=1e-3, states="bred-4bit")
train(model, opt)
dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
         checkpoint_id=os.path.join(out, "f.dcp"))
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(out, f"f-rank{rank}.pt"))
rep = distribute_tensor(torch.rand(64, 64, generator=torch.Generator().manual_seed(1)), mesh, [Replicate()])
if rank == 0:
    torch.save({"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": rep * 0.1, "exp_avg_sq": rep * 0.01}},
                              "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                "weight_decay": 0.0}]}}, os.path.join(out, "replicated.pt"))
    single = build()
    sopt = qoptim.AdamW(single.named_parameters(), lr=1e-3, states="bred-4bit")
    train(single, sopt)
    torch.save({"model": single.state_dict(), "optimizer": sopt.state_dict()}, os.path.join(out, "single.pt"))
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # gloo's threads can abort a normal exit (docs/distributed.md)
'''


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 is not available")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("fsdp-ckpt")
    script = out / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(out)], capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def doctor(*args) -> tuple[int, dict | None, str]:
    r = CliRunner().invoke(app, ["doctor", *map(str, args), "--json", "-"])
    return r.exit_code, (json.loads(r.stdout) if r.exit_code in (0, 1) else None), r.stderr


def test_against_pairs_the_one_optimizer_each_file_holds(ck, tmp_path):
    """single.pt keeps its optimizer at 'optimizer', the DCP directory at 'optim': the two
    are compared (0 differences: FSDP2 on global blocks equals the single process), and a
    finding and meta.paired say which keys were paired (the old doctor refused, exit 2)."""
    code, doc, err = doctor(ck / "single.pt", "--against", ck / "f.dcp")
    assert code == 0, err
    assert doc["meta"]["paired"] == {"optimizer": "optim"}
    assert len(doc["records"]) == 4 and all(r["against_differing"] == 0 for r in doc["records"])
    (paired,) = [f for f in doc["findings"] if f["check"] == "paired"]
    assert paired["severity"] == "info" and "'optim'" in paired["message"] and "'optimizer'" in paired["message"]
    code, doc, err = doctor(ck / "f.dcp", "--against", ck / "single.pt")
    assert code == 0 and doc["meta"]["paired"] == {"optim": "optimizer"}, err
    # the pairing compares for real: one changed fp32 state is found
    sd = torch.load(ck / "single.pt", weights_only=True)
    idx = sd["optimizer"]["param_groups"][0]["param_names"].index("2.bias")
    sd["optimizer"]["state"][idx]["m"]["codes"][5] += 1.0
    torch.save(sd, tmp_path / "changed.pt")
    code, doc, _ = doctor(tmp_path / "changed.pt", "--against", ck / "f.dcp")
    assert code == 1
    bad = [f for f in doc["findings"] if f["check"] == "against"]
    assert [(f["param"], f["count"]) for f in bad] == [("2.bias", 1)]


def test_against_with_several_optimizers_names_both_sides(ck, tmp_path):
    sd = torch.load(ck / "single.pt", weights_only=True)
    torch.save({"optimizer": sd["optimizer"], "optimizer2": sd["optimizer"]}, tmp_path / "two.pt")
    code, doc, err = doctor(tmp_path / "two.pt", "--against", ck / "f.dcp")
    line = err.strip()
    assert code == 2 and doc is None and "\n" not in line and "Traceback" not in line
    assert "holds optimizers at 'optimizer', 'optimizer2'" in line and "at 'optim'" in line


def test_one_ranks_dtensor_file_is_refused_in_one_line(ck, monkeypatch):
    """A rank's torch.save(opt.state_dict()) holds DTensor shards: read with weights_only=True
    (torch.distributed.tensor imported first), then refused naming the rank and the share
    of the values it holds; the old doctor called it Python objects that could run code."""
    loads = []
    real = torch.load

    def spy(*a, **kw):
        loads.append(kw.get("weights_only"))
        return real(*a, **kw)

    monkeypatch.setattr(torch, "load", spy)
    for rank in (0, 1):
        code, doc, err = doctor(ck / f"f-rank{rank}.pt")
        line = err.strip()
        assert code == 2 and "\n" not in line and "Traceback" not in line
        assert f"one rank's FSDP2 shard (rank {rank} of 2)" in line
        assert "could run code" not in line and "dcp.save" in line and "full_state_dict=True" in line
    assert loads and all(w is True for w in loads)


def cli(*args) -> subprocess.CompletedProcess:
    """`python -m qstate_cli ...` in a fresh process: nothing imported torch.distributed.tensor
    before the load (in this process, the optimizer's modules have)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "qstate_cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_a_fresh_process_reads_dtensor_files_safely(ck):
    """Replicated DTensors read as whole tensors; a shard file is the one-line refusal (the
    old doctor refused both as objects that could run code, where nothing had imported
    torch.distributed.tensor); the torch warning about unpickling a device mesh is not shown."""
    run = cli("doctor", ck / "replicated.pt", "--json", "-")
    assert run.returncode == 0, run.stderr
    (r,) = json.loads(run.stdout)["records"]
    assert r["shape"] == "64x64" and r["states"] == "exp_avg=fp32, exp_avg_sq=fp32" and r["state_bytes"] == 2 * 4096 * 4
    assert "DeviceMesh" not in run.stderr
    run = cli("doctor", ck / "f-rank1.pt")
    line = run.stderr.strip()
    assert run.returncode == 2 and "\n" not in line and "one rank's FSDP2 shard (rank 1 of 2)" in line, run.stderr
    assert "could run code" not in line


def test_replicated_dtensors_read_as_whole_tensors(ck):
    code, doc, err = doctor(ck / "replicated.pt")
    assert code == 0, err
    (r,) = doc["records"]
    assert r["shape"] == "64x64" and r["states"] == "exp_avg=fp32, exp_avg_sq=fp32" and r["state_bytes"] == 2 * 4096 * 4


def test_per_element_states_report_their_in_memory_bytes(ck):
    """2.weight's states are 4-bit in memory but saved per element in the DCP checkpoint:
    its record gives both byte counts (memory_bytes equals the single-process file's
    bytes), and an info finding says it is a layout, not an fp32 fallback."""
    code, doc, err = doctor(ck / "f.dcp")
    assert code == 0, err
    _, single, _ = doctor(ck / "single.pt")
    rec = {r["param"]: r for r in doc["records"]}
    ref = {r["param"]: r for r in single["records"]}
    w = rec["2.weight"]
    assert w["states"] == "m=qstate int4:bred:b128, v=qstate lin4nz:bred:b128"
    assert w["bytes_per_param"] >= 10  # code, scale and block-start mark per element, per state
    assert w["memory_bytes"] == ref["2.weight"]["state_bytes"] == 2 * (4608 // 2 + 36 * 4)
    assert w["memory_bytes_per_param"] == pytest.approx(1.0625)
    assert rec["0.weight"]["memory_bytes"] == rec["0.weight"]["state_bytes"] == ref["0.weight"]["state_bytes"]
    s, ref_s = doc["meta"]["summary"], single["meta"]["summary"]
    assert s["memory_bytes"] == ref_s["state_bytes"] == ref_s["memory_bytes"] < s["state_bytes"]
    (layout,) = [f for f in doc["findings"] if f["check"] == "layout"]
    assert layout["severity"] == "info" and layout["param"] == "2.weight" and layout["count"] == 4608
    assert "saved per element" in layout["message"] and "not an fp32 fallback" in layout["message"]
    assert "1.062 B/param in memory" in layout["message"]
    r = CliRunner().invoke(app, ["doctor", str(ck / "f.dcp")], env={"COLUMNS": "250"})  # the summary line says both
    held = f"{s['memory_bytes'] / s['elements']:.4g}"
    assert f"bytes/param as saved; {held} in memory)" in r.stdout, r.stdout[-400:]
