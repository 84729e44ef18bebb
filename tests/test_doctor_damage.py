"""`qstate doctor` on qstate checkpoints damaged by hand (a user probe's findings): a state
in no param group, a group without `states` or with a `seed` that is not an integer, fp16
codes where a small tensor keeps fp32, a truncated zip; the shape column where qstate's
flat codes keep no shape; two checkpoints keyed one by index, one by name."""
import copy

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.cli.doctor_cmd import finding_lines
from qstate_cli.doctor.run import DoctorOptions, execute

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
runner = CliRunner()


@pytest.fixture(scope="module")
def trained():
    """qstate AdamW (bred-4bit), two groups: a 64x80 weight (5,120 elements: 4-bit codes) and
    its bias (64 elements, under min_quant_numel: fp32), 2 steps; param ids 0 and 1."""
    import qstate_cli.optim as qoptim

    torch.manual_seed(0)
    model = torch.nn.Linear(80, 64)
    opt = qoptim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}], lr=1e-3,
                       states="bred-4bit")
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 80)).pow(2).sum().backward()
        opt.step()
    return model, opt.state_dict()


def save(tmp_path, obj, name="c.pt") -> str:
    path = tmp_path / name
    torch.save(obj, path)
    return str(path)


def damaged(sd: dict, edit) -> dict:
    d = copy.deepcopy(sd)
    edit(d)
    return d


def run(path: str, against: str | None = None):
    return execute(DoctorOptions(checkpoint=path, against=against))


def errors(res) -> dict:
    return {(f["param"], f["check"], f["state"]): f["message"] for f in res.extras["findings"]
            if f["severity"] == "error"}


def test_a_qstate_state_in_no_group_is_an_orphan_finding(trained, tmp_path):
    _, sd = trained
    path = save(tmp_path, damaged(sd, lambda d: d["state"].__setitem__(99, copy.deepcopy(d["state"][0]))))
    res = run(path)
    found = errors(res)
    assert set(found) == {("99", "orphan", None)}
    assert "in no param group" in found[("99", "orphan", None)] and "load_state_dict refuses" in found[
        ("99", "orphan", None)]
    row = next(r for r in res.records if r["param"] == "99")
    assert row["states"] == "m=qstate int4:bred:b128, v=qstate lin4nz:bred:b128"  # decoded: both groups agree
    r = runner.invoke(app, ["doctor", path])
    assert r.exit_code == 1 and "error optimizer orphan: 99: state of param 99" in r.output
    assert "group -1" not in r.output and "unknown configuration" not in r.output

    def differing(d):  # groups disagree on the format: the orphan's codes stay undecoded, still one finding
        d["state"][99] = copy.deepcopy(d["state"][0])
        d["param_groups"][1]["states"] = "bred-8bit"

    res = run(save(tmp_path, damaged(sd, differing), "d.pt"))
    assert set(errors(res)) == {("99", "orphan", None)} and "not decoded" in errors(res)[("99", "orphan", None)]


def test_a_qstate_group_without_states_is_a_finding(trained, tmp_path):
    _, sd = trained
    path = save(tmp_path, damaged(sd, lambda d: d["param_groups"][0].pop("states")))
    res = run(path)
    found = errors(res)
    assert set(found) == {("param_groups[0]", "hparams", "states")}
    assert "names no states configuration" in found[("param_groups[0]", "hparams", "states")]
    row = res.records[0]
    assert row["states"] == "m=qstate (format unknown), v=qstate (format unknown)" and row["shape"] == "unknown"
    assert res.records[1]["states"] == "m=fp32, v=fp32"  # the other group's parameter still read
    r = runner.invoke(app, ["doctor", path])
    assert r.exit_code == 1 and "names no states configuration" in r.output and "choose from" not in r.output


@pytest.mark.parametrize("seed", ["abc", 1.5, torch.tensor([1, 2])])
def test_a_seed_that_is_not_an_integer_is_a_finding(trained, tmp_path, seed):
    _, sd = trained
    path = save(tmp_path, damaged(sd, lambda d: d["param_groups"][0].__setitem__("seed", seed)))
    res = run(path)
    found = errors(res)
    assert set(found) == {("param_groups[0]", "hparams", "seed")}
    assert "is not an integer" in found[("param_groups[0]", "hparams", "seed")]
    assert res.records[0]["numel"] == 5120 and res.records[0]["shape"] == "5,120 elements"  # size known, not decoded
    r = runner.invoke(app, ["doctor", path])
    assert r.exit_code == 1 and "invalid literal" not in r.output and "do not decode" not in r.output


