"""Honest rooflines (issue 14): a row that sits in cache gets no roofline percentage.

The rule (bench/roofline.py) on constructed rows; a real CPU sweep where every row carries
its own footprint's copy bandwidth and the rule holds row by row; the report and the CLI
line say "cache-resident" instead of a percentage, also for results written before the
field existed."""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qstate_cli.bench.roofline import CACHE_MARGIN, cache_resident, classify, footprint_copy_gbps
from qstate_cli.cli.bench_cmd import row_line
from qstate_cli.report import render_html, render_markdown
from qstate_cli.report.sections import with_roofline

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "results" / "kernels.json"

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def row(gbps, copy_gbps=25.0, bytes_moved=28_000_000, ref_copy_ms=None, **extra):
    return {"name": "torch-fused", "role": "baseline", "path": "torch-fused", "status": "ok", "numel": 1_000_000,
            "bytes_moved": bytes_moved, "gbps": gbps, "copy_gbps": copy_gbps, "ref_copy_ms": ref_copy_ms,
            "time_ms": bytes_moved / (gbps * 1e6), "time_rel_copy": None, **extra}


def test_footprint_bandwidth_is_bytes_over_the_copy_time():
    assert footprint_copy_gbps(28_000_000, 1.0) == pytest.approx(28.0)  # 28 MB in 1 ms
    assert footprint_copy_gbps(28_000_000, None) is None and footprint_copy_gbps(None, 1.0) is None
    assert footprint_copy_gbps(28_000_000, 0.0) is None  # a zero time is no measurement


def test_memory_bound_row_keeps_its_percentage():
    got = classify(row(20.0, ref_copy_ms=28e6 / 24e6))  # its bytes copy at 24 GB/s: memory speed
    assert got["cache_resident"] is False
    assert got["pct_of_copy"] == pytest.approx(80.0) and got["footprint_copy_gbps"] == pytest.approx(24.0)


def test_row_faster_than_the_memory_copy_is_cache_resident():
    got = classify(row(48.8, copy_gbps=25.0))  # the committed quick report's "194% of copy"
    assert got == {"footprint_copy_gbps": None, "cache_resident": True, "pct_of_copy": None}


def test_row_whose_bytes_copy_at_cache_speed_is_cache_resident_even_when_slow():
    slow = row(0.3, copy_gbps=25.0, ref_copy_ms=28e6 / 50e6)  # reference path; its bytes copy at 50 GB/s
    assert classify(slow)["cache_resident"] is True and classify(slow)["pct_of_copy"] is None
    edge = 25.0 * CACHE_MARGIN
    assert cache_resident(1.0, 25.0, edge) is False and cache_resident(1.0, 25.0, edge * 1.01) is True


def test_unknown_peak_says_nothing():
    got = classify(row(10.0, copy_gbps=None))
    assert got["cache_resident"] is None and got["pct_of_copy"] is None


def test_cli_line_says_cache_resident_instead_of_a_percentage():
    r = row(48.8, ref_copy_ms=0.5, time_rel_copy=1.15, cache_resident=True, pct_of_copy=None, numel=262144)
    line = row_line(r)
    assert "cache-resident (1.15x a copy of its own bytes)" in line and "% of copy" not in line
    mem = row(20.0, cache_resident=False, pct_of_copy=80.0, numel=262144)
    assert "80.0% of copy" in row_line(mem)


def _doc_with_cached_rows(old: bool) -> dict:
    """The kernels fixture with its torch-fused rows above the copy peak; `old`: written
    before `cache_resident` existed (the report classifies them itself)."""
    doc = json.loads(FIXTURE.read_text())
    for r in doc["records"]:
        if r["name"] == "torch-fused" and r["status"] == "ok":
            r["gbps"] = 3.0 * r["copy_gbps"]
            r["pct_of_copy"] = 300.0
            r["time_rel_copy"] = 0.71
            if not old:
                r.update(classify(r))
    return doc


@pytest.mark.parametrize("old", [True, False])
def test_report_marks_cache_resident_rows_and_keeps_the_others(old):
    doc = _doc_with_cached_rows(old)
    md = render_markdown([doc])
    fused = [line for line in md.splitlines() if line.startswith("| torch-fused |")]
    nearest = [line for line in md.splitlines() if line.startswith("| nearest-4bit |")]
    assert fused and all("cache-resident" in line and "300.0" not in line for line in fused)
    assert nearest and all("cache-resident" not in line for line in nearest)
    pct = with_roofline(next(r for r in doc["records"] if r["name"] == "nearest-4bit" and r["status"] == "ok"))
    assert any(f"| {pct['roofline']} |" in line for line in nearest)
    html = render_html([copy.deepcopy(doc)])
    assert "cache-resident" in html and "data:image/png;base64," in html


def test_real_cpu_sweep_carries_each_rows_own_footprint(tmp_path):
    """Measured on this CPU (no assert on speed): the rule holds on every row, and the
    JSON round-trips through a real subprocess of the CLI."""
    out = tmp_path / "k.json"
    cmd = [sys.executable, "-m", "qstate_cli", "bench", "kernels", "--device", "cpu", "-n", "4096,65536",
           "-c", "nearest-4bit", "--backend", "reference", "--baseline", "torch-fused", "--threads", "1",
           "--warmup-ms", "0", "--rep-ms", "3", "--rounds", "1", "--copy-numel", "2^22", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["records"]
    assert rows[0]["role"] == "copy" and rows[0]["pct_of_copy"] == 100.0
    timed = [r for r in rows[1:] if r["status"] == "ok"]
    assert {r["name"] for r in timed} >= {"nearest-4bit"} and len(timed) >= 2
    for r in timed:
        assert r["footprint_copy_gbps"] == pytest.approx(r["bytes_moved"] / (r["ref_copy_ms"] * 1e-3) / 1e9)
        expect = r["gbps"] > r["copy_gbps"] or r["footprint_copy_gbps"] > CACHE_MARGIN * r["copy_gbps"]
        assert r["cache_resident"] is expect, r
        if expect:
            assert r["pct_of_copy"] is None and "cache-resident" in proc.stderr
        else:
            assert r["pct_of_copy"] == pytest.approx(100 * r["gbps"] / r["copy_gbps"])
