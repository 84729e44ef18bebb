"""`qstate doctor`: fp16-flushed v, a healthy checkpoint, --against, the peers' formats
read back equal to their own dequantization, DCP directories, hostile and broken input."""
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.cli.doctor_cmd import finding_lines
from qstate_cli.doctor.run import DoctorOptions, execute
from qstate_cli.doctor.safeload import load_checkpoint
from qstate_cli.doctor.states import find_optimizers

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def model_and_adamw(steps=10, seed=0):
    """A small MLP whose input features span 5 decades, so the first layer's gradients (and v) do too: fp16 flushes some of its v; AdamW
    built from named parameters (its state dict names them: '0.weight', '2.weight', ...)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 320))
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    scale = torch.logspace(-4, 0, 64)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g) * scale
        loss = model(x).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def v_to_fp16(sd: dict) -> dict:
    return {"state": {k: {n: (t.half() if n == "exp_avg_sq" else t) for n, t in st.items()}
                      for k, st in sd["state"].items()}, "param_groups": sd["param_groups"]}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("doctor")
    _, opt = model_and_adamw()
    sd = opt.state_dict()
    torch.save(sd, d / "healthy.pt")
    torch.save(v_to_fp16(sd), d / "fp16v.pt")
    return d, sd


def doctor(*args):
    return runner.invoke(app, ["doctor", *map(str, args)])


def test_fp16_v_flushes_exactly_the_values_fp16_rounds_to_zero(ckpts, tmp_path):
    d, sd = ckpts
    expected = sum(int(((st["exp_avg_sq"] != 0) & (st["exp_avg_sq"].half() == 0)).sum())
                   for st in sd["state"].values())
    kept = sum(int((st["exp_avg_sq"].half() != 0).sum()) for st in sd["state"].values())
    assert expected > 100 and kept > 100  # the model makes both: some flushed, most kept
    r = doctor(d / "fp16v.pt", "--json", tmp_path / "r.json")
    assert r.exit_code == 1, r.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["meta"]["summary"]["v_flushed"] == expected
    assert sum(f["count"] for f in doc["findings"] if f["check"] == "flushed") == expected
    assert {f["check"] for f in doc["findings"] if f["severity"] == "error"} == {"flushed"}
    assert "flushed by fp16" in r.output and "check failed" in r.output
    assert {r["param"] for r in doc["records"]} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    errors = sum(f["severity"] == "error" for f in doc["findings"])
    assert f"; {errors} error{'s' * (errors != 1)}, " in r.output  # counted as English counts


def test_healthy_checkpoint_passes(ckpts):
    d, sd = ckpts
    res = execute(DoctorOptions(checkpoint=str(d / "healthy.pt")))
    assert res.meta["summary"]["errors"] == 0 and res.extras["findings"] == []
    numel = sum(st["exp_avg"].numel() for st in sd["state"].values())
    assert res.meta["summary"]["state_bytes"] == 8 * numel  # two fp32 states
    r = doctor(d / "healthy.pt")
    assert r.exit_code == 0, r.output
    assert "healthy" in r.output


def test_against_names_the_single_changed_element(ckpts, tmp_path):
    d, sd = ckpts
    changed = {"state": {k: {n: t.clone() for n, t in st.items()} for k, st in sd["state"].items()},
               "param_groups": sd["param_groups"]}
    changed["state"][2]["exp_avg_sq"][300, 17] *= 1.5
    torch.save(changed, tmp_path / "resumed.pt")
    r = doctor(d / "healthy.pt", "--against", tmp_path / "resumed.pt", "--json", tmp_path / "a.json")
    assert r.exit_code == 1, r.output
    doc = json.loads((tmp_path / "a.json").read_text())
    diffs = {row["param"]: row["against_differing"] for row in doc["records"]}
    assert diffs == {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 0}
    (finding,) = doc["findings"]
    assert "element (300,17) of 2.weight" in finding["message"] and finding["state"] == "exp_avg_sq"
    assert doctor(d / "healthy.pt", "--against", d / "healthy.pt").exit_code == 0


def test_fp16_v_against_the_original_counts_every_changed_value(ckpts):
    d, sd = ckpts
    res = execute(DoctorOptions(checkpoint=str(d / "fp16v.pt"), against=str(d / "healthy.pt")))
    changed = sum(int((st["exp_avg_sq"].half().float() != st["exp_avg_sq"]).sum()) for st in sd["state"].values())
    assert sum(r["against_differing"] for r in res.records) == changed
    storage = [f for f in res.extras["findings"] if f["check"] == "storage"]
    assert len(storage) == 4 and "fp16 here, fp32 in" in storage[0]["message"]
    lines = finding_lines(res.extras["findings"])
    assert any(f"[4 parameters, {sum(f['count'] for f in storage):,} elements in all]" in ln for ln in lines)
    steps = [{**storage[0], "check": "step", "count": 0, "param": p} for p in ("a", "b")]  # about no element
    assert finding_lines(steps)[0].endswith("[2 parameters]")


def test_nonfinite_missing_and_bad_steps_are_errors(ckpts, tmp_path):
    _, sd = ckpts
    broken = {"state": {k: {n: t.clone() for n, t in st.items()} for k, st in sd["state"].items()},
              "param_groups": sd["param_groups"]}
    broken["state"][0]["exp_avg"][0, :3] = float("nan")
    broken["state"][0]["exp_avg"][1, 0] = float("inf")
    del broken["state"][1]["exp_avg_sq"]
    broken["state"][3]["step"] = torch.tensor(2.5)
    broken["state"][2]["step"] = torch.tensor(float("inf"))
    torch.save(broken, tmp_path / "broken.pt")
    res = execute(DoctorOptions(checkpoint=str(tmp_path / "broken.pt")))
    errors = {(f["param"], f["check"]): f for f in res.extras["findings"] if f["severity"] == "error"}
    assert errors[("0.weight", "nonfinite")]["count"] == 4
    assert "3 NaN, 1 Inf" in errors[("0.weight", "nonfinite")]["message"]
    assert ("0.bias", "missing") in errors and ("2.bias", "step") in errors and ("2.weight", "step") in errors
    warns = {f["check"] for f in res.extras["findings"] if f["severity"] == "warn"}
    assert "steps" in warns  # 2.5 disagrees with the others' 10


def test_qstate_checkpoint_reads_back_what_the_optimizer_decodes(tmp_path):
    import qstate_cli.optim as qoptim

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40, 129))  # odd number of elements: a short last block
    opt = qoptim.AdamW([p], lr=1e-3, states="bred-4bit")
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "q.pt")
    (o,) = find_optimizers(load_checkpoint(tmp_path / "q.pt"), "q.pt")
    states = opt.load_states(opt.param_groups[0], p, 0)
    (ps,) = o.params
    for name in ("m", "v"):
        want = states[name].decode().reshape(-1)
        got = ps.states[name].values.reshape(-1)
        assert torch.equal(got[: want.numel()], want)
        assert ps.states[name].storage.startswith("qstate ")
    assert o.kind == "qstate" and ps.step == 3
    assert execute(DoctorOptions(checkpoint=str(tmp_path / "q.pt"))).meta["summary"]["errors"] == 0


def test_torchao_states_read_without_torchao_equal_its_dequantize(tmp_path):
    ao = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128))
    small = torch.nn.Parameter(torch.randn(10))
    for cls in (ao.AdamW4bit, ao.AdamW8bit):
        opt = cls([p, small], lr=1e-3)
        for _ in range(2):
            p.grad, small.grad = torch.randn_like(p), torch.randn_like(small)
            opt.step()
        torch.save(opt.state_dict(), tmp_path / "ao.pt")
        (o,) = find_optimizers(load_checkpoint(tmp_path / "ao.pt"), "ao.pt")
        assert o.kind == "torchao", [(q.key, {k: s.storage for k, s in q.states.items()}) for q in o.params]
        for name in ("exp_avg", "exp_avg_sq"):
            got = o.params[0].states[name]
            assert torch.equal(got.values, opt.state[p][name].dequantize())
            assert got.storage == f"torchao {4 if cls is ao.AdamW4bit else 8}-bit" and got.low_bit
    # a checkpoint where one big tensor's states were saved dequantized: a silent upcast (warn, exit 0)
    opt = ao.AdamW8bit([p, torch.nn.Parameter(torch.randn(64, 128))], lr=1e-3)
    for q in opt.param_groups[0]["params"]:
        q.grad = torch.randn_like(q)
    opt.step()
    sd = opt.state_dict()
    sd["state"][1] = {k: (v.dequantize() if k != "step" else v) for k, v in sd["state"][1].items()}
    torch.save(sd, tmp_path / "up.pt")
    res = execute(DoctorOptions(checkpoint=str(tmp_path / "up.pt")))
    upcast = [f for f in res.extras["findings"] if f["check"] == "upcast"]
    assert {f["param"] for f in upcast} == {"1"} and res.meta["summary"]["errors"] == 0, res.extras["findings"]


def test_bnb_states_equal_bitsandbytes_dequantize(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    F = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = bnb.optim.AdamW8bit([p], lr=1e-3)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "bnb.pt")
    (o,) = find_optimizers(load_checkpoint(tmp_path / "bnb.pt"), "bnb.pt")
    st = opt.state[p]
    for key, n in (("state1", 1), ("state2", 2)):
        want = F.dequantize_blockwise(st[key], absmax=st[f"absmax{n}"], code=st[f"qmap{n}"], blocksize=256)
        assert torch.allclose(o.params[0].states[key].values, want, rtol=0, atol=0)
    assert o.kind == "bnb"


def test_dcp_directory_reads_safely_with_names(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = model_and_adamw(steps=3)
    osd = get_optimizer_state_dict(model, opt)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=str(tmp_path / "ck"))
    res = execute(DoctorOptions(checkpoint=str(tmp_path / "ck")))
    assert [r["param"] for r in res.records] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert {r["optimizer"] for r in res.records} == {"optim"} and res.meta["summary"]["errors"] == 0
    (o,) = find_optimizers(load_checkpoint(tmp_path / "ck"), "ck")
    assert torch.equal(o.params[2].states["exp_avg_sq"].values, opt.state[model[2].weight]["exp_avg_sq"])
    # hostile metadata: a pickle that would call os.system is refused before it runs
    marker = tmp_path / "pwned"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    r = doctor(tmp_path / "ck")
    assert r.exit_code == 2 and "refused" in r.output and not marker.exists()


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_hostile_and_broken_files_exit_2_and_run_nothing(tmp_path, ckpts):
    d, _ = ckpts
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": _Evil(str(marker))}, tmp_path / "evil.pt")
    (tmp_path / "raw.pkl").write_bytes(pickle.dumps({"state": {}, "param_groups": []}))
    data = (d / "healthy.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    torch.save({"model": {"w": torch.zeros(3)}}, tmp_path / "no_opt.pt")
    cases = {"evil.pt": "refused", "raw.pkl": "a raw pickle, refused", "cut.pt": "", "no_opt.pt": "no optimizer state",
             "missing.pt": "no such checkpoint"}
    for name, words in cases.items():
        r = doctor(tmp_path / name)
        assert r.exit_code == 2, (name, r.output)
        assert words in r.output and "Traceback" not in r.output
    assert not marker.exists()
    r = doctor(d / "healthy.pt", "--max-gib", "1e-9")
    assert r.exit_code == 2 and "over the limit" in r.output
    assert zipfile.is_zipfile(d / "healthy.pt")


def test_real_subprocess_exit_codes_and_json_stdout(ckpts):
    d, _ = ckpts
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run([sys.executable, "-m", "qstate_cli", "doctor", str(d / "fp16v.pt"), "--json", "-"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1, bad.stderr
    doc = json.loads(bad.stdout)
    assert doc["kind"] == "doctor" and doc["meta"]["summary"]["errors"] == 1
    assert "check failed: 1 finding(s)" in bad.stderr
    ok = subprocess.run([sys.executable, "-m", "qstate_cli", "doctor", str(d / "healthy.pt")],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0 and "healthy" in ok.stdout


def test_report_section_and_suite_point(ckpts, tmp_path):
    from qstate_cli.report import write_report
    from qstate_cli.suites.kinds import hook_for

    d, _ = ckpts
    parts = hook_for("doctor")({"checkpoint": str(d / "fp16v.pt")})
    assert len(parts["records"]) == 4 and [f["check"] for f in parts["findings"] if f["severity"] == "error"] == ["flushed"]
    doc = execute(DoctorOptions(checkpoint=str(d / "fp16v.pt"))).document()
    write_report([doc], tmp_path / "r.html", tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    assert "Doctor: optimizer-state checkpoint" in md and "flushed by fp16" in md
    assert "flushed by fp16" in (tmp_path / "r.html").read_text()


BLOCK_PEERS = """
import sys, importlib.abc
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torchao", "bitsandbytes"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Blocker())
"""


def test_torchao_checkpoint_reads_in_a_process_without_torchao(tmp_path):
    """tests/data/torchao-adamw4bit.pt: torchao 0.18 AdamW4bit on a (32, 128) parameter, 2
    steps; -dequantized.pt holds torchao's own dequantize() of its two states."""
    code = BLOCK_PEERS + """
import torch
from qstate_cli.doctor.safeload import load_checkpoint
from qstate_cli.doctor.states import find_optimizers
(o,) = find_optimizers(load_checkpoint(sys.argv[1]), "fixture")
want = torch.load(sys.argv[2], weights_only=True)
for name in ("exp_avg", "exp_avg_sq"):
    got = o.params[0].states[name]
    assert got.storage == "torchao 4-bit" and torch.equal(got.values, want[name]), name
assert "torchao" not in sys.modules
print("ok", o.kind)
"""
    data = ROOT / "tests" / "data"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code, str(data / "torchao-adamw4bit.pt"),
                        str(data / "torchao-adamw4bit-dequantized.pt")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok torchao", r.stderr[-2000:]