def test_fp16_codes_of_a_small_tensor_name_fp32_not_the_groups_format(trained, tmp_path):
    _, sd = trained
    path = save(tmp_path, damaged(sd, lambda d: d["state"][1]["v"].__setitem__("codes", d["state"][1]["v"]["codes"]
                                                                                 .half())))
    r = runner.invoke(app, ["doctor", path])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "v.codes are float16, not the float32 values of fp32" in r.output and "min_quant_numel 4,096" in r.output
    assert "lin4nz" not in r.output


@pytest.mark.parametrize("cut", ["half", "tail"])
def test_a_truncated_zip_says_truncated(trained, tmp_path, cut):
    _, sd = trained
    data = open(save(tmp_path, sd), "rb").read()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2] if cut == "half" else data[:-100])
    r = runner.invoke(app, ["doctor", str(tmp_path / "cut.pt")])
    assert r.exit_code == 2 and "corrupt or truncated checkpoint" in r.output and "raw pickles" not in r.output


def test_shape_from_the_models_state_dict_else_a_labelled_count(trained, tmp_path):
    model, sd = trained
    alone = run(save(tmp_path, sd, "alone.pt"))
    assert [(r["shape"], r["shape_known"]) for r in alone.records] == [("5,120 elements", False),
                                                                      ("64 elements", False)]
    both = run(save(tmp_path, {"model": model.state_dict(), "optimizer": sd}, "both.pt"))
    assert [(r["shape"], r["shape_known"]) for r in both.records] == [("64x80", True), ("64", True)]
    twin = {"model": {**model.state_dict(), "other.weight": torch.zeros(80, 64)}, "optimizer": sd}
    assert run(save(tmp_path, twin, "twin.pt")).records[0]["shape"] == "5,120 elements"  # 64x80 or 80x64


def test_against_says_when_one_file_keys_by_index_the_other_by_name(trained, tmp_path):
    model, sd = trained
    torch_opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    model(torch.randn(2, 80)).sum().backward()
    torch_opt.step()
    a, b = save(tmp_path, sd, "q.pt"), save(tmp_path, torch_opt.state_dict(), "t.pt")
    res = run(a, b)
    found = errors(res)
    assert "keyed by index here (0, 1), by name in" in found[("all", "keys", None)]
    assert ("0", "only-here", None) in found and ("weight", "only-there", None) in found
    lines = finding_lines(res.extras["findings"])  # each direction its own line and count
    assert f"error optimizer group 0 only-here: 0: has states here but none in {b}" in lines
    assert f"error optimizer group 0 only-there: weight: has states in {b} but none here [2 parameters, 5,184 " \
           f"elements in all]" in lines


def test_against_matches_states_named_differently_by_their_role(tmp_path):
    """torch AdamW and qstate's fp32 AdamW on the same gradients: exp_avg/exp_avg_sq here
    against m/v there are compared (by role), and they agree up to fp32 rounding."""
    import qstate_cli.optim as qoptim

    torch.manual_seed(0)
    a, b = torch.nn.Linear(80, 64), torch.nn.Linear(80, 64)
    b.load_state_dict(a.state_dict())
    opt_t = torch.optim.AdamW(a.parameters(), lr=1e-3)
    opt_q = qoptim.AdamW(b.parameters(), lr=1e-3, states="fp32")
    for _ in range(3):
        x = torch.randn(8, 80)
        for model, opt in ((a, opt_t), (b, opt_q)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    res = run(save(tmp_path, opt_t.state_dict(), "t.pt"), save(tmp_path, opt_q.state_dict(), "q.pt"))
    checks = {(f["check"], f["state"]) for f in res.extras["findings"] if f["severity"] == "error"}
    assert not any(c in ("only-here", "only-there") for c, _ in checks), checks
    labels = {s for c, s in checks if c == "against"}
    assert labels <= {"m (exp_avg here, m there)", "v (exp_avg_sq here, v there)"}, labels
    assert max(r["against_max_abs_diff"] for r in res.records) < 1e-6
    # a damaged m is found through the role match
    sd = opt_q.state_dict()
    sd["state"][0]["m"]["codes"] = sd["state"][0]["m"]["codes"] + 1.0
    found = errors(run(save(tmp_path, opt_t.state_dict(), "t.pt"), save(tmp_path, sd, "q2.pt")))
    assert "5,120 of 5,120 elements differ" in found[("0", "against", "m (exp_avg here, m there)")]
