"""The headline preset (`qstate bench headline`): the bytes model and the JSON it writes.
On CPU the kernels run in the interpreter and the host clock times them: the numbers mean
nothing, the rows, fields and summary are what is checked (timing is never asserted)."""
import json

import pytest
from typer.testing import CliRunner

from qstate_cli.bench.bytes_model import bytes_per_element
from qstate_cli.cli import app
from qstate_cli.quant import parse_spec


@pytest.mark.parametrize("p,g,spec,want", [
    (2, 2, "int4:b128", 8.125), (4, 4, "int4:b128", 14.125),  # 4-bit AdamW (BRIEF §2)
    (2, 2, "fp32", 22.0), (4, 4, "fp32", 28.0),  # torch AdamW, fp32 states
])
def test_bytes_model_matches_the_brief(p, g, spec, want):
    assert bytes_per_element(p, g, [parse_spec(spec)] * 2) == want


@pytest.mark.triton
def test_headline_writes_every_row_and_the_summary(tmp_path):
    r = CliRunner().invoke(app, ["bench", "headline", "--json", str(tmp_path / "headline.json"), "--numel", "3000",
                                 "--device", "cpu", "--dtype", "bf16", "--reps", "2", "--warmup", "1"])
    rc = r.exit_code
    doc = json.loads((tmp_path / "headline.json").read_text())
    assert doc["schema_version"] == 1 and doc["kind"] == "kernels" and doc["env"]["device"] == "cpu"
    names = [r["name"] for r in doc["records"]]
    assert names == ["copy", "nearest-4bit", "bred-4bit", "nearest-4bit-uint4v", "bred-4bit-uint4v", "qstate-step",
                     "torch-fused-adamw"]
    failed = [(r["name"], r["reason"]) for r in doc["records"] if r["status"] != "ok"]
    assert rc == (1 if failed else 0)
    assert [n for n, _ in failed] in ([], ["torch-fused-adamw"]), failed  # torch's fused CPU AdamW is optional
    rows = {r["name"]: r for r in doc["records"]}
    assert rows["bred-4bit"]["bytes_moved"] == 8.125 * 3000 and rows["bred-4bit"]["path"] == "triton-interpreter"
    assert rows["qstate-step"]["path"] == "triton-interpreter"
    for r in doc["records"]:
        if r["status"] == "ok":
            assert r["gbps"] == pytest.approx(r["bytes_moved"] / (r["time_ms"] * 1e-3) / 1e9)
            assert r["pct_of_copy"] == pytest.approx(100 * r["gbps"] / rows["copy"]["gbps"])
            assert len(r["samples_ms"]) == 2 and r["timing"] == "host-clock"
    summary = doc["headline"]["bf16"]
    b, n = rows["bred-4bit"], rows["nearest-4bit"]
    assert summary["bred_overhead_pct"] == pytest.approx(100 * (b["time_ms"] / n["time_ms"] - 1))
    assert set(summary["meets"]) == {"pct_of_copy", "bred_overhead", "speedup_vs_torch"}


@pytest.mark.triton  # an older Triton is the first thing the line names (kernels.unavailable_reason)
def test_headline_on_a_cpu_without_the_interpreter_is_a_one_line_error(tmp_path, monkeypatch):
    """Outside the tests (TRITON_INTERPRET unset) the Triton kernels cannot run on a CPU: the
    options are refused before anything is timed or written, and the line names the CPU path."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "headline.json"
    r = CliRunner().invoke(app, ["bench", "headline", "--device", "cpu", "--json", str(out)])
    assert r.exit_code == 2 and not out.exists()
    line = r.output.strip()
    assert "\n" not in line and "TRITON_INTERPRET=1" in line and "bench kernels --device cpu" in line
