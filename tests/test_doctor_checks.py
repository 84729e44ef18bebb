"""`qstate doctor` on torch AdamW checkpoints broken by hand: a state of an integer dtype,
param ids listed twice or in no group, a step that is not a number, bad hyper-parameters;
a scalar parameter's 0-dim states; the CLI's and a suite point's wording."""
import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.doctor.run import DoctorOptions, execute
from qstate_cli.errors import QstateError

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
runner = CliRunner()


@pytest.fixture(scope="module")
def sd():
    """AdamW on a tiny MLP, 3 steps, built from a parameter list (ids 0..3, no names)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
    return opt.state_dict()


def edited(sd: dict, tmp_path, edit) -> dict:
    """The doctor's result on a deep copy of `sd` changed by `edit(copy)`."""
    copy = {"state": {k: {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in st.items()}
                      for k, st in sd["state"].items()},
            "param_groups": [dict(g, params=list(g["params"])) for g in sd["param_groups"]]}
    edit(copy)
    torch.save(copy, tmp_path / "edited.pt")
    return execute(DoctorOptions(checkpoint=str(tmp_path / "edited.pt")))


def errors(res) -> dict:
    return {(f["param"], f["check"], f["state"]): f["message"] for f in res.extras["findings"]
            if f["severity"] == "error"}


def test_a_state_of_an_integer_dtype_is_an_error_and_still_counted(sd, tmp_path):
    def edit(c):
        c["state"][3]["exp_avg_sq"] = c["state"][3]["exp_avg_sq"].to(torch.int8)

    res = edited(sd, tmp_path, edit)
    if "decoupled_weight_decay" not in sd["param_groups"][0]:
        pytest.skip(f"torch {torch.__version__}: AdamW's param groups have no decoupled_weight_decay key (new in "
                    f"torch 2.7), so Adam's and AdamW's checkpoints hold the same keys and the doctor names "
                    f"the writer torch.optim, not AdamW")
    assert errors(res) == {("3", "dtype", "exp_avg_sq"): "exp_avg_sq of param 3 is int8; AdamW's states are "
                                                         "floating point"}
    row = next(r for r in res.records if r["param"] == "3")
    assert row["states"] == "exp_avg=fp32, exp_avg_sq=int8" and row["state_bytes"] == 4 * 4 + 4 * 1
    assert row["v_flushed"] == 0  # the cast's zeros are the dtype's finding, not flushed values


def test_duplicate_param_ids_and_states_in_no_group_are_errors(sd, tmp_path):
    def edit(c):
        c["param_groups"][0]["params"] = [0, 0, 7]

    res = edited(sd, tmp_path, edit)
    found = errors(res)
    assert "listed 2 times" in found[("0", "duplicate", None)]
    for key in ("1", "2", "3"):
        assert "in no param group" in found[(key, "orphan", None)] and "7" in found[(key, "orphan", None)]
    assert [r["param"] for r in res.records] == ["0", "1", "2", "3"]  # param 0 once, not twice
    assert res.meta["summary"]["errors"] == 4


def test_a_group_listing_an_unstepped_param_is_not_a_finding(sd, tmp_path):
    res = edited(sd, tmp_path, lambda c: c["param_groups"][0]["params"].append(4))
    assert res.extras["findings"] == [] and res.meta["optimizers"][0]["unstepped"] == 1


def test_bad_step_and_hyper_parameters_are_errors_one_line_each(sd, tmp_path):
    def edit(c):
        c["state"][0]["step"] = "many"
        c["param_groups"][0].update(lr=float("nan"), betas="x", eps=0.0)

    res = edited(sd, tmp_path, edit)
    found = errors(res)
    assert found[("0", "step", "step")] == "step counter 'many' (str) is not a number"
    assert set(found) == {("0", "step", "step"), ("param_groups[0]", "hparams", "lr"),
                          ("param_groups[0]", "hparams", "betas"), ("param_groups[0]", "hparams", "eps")}
    assert "lr nan" in found[("param_groups[0]", "hparams", "lr")]
    assert "two numbers in [0, 1)" in found[("param_groups[0]", "hparams", "betas")]
    r = runner.invoke(app, ["doctor", str(tmp_path / "edited.pt")])
    assert r.exit_code == 1 and "4 errors" in r.output
    lines = [line for line in r.output.splitlines() if line.startswith("error ")]
    assert len(lines) == 4 and all("\n" not in f["message"] for f in res.extras["findings"])


@pytest.mark.parametrize("group, bad", [
    (dict(lr=-1e-3), {"lr"}), (dict(lr=float("inf")), {"lr"}), (dict(betas=(0.9, 1.0)), {"betas"}),
    (dict(betas=(0.9,)), {"betas"}), (dict(betas=(float("nan"), 0.99)), {"betas"}),
    (dict(eps=-1e-8), {"eps"}), (dict(eps=float("nan")), {"eps"}), (dict(weight_decay=float("nan")), {"weight_decay"}),
    (dict(lr=torch.tensor(1e-3), betas=(0.0, 0.5), eps=1e-12), set())])
def test_hyper_parameter_ranges(sd, tmp_path, group, bad):
    res = edited(sd, tmp_path, lambda c: c["param_groups"][0].update(group))
    assert {s for (_, check, s) in errors(res) if check == "hparams"} == bad


def test_a_scalar_parameters_states_are_read_not_missing(tmp_path):
    lin, scale = torch.nn.Linear(3, 2), torch.nn.Parameter(torch.tensor(1.0))  # e.g. CLIP's logit_scale
    opt = torch.optim.AdamW(list(lin.parameters()) + [scale])
    (lin(torch.randn(4, 3)).sum() * scale).backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "s.pt")
    res = execute(DoctorOptions(checkpoint=str(tmp_path / "s.pt")))
    assert res.extras["findings"] == [] and res.records[2]["states"] == "exp_avg=fp32, exp_avg_sq=fp32"


def test_messages_for_the_cli_and_for_a_suite_point(sd, tmp_path):
    r = runner.invoke(app, ["doctor"])
    assert r.exit_code == 2 and "error: doctor needs a CHECKPOINT\n" in r.output and "suite" not in r.output
    with pytest.raises(QstateError, match="a suite point needs 'checkpoint'"):
        DoctorOptions.from_params({"against": "x.pt"}, "doctor")


def test_storage_findings_count_their_elements(sd, tmp_path):
    half = {"state": {k: {n: (t.half() if n == "exp_avg_sq" else t) for n, t in st.items()}
                      for k, st in sd["state"].items()}, "param_groups": sd["param_groups"]}
    torch.save(sd, tmp_path / "a.pt")
    torch.save(half, tmp_path / "b.pt")
    res = execute(DoctorOptions(checkpoint=str(tmp_path / "a.pt"), against=str(tmp_path / "b.pt")))
    storage = [f for f in res.extras["findings"] if f["check"] == "storage"]
    assert len(storage) == 4 and sum(f["count"] for f in storage) == res.meta["summary"]["elements"]
    r = runner.invoke(app, ["doctor", str(tmp_path / "a.pt"), "--against", str(tmp_path / "b.pt")])
    assert "[4 parameters, 0 elements" not in r.output
