"""`qstate bench memory` on a CPU: the step peaks measured as process RSS (bench/rss.py).

No test asserts a measured number; the bounds are derived from what the work must hold
resident: a written temporary of known size, or the state a first step allocates."""
import dataclasses
import sys

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.bench import memory, rss
from qstate_cli.bench.memory import MemoryOptions
from qstate_cli.bench.subjects import select_baselines
from qstate_cli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

N = 1 << 20  # elements: 4 MiB per fp32 tensor, far above the 4 KiB page
PEAKS = ("first_step_peak_bytes_per_param", "step_peak_bytes_per_param")
needs_rss = pytest.mark.skipif(not sys.platform.startswith("linux") or rss.unavailable() is not None,
                               reason=f"process RSS not measurable here: {rss.unavailable()}")


def rows(**kw) -> dict[str, dict]:
    opts = dict(device="cpu", numel=[N], config=["bred-4bit"], baseline=["torch-fused"], backend="reference") | kw
    return {r["name"]: r for r in memory.run(memory.plan(MemoryOptions(**opts)))}


TEMPORARY = """
import json, sys, torch
from qstate_cli.bench import rss
nbytes = 32 * 2**20
for _ in range(3):  # earlier rows' temporaries, freed: they must not hide this one
    t = torch.full((nbytes // 4,), 1.0)
    del t
peaks = [rss.peak_over(lambda: torch.full((nbytes // 4,), 2.0).sum()) for _ in range(3)]
print(json.dumps({"peaks": peaks, "idle": rss.peak_over(lambda: None)}))
"""


