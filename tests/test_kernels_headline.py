"""The headline measurement (kernels/headline.py): the bytes model and the JSON it writes.
On CPU the kernels run in the interpreter and the host clock times them: the numbers mean
nothing, the rows, fields and summary are what is checked (timing is never asserted)."""
import json

import pytest

from qstate_cli.kernels import headline


@pytest.mark.parametrize("p,g,bits,states,block,want", [
    (2, 2, 4, 2, 128, 8.125), (4, 4, 4, 2, 128, 14.125),  # 4-bit AdamW (BRIEF §2)
    (2, 2, 32, 2, None, 22.0), (4, 4, 32, 2, None, 28.0),  # torch AdamW, fp32 states
])
def test_bytes_model_matches_the_brief(p, g, bits, states, block, want):
    assert headline.bytes_per_element(p, g, bits, states, block) == want


def test_headline_writes_every_row_and_the_summary(tmp_path):
    rc = headline.main(["--out", str(tmp_path), "--numel", "3000", "--device", "cpu", "--dtypes", "bf16",
                        "--reps", "2", "--warmup", "1"])
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
