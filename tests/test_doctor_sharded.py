"""`qstate doctor` on qstate states saved from sharded (FSDP2) parameters for DCP
(optim/sharded_state.py): the rows form (codes [rows, row bytes], scales [rows, row
blocks]) and the elements form (one code and scale per element, `block_starts`), also
from shards quantized on local blocks; layouts it cannot read are one line, exit 2."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.doctor.run import DoctorOptions, execute
from qstate_cli.doctor.safeload import load_checkpoint
from qstate_cli.doctor.states import find_optimizers
from qstate_cli.quant.config import STATE_IDS, parse_config
from qstate_cli.quant.packing import unpack
from qstate_cli.quant.quantizer import Stream
from qstate_cli.quant.state import QuantizedState

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def fsdp2_world_1(out: str) -> None:
    """Run in a subprocess: qstate AdamW (bred-4bit, every tensor quantized) under FSDP2
    on a one-rank gloo mesh, 2 steps, saved with DCP as scripts/fsdp2_example.py does;
    plus what the optimizer itself decodes for every state (expected.pt)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import qstate_cli.optim as qoptim

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    # 0.weight 48x256: rows form; 0.bias, 2.weight (a row of 48 is not whole blocks), 2.bias: elements form
    model = torch.nn.Sequential(torch.nn.Linear(256, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = qoptim.AdamW(model.parameters(), lr=1e-3, states="bred-4bit", min_quant_numel=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        loss = model(torch.randn(8, 256, generator=g)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(out, "ckpt"))
    ids = opt.tensor_ids()
    group = opt.param_groups[0]
    expected = {name: {s: q.decode().reshape(-1).clone() for s, q in opt.load_states(group, p, ids[id(p)]).items()}
                for name, p in model.named_parameters()}
    torch.save(expected, os.path.join(out, "expected.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see docs/distributed.md: gloo's threads can abort a normal exit


@pytest.mark.fsdp2_on_gloo
def test_fsdp2_dcp_checkpoint_reads_the_states_the_optimizer_decodes(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT),
                                                                      os.environ.get("PYTHONPATH")]))}
    code = f"from test_doctor_sharded import fsdp2_world_1; fsdp2_world_1({str(tmp_path)!r})"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = torch.load(tmp_path / "expected.pt")
    ckpt = load_checkpoint(tmp_path / "ckpt")
    st = ckpt["optim"]["state"]
    assert st["0.weight"]["m"]["codes"].shape == (48, 128) and st["0.weight"]["m"]["scales"].shape == (48, 2)
    assert "block_starts" in st["0.bias"]["m"] and "block_starts" in st["2.weight"]["v"]
    (o,) = find_optimizers(ckpt, "ckpt")
    assert [p.key for p in o.params] == list(expected)
    for p in o.params:
        for name in ("m", "v"):
            want = expected[p.key][name]
            assert p.states[name].storage.startswith("qstate ")
            assert torch.equal(p.states[name].values.reshape(-1)[: want.numel()], want), (p.key, name)
    res = execute(DoctorOptions(checkpoint=str(tmp_path / "ckpt")))
    assert [r["numel"] for r in res.records] == [48 * 256, 48, 10 * 48, 10]
    assert res.meta["summary"]["errors"] == 0
    r = runner.invoke(app, ["doctor", str(tmp_path / "ckpt")])
    assert r.exit_code == 0 and "healthy" in r.output, r.output


def local_blocks_sd(shape=(40, 129), world=2, step=3):
    """A bred-4bit state dict as FSDP2 at `world` ranks saves a parameter whose shards cut
    blocks (rows of 129): the elements form, each shard on local blocks (counter offset //
    B + b). Also the values each shard's QuantizedState decodes."""
    rows = -(-shape[0] // world)
    config = parse_config("bred-4bit")
    g = torch.Generator().manual_seed(1)
    entry, expected = {"step": torch.tensor(step)}, {}
    for name in ("m", "v"):
        spec = config.spec(name)
        codes, scales, starts, want = [], [], [], []
        for r in range(world):
            local = (min(shape[0], (r + 1) * rows) - min(shape[0], r * rows), *shape[1:])
            offset = min(shape[0], r * rows) * 129
            n = local[0] * 129
            q = QuantizedState(spec, local, Stream(0, 0, STATE_IDS[name], offset))
            x = torch.randn(local, generator=g) * 1e-3
            q.encode(x * x if name == "v" else x, step)
            want.append(q.decode().reshape(-1))
            block = torch.arange(n) // spec.block
            codes.append(unpack(q.codes, 4, n).to(torch.uint8))
            scales.append(q.scales[block])
            starts.append((torch.arange(n) % spec.block == 0).to(torch.uint8))
        entry[name] = {"codes": torch.cat(codes).view(shape), "scales": torch.cat(scales).view(shape),
                       "block_starts": torch.cat(starts).view(shape), "written": torch.tensor(step)}
        expected[name] = torch.cat(want)
    sd = {"state": {"w": entry}, "param_groups": [{"params": ["w"], "states": "bred-4bit", "seed": 0, "lr": 1e-3,
                                                   "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}]}
    return {"optim": sd}, expected


def test_shards_on_local_blocks_decode_with_their_own_counters(tmp_path):
    sd, expected = local_blocks_sd()
    (o,) = find_optimizers(sd, "x")
    (p,) = o.params
    for name in ("m", "v"):
        assert p.states[name].values.shape == (40, 129) and p.states[name].problems == []
        assert torch.equal(p.states[name].values.reshape(-1), expected[name]), name
    torch.save(sd, tmp_path / "local.pt")
    res = execute(DoctorOptions(checkpoint=str(tmp_path / "local.pt")))
    assert res.records[0]["numel"] == 40 * 129 and res.records[0]["shape"] == "40x129"


def _broken(edit):
    sd, _ = local_blocks_sd()
    edit(sd["optim"]["state"]["w"])
    return sd


@pytest.mark.parametrize("what, edit", [
    ("codes", lambda e: e["m"].update(codes=e["m"]["codes"].half())),
    ("size", lambda e: e["m"].update(block_starts=e["m"]["block_starts"][:-1])),
    ("blocks", lambda e: e["m"].update(block_starts=torch.zeros_like(e["m"]["block_starts"]))),
    ("fit", lambda e: e["v"]["codes"].view(-1).__setitem__(5, 200)),
    ("scales", lambda e: e["m"].update(scales="nope")),
])
def test_unreadable_layouts_are_one_line_and_exit_2(tmp_path, what, edit):
    sd = _broken(edit)
    torch.save(sd, tmp_path / "bad.pt")
    r = runner.invoke(app, ["doctor", str(tmp_path / "bad.pt")])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (what, r.output, r.exception)
    assert "Traceback" not in r.output and " w" in r.output


def test_rows_form_with_the_wrong_scale_count_is_a_format_error(tmp_path):
    spec = parse_config("bred-4bit").spec("m")
    q = QuantizedState(spec, (16, 256), Stream(0, 0, STATE_IDS["m"]))
    q.encode(torch.randn(16, 256), 1)
    sd = {"state": {"w": {"step": torch.tensor(1), "m": {"codes": q.codes.view(16, 128), "written": torch.tensor(1),
                                                         "scales": q.scales.view(16, 2)[:, :1]}}},
          "param_groups": [{"params": ["w"], "states": "bred-4bit", "seed": 0, "lr": 1e-3}]}
    torch.save(sd, tmp_path / "rows.pt")
    res = execute(DoctorOptions(checkpoint=str(tmp_path / "rows.pt")))
    assert any(f["check"] == "format" and "16 scales for 4096 elements" in f["message"]
               for f in res.extras["findings"])
    sd["state"]["w"]["m"]["scales"] = q.scales.view(16, 2)
    torch.save(sd, tmp_path / "rows.pt")
    (o,) = find_optimizers(load_checkpoint(tmp_path / "rows.pt"), "rows.pt")
    assert torch.equal(o.params[0].states["m"].values, q.decode().reshape(-1))
