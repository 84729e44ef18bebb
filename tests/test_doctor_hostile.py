"""`qstate doctor` on states that are not dense tensors with data (doctor/tensors.py) and on
DCP metadata at its bounds (doctor/dcpmeta.py; the refusals are cases of tests/bad_inputs.py).

A sparse, meta or nested exp_avg raised a traceback in the checks (exit 1, read as a
finding); now it is one `tensor` error naming the state, and every other state is checked.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.doctor.run import DoctorOptions, execute
from qstate_cli.errors import QstateError

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def adamw_state() -> dict:
    params = [torch.nn.Parameter(torch.ones(32, 64)), torch.nn.Parameter(torch.ones(32))]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt.state_dict()


def with_state(tmp_path, name: str, key: str, value, param: int = 0) -> str:
    sd = adamw_state()
    sd["state"][param][key] = value
    torch.save(sd, tmp_path / name)
    return str(tmp_path / name)


ODD = {
    "sparse": (lambda: torch.ones(32, 64).to_sparse(), "a sparse_coo tensor", "fp32 sparse_coo"),
    "meta": (lambda: torch.empty(32, 64, device="meta"), "a meta tensor (a shape without data)", "fp32 meta"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(64)] * 32), "a nested tensor", "fp32 nested"),
    "expanded": (lambda: torch.ones(1).expand(2**20, 2**20), "a view of 1,099,511,627,776 elements over 4 bytes",
                 "fp32 view"),
}


@pytest.mark.parametrize("kind", list(ODD))
def test_an_odd_state_is_one_tensor_error_and_the_rest_is_checked(kind, tmp_path):
    make, says, storage = ODD[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors: "in prototype stage"
        value = make()
    path = with_state(tmp_path, "ck.pt", "exp_avg", value)
    res = execute(DoctorOptions(checkpoint=path))
    (finding,) = [f for f in res.extras["findings"] if f["severity"] == "error"]
    assert finding["check"] == "tensor" and finding["state"] == "exp_avg" and finding["param"] == "0"
    assert finding["message"].startswith(f"exp_avg of param 0 is {says}")
    rows = {r["param"]: r for r in res.records}
    assert f"exp_avg={storage}" in rows["0"]["states"] and "exp_avg_sq=fp32" in rows["0"]["states"]
    assert rows["1"]["errors"] == 0 and rows["0"]["numel"] == value.numel()
    r = CliRunner().invoke(app, ["doctor", path], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output


def test_against_a_checkpoint_with_a_sparse_state_names_it_and_compares_the_rest(tmp_path):
    healthy = tmp_path / "ok.pt"
    torch.save(adamw_state(), healthy)
    odd = with_state(tmp_path, "sparse.pt", "exp_avg", torch.ones(32, 64).to_sparse())
    res = execute(DoctorOptions(checkpoint=str(healthy), against=odd))
    errors = [f for f in res.extras["findings"] if f["severity"] == "error"]
    assert [(f["check"], f["param"], f["state"]) for f in errors] == [("tensor", "0", "exp_avg")]
    assert errors[0]["message"] == f"exp_avg of param 0 in {odd} is a sparse_coo tensor: not compared"


def test_a_meta_step_counter_is_a_step_finding(tmp_path):
    path = with_state(tmp_path, "ck.pt", "step", torch.empty((), device="meta"))
    res = execute(DoctorOptions(checkpoint=path))
    (finding,) = [f for f in res.extras["findings"] if f["severity"] == "error"]
    assert finding["check"] == "step" and "a meta tensor" in finding["message"]


def test_a_nested_tensor_in_a_model_state_dict_beside_the_optimizer(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "in prototype stage" (once per process)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    torch.save({"model": {"w": torch.ones(32, 64), "odd": nested}, "optimizer": adamw_state()}, tmp_path / "ck.pt")
    res = execute(DoctorOptions(checkpoint=str(tmp_path / "ck.pt")))
    assert res.meta["summary"]["errors"] == 0


def test_planner_paths_are_bounded_by_the_items_stored_and_must_not_collide(tmp_path):
    from qstate_cli.doctor.dcpmeta import unflatten

    flat = {"a": 1, "b": 2, "c": 3}
    assert unflatten(flat, {"a": ("l", 2), "b": ("l", 0), "c": ("d", "x")}, tmp_path) == {"l": [2, None, 1],
                                                                                          "d": {"x": 3}}
    with pytest.raises(QstateError, match=r"holds list index 3, but the checkpoint stores 3 item\(s\)"):
        unflatten(flat, {"a": ("l", 3)}, tmp_path)
    with pytest.raises(QstateError, match=r"holds list index -1"):
        unflatten(flat, {"a": ("l", -1)}, tmp_path)
    for collide in ({"a": ("l", 0), "b": ("l", "x")}, {"a": ("v",), "b": ("v", "x")}):
        with pytest.raises(QstateError, match="runs into another item's"):
            unflatten(flat, collide, tmp_path)
    with pytest.raises(QstateError, match="planner_data is list"):
        unflatten(flat, [("a",)], tmp_path)


def test_a_dcp_chunk_that_is_a_meta_tensor_is_refused(tmp_path, monkeypatch):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from qstate_cli.doctor import safeload

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optimizer": adamw_state()}, checkpoint_id=str(tmp_path / "ck"))
    real = safeload._read_item

    def read(root, info, handles):
        value = real(root, info, handles)
        return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value

    monkeypatch.setattr(safeload, "_read_item", read)
    with pytest.raises(QstateError, match=r"ck: item '.*' is a meta tensor \(a shape without data\)"):
        safeload.load_checkpoint(tmp_path / "ck")
