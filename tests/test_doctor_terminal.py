"""`qstate doctor` prints a checkpoint's parameter names to the terminal as text: a control
character in one (an ESC sequence that retitles the window or clears the screen) is shown as
its escape (cli/tables.visible) in the finding lines as in the table."""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.cli.doctor_cmd import finding_lines

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
NAME = "\x1b]0;pwned\x07\x1b[2Jlayer.weight"  # retitle the window, clear the screen


def test_finding_lines_show_control_characters_as_escapes():
    finding = {"severity": "error", "optimizer": "optimizer", "group": 0, "check": "nonfinite", "state": "exp_avg",
               "param": NAME, "message": "exp_avg: 1 non-finite values\r\x9b2J", "count": 1}
    [line] = finding_lines([finding])
    assert "\x1b" not in line and "\x07" not in line and "\r" not in line and "\x9b" not in line
    assert "\\x1b]0;pwned\\x07\\x1b[2Jlayer.weight: exp_avg: 1 non-finite values\\x0d\\x9b2J" in line


def test_doctor_prints_a_hostile_parameter_name_as_text(tmp_path):
    p = torch.nn.Parameter(torch.ones(32, 64))
    opt = torch.optim.AdamW([(NAME, p)])  # named parameters: the state dict keeps the names
    p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"][0, 0] = float("nan")  # an error finding naming the parameter
    torch.save(sd, tmp_path / "ck.pt")
    r = CliRunner().invoke(app, ["doctor", str(tmp_path / "ck.pt")])
    assert r.exit_code == 1, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output
    assert "nonfinite: \\x1b]0;pwned\\x07\\x1b[2Jlayer.weight: exp_avg" in r.output