@needs_rss
def test_peak_sees_a_written_temporary_after_earlier_ones_were_freed():
    """In a process of its own: in this test worker's a thread left by an earlier test can free
    memory during the work and hide the temporary (the parallel suite read ~0 three times in a
    row on the 2-core Xeon on 2026-12-07, and once on CI before; 0 of 200 tries alone). Best of
    3, a lenient lower bound (file pages the kernel reclaims still hide growth); a peak that is
    not seen at all fails all three."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", TEMPORARY], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    nbytes = 32 * 2**20
    assert max(got["peaks"]) >= 0.9 * nbytes, got
    assert got["idle"] < nbytes // 4  # nothing done: far less than the temporary


def tries(measure, done, most: int = 3) -> list:
    """measure() until done(results) holds or `most` results are in. Deliberately lenient: a
    resident-size read is disturbed by what the process does meanwhile (memory released during
    the work hides growth, another thread's allocation adds to it), so each bound is asserted
    on the read that favours it (a lower bound on the largest, an upper bound on the smallest);
    a bound that no read meets fails."""
    got = []
    while len(got) < most and not (got and done(got)):
        got.append(measure())
    return got


def highest(got, name, key):
    return max(g[name][key] for g in got)


def lowest(got, name, key):
    return min(g[name][key] for g in got)


@needs_rss
def test_cpu_rows_carry_peaks_per_parameter_from_process_rss():
    # the first step writes the whole state, which stays resident: at least its bytes per param
    def state_seen(got):
        return all(highest(got, n, "first_step_peak_bytes_per_param") >= 0.9 * got[0][n]["bytes_per_param"]
                   for n in got[0])

    got = tries(rows, state_seen)
    for r in (r for g in got for r in g.values()):
        assert r["status"] == "ok", r["reason"]
        assert r["measured_by"] == "process-rss"
        assert all(r[k] is not None and r[k] >= 0 for k in PEAKS), r
        # the CUDA allocator's columns keep their meaning: null on a CPU, and the reason says so
        assert r["measured_state_bytes"] is None and r["peak_extra_mib"] is None
        assert "CUDA" in r["measured_reason"] and "RSS" in r["measured_reason"]
    assert state_seen(got), got


@needs_rss
def test_a_step_with_a_known_temporary_shows_it_per_parameter():
    extra = 64  # bytes per parameter, written inside every step

    class Fat(torch.optim.AdamW):
        def step(self, closure=None):
            n = sum(p.numel() for g in self.param_groups for p in g["params"])
            tmp = torch.full((n * extra // 4,), 1.0)
            out = super().step(closure)
            del tmp
            return out

    fused = select_baselines("adamw", ["torch-fused"])[0]
    fat = dataclasses.replace(fused, name="fat", build=lambda params, ctx: (Fat(params, lr=1e-3, fused=True), "fat"))
    plan = memory.plan(MemoryOptions(device="cpu", numel=[N], config=["none"], baseline=["torch-fused"]))
    plan.subjects = [fat, fused]
    step, first = "step_peak_bytes_per_param", "first_step_peak_bytes_per_param"

    def bounds(got):
        return [highest(got, "fat", step) >= 0.9 * extra,
                lowest(got, "fat", step) < 2 * extra,  # torch's fused AdamW itself adds little beside it
                highest(got, "fat", first) >= 0.9 * extra,
                highest(got, "fat", step) > lowest(got, "torch-fused", step) + 0.5 * extra]  # the temporary shows

    got = tries(lambda: {r["name"]: r for r in memory.run(plan)}, lambda got: all(bounds(got)))
    assert all(g["fat"]["status"] == "ok" for g in got), got[-1]["fat"]["reason"]
    assert bounds(got) == [True] * 4, got


def test_no_proc_leaves_the_peaks_null_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(rss, "STATUS", str(tmp_path / "no-such-status"))
    got = rows()
    for r in got.values():
        assert r["status"] == "ok" and r["state_bytes"] > 0  # the accounting does not need /proc
        assert all(r[k] is None for k in PEAKS) and r["measured_by"] is None
        assert r["measured_state_bytes"] is None and r["peak_extra_mib"] is None
        assert "accounting only" in r["measured_reason"] and "no-such-status" in r["measured_reason"]


def test_the_probe_says_why_it_cannot_measure(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(sys, "platform", "darwin")
        assert "Linux" in rss.unavailable()
    if not sys.platform.startswith("linux") or not __import__("os").path.exists(rss.STATUS):
        return
    monkeypatch.setattr(rss, "CLEAR_REFS", str(tmp_path))  # a folder: not writable as a file
    assert rss.unavailable().startswith("process RSS:")
    plain = tmp_path / "clear_refs"
    plain.write_text("")
    monkeypatch.setattr(rss, "CLEAR_REFS", str(plain))  # writable, but resets nothing
    assert "did not reset VmHWM" in rss.unavailable()
    frozen = tmp_path / "status"
    frozen.write_text("VmHWM:\t  1000 kB\nVmRSS:\t  1000 kB\n")
    monkeypatch.setattr(rss, "STATUS", str(frozen))  # a high-water mark that never moves
    assert "cannot be trusted" in rss.unavailable()


@needs_rss
def test_table_names_the_source_and_the_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")
    r = CliRunner().invoke(app, ["bench", "memory", "-n", "8192", "-c", "bred-4bit", "--baseline", "none",
                                 "--backend", "reference"])
    assert r.exit_code == 0, r.output
    assert "process RSS" in r.stdout and "step peak B/param" in r.stdout
    assert "measured MiB" not in r.stdout  # CUDA-only columns, null on every CPU row, are left out


@pytest.mark.cuda
def test_cuda_rows_carry_the_same_peaks_from_the_allocator():
    got = rows(device="cuda")
    for r in got.values():
        assert r["status"] == "ok" and r["measured_reason"] is None and r["measured_by"] == "cuda-allocator"
        assert r["step_peak_bytes_per_param"] == pytest.approx(r["peak_extra_mib"] * 2**20 / r["params"])
        # the first step allocates the state: its peak holds at least what it kept
        assert r["first_step_peak_bytes_per_param"] * r["params"] >= r["measured_state_bytes"] >= 0
