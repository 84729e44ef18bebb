"""`qstate audit`: the sharding audit of a model's shapes, through CliRunner and a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from qstate_cli.cli import app

runner = CliRunner()


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
    small = [r for r in doc["records"] if r["fp32"]]
    assert small and all("min_quant_numel=4096" in r["reason"] for r in small)


def test_audit_table_names_the_path_of_each_state():
    res = runner.invoke(app, ["audit", "--model", "1000x100,3072", "-w", "2", "--rank", "0"],
                        env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines() if "global" in line and "local" in line)
    assert [h.strip() for h in header.strip("┃ ").split("┃")][:7] == [
        "rank", "name", "state", "global", "local", "path", "format"]
    rows = [line for line in res.output.splitlines() if "param" in line]
    assert len(rows) == 4 and all("reference" in line for line in rows)  # a sharded tensor steps the reference
