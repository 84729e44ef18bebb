"""A suite scalar that parses but is no value (suites/load.py module docstring): a
100,000-digit integer (past Python's int conversion limit) or the date 2024-13-45 raised
ValueError while the YAML was constructed, which only YAMLError was caught for: a
traceback. Now each is the usual one line, FILE:LINE (or --set TEXT), exit 2.
"""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.suites import SuiteError, load_suite

runner = CliRunner()
BIG = "9" * 100_000


def _suite(tmp_path, text: str):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_a_huge_integer_is_one_line_at_its_line(tmp_path):
    path = _suite(tmp_path, f"name: bigint\nkind: train\ndefaults: {{steps: {BIG}}}\n")
    with pytest.raises(SuiteError) as caught:
        load_suite(path)
    assert caught.value.issues == [f"{path}:3: invalid YAML: a number of 100,000 digits (at most 4,300; a suite's "
                                   f"numbers are small)"]
    for argv in (["suite", "validate", str(path)], ["run", str(path), "--out", str(tmp_path / "out")]):
        r = runner.invoke(app, argv)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{path}:3: invalid YAML: a number of 100,000 digits" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_an_impossible_date_is_one_line_at_its_line(tmp_path):
    path = _suite(tmp_path, "name: d\nkind: train\ndefaults:\n  steps: 3\n  when: 2024-13-45\n")
    with pytest.raises(SuiteError, match=rf"^{path}:5: invalid YAML: '2024-13-45' is not a value: month must be"):
        load_suite(path)


def test_a_huge_integer_in_a_set_value_is_one_line(tmp_path):
    path = _suite(tmp_path, "name: s\nkind: train\ndefaults: {steps: 3}\n")
    with pytest.raises(QstateError, match=r"^--set 'steps=9{51}\.\.\.': the value is not valid YAML: a number of "
                                          r"5,000 digits \(at most 4,300"):
        load_suite(path, ["steps=" + "9" * 5000])
