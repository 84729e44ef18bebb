"""`qstate audit`: the sharding audit of a model's shapes, through CliRunner and a subprocess."""
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

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def test_audit_json_reports_each_rank_state_and_reason(tmp_path):
    out = tmp_path / "a" / "audit.json"
    res = runner.invoke(app, ["audit", "--model", "10x96,64x4096,4096", "-w", "2", "--min-quant-numel", "0",
                              "--json", str(out), "--csv", str(tmp_path / "audit.csv")])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["kind"] == "audit" and doc["schema_version"] == 1
    rows = {(r["rank"], r["tensor_id"], r["state"]): r for r in doc["records"]}
    assert len(rows) == 2 * 3 * 2
    assert rows[1, 0, "m"]["blocks"] == "local" and "starts at element 480" in rows[1, 0, "m"]["reason"]
    assert rows[1, 1, "v"]["blocks"] == "global" and rows[1, 1, "v"]["world_independent"]
    assert rows[1, 1, "v"]["local_shape"] == "32x4096" and rows[1, 1, "v"]["local_bytes"] == 32 * 4096 // 2 + 1024 * 4
    assert rows[0, 2, "m"]["blocks"] == "global" and not rows[0, 2, "m"]["world_independent"]
    assert not any(r["fp32"] for r in doc["records"])
    assert (tmp_path / "audit.csv").read_text().splitlines()[0].startswith("name,tensor_id,state")
    assert "4 on local blocks" in doc["meta"]["summary"]


def test_audit_bad_input_is_one_line_exit_2():
    for args in (["-w", "0"], ["-w", "2", "--rank", "2"], ["--model", "gpt3"], ["--states", "bred4bit"]):
        res = runner.invoke(app, ["audit", *args])
        assert res.exit_code == 2, (args, res.output)
        assert "Traceback" not in res.output


def test_audit_as_a_subprocess():
    res = subprocess.run([sys.executable, "-m", "qstate_cli", "audit", "--model", "tiny-lm", "-w", "4", "--rank", "3",
                          "--json", "-"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert {r["rank"] for r in doc["records"]} == {3}
    from qstate_cli.models.tiny_lm import build  # rows name the model's parameters
    assert [r["name"] for r in doc["records"] if r["state"] == "m"] == [n for n, _ in build("tiny-lm").named_parameters()]
    small = [r for r in doc["records"] if r["fp32"]]
    assert small and all("min_quant_numel=4096" in r["reason"] for r in small)


def test_audit_names_a_published_model_s_parameters_as_hugging_face_does():
    res = runner.invoke(app, ["audit", "--model", "gpt2-small", "-w", "8", "--rank", "0", "--json", "-"])
    assert res.exit_code == 0, res.output
    names = [r["name"] for r in json.loads(res.stdout)["records"] if r["state"] == "m"]
    assert names[:3] == ["wte.weight", "wpe.weight", "h.0.ln_1.weight"] and names[-1] == "ln_f.bias"
    assert "h.11.mlp.c_proj.weight" in names and len(set(names)) == len(names) == 148


def test_audit_table_names_the_path_of_each_state():
    res = runner.invoke(app, ["audit", "--model", "1000x100,3072", "-w", "2", "--rank", "0"],
                        env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines() if "global" in line and "local" in line)
    assert [h.strip() for h in header.strip("┃ ").split("┃")][:7] == [
        "rank", "name", "state", "global", "local", "path", "format"]
    rows = [line for line in res.output.splitlines() if "param" in line]
    assert len(rows) == 4 and all("reference" in line for line in rows)  # a sharded tensor steps the reference


def test_a_whole_tensor_optimizer_is_refused_in_the_plan(tmp_path):
    """Muon's Newton-Schulz needs whole matrices: the plan had shown its sharded parameters
    as a working reference path, and Muon refused them at the first step."""
    out = tmp_path / "a.json"
    r = runner.invoke(app, ["audit", "--model", "512x128,128x512", "--optimizer", "muon", "-w", "8", "--rank", "0",
                            "--json", str(out)], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["records"]
    assert [x["path"] for x in rows] == ["refused", "refused"]
    assert all("Muon cannot step a sharded parameter" in x["reason"] for x in rows)
    assert "2 REFUSED: the optimizer cannot step them sharded" in r.output
    r = runner.invoke(app, ["audit", "--model", "512x128", "--optimizer", "adamw", "-w", "8", "--rank", "0",
                            "--json", str(out)])
    assert r.exit_code == 0 and "refused" not in {x["path"] for x in json.loads(out.read_text())["records"]}


def muon_on_a_sharded_parameter() -> None:
    """Run in a subprocess: a one-rank FSDP2 mesh, then qstate's Muon built on it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import qstate_cli.optim as qoptim
    from qstate_cli.errors import QstateError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.Linear(128, 64)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    try:
        qoptim.Muon([model.weight], lr=0.02)
        print("built")
    except QstateError as exc:
        print("refused:", exc)
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort a normal exit (docs/distributed.md)


def test_muon_refuses_sharded_parameters_when_built():
    """It refused them at the first step, after the AdamW beside it had stepped."""
    pytest.importorskip("torch.distributed.fsdp")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT),
                                                                      os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", "from test_audit_cli import muon_on_a_sharded_parameter as f; f()"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: Muon cannot step a sharded (DTensor) parameter of shape (64, 128)" in run.stdout


def test_the_audit_says_why_the_reference_steps_a_cpu_parameter(monkeypatch):
    """On a CPU without numba the reason column was empty (only CUDA parameters had one)."""
    import qstate_cli.optim as qoptim
    from qstate_cli.optim import fused

    monkeypatch.setattr(fused, "cpu_unavailable", lambda device: "numba is not importable (test)")
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    rows = qoptim.AdamW(model.parameters(), states="bred-4bit").audit()
    big = [r for r in rows if r.name == "param0"]
    assert [r.path for r in big] == ["reference", "reference"]
    assert all("path: numba is not importable (test)" in r.reason for r in big)
    small = [r for r in rows if r.name == "param1"]  # fp32 states: their own reason, not the path's
    assert all("fp32 states" in r.reason and "numba" not in r.reason for r in small)
    rows = qoptim.AdamW(model.parameters(), states="bred-4bit", backend="reference").audit()
    assert not any("path:" in r.reason for r in rows)  # asked for: no reason to give
