"""Limits a probe found past the edge of the machine: `bench kernels --threads` bounded (and a
warning above the CPUs this process may run on), a memory estimate before a bench size is
allocated (rows "failed", not a SIGKILL), `trace info` read in chunks of steps, and the CPUs
this process may run on in a result's env (taskset)."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli import hostmem, results
from qstate_cli.bench import kernels, memory, workset
from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.options import MAX_THREADS
from qstate_cli.progress import Progress
from qstate_cli.trace import demo
from qstate_cli.trace.schema import BLOCK, Trace, TraceTensor

runner = CliRunner()
FAST = ["--warmup-ms", "0", "--rep-ms", "1", "--rounds", "1", "--copy-numel", "4096"]
GIB = 2**30

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


# -- 1. bench kernels --threads -------------------------------------------------------------

def test_threads_bound_is_bench_trains():
    from qstate_cli.train import study

    assert MAX_THREADS == study.MAX_THREADS == 1024
    assert kernels.KernelsOptions(threads=MAX_THREADS).threads == MAX_THREADS
    for value in (MAX_THREADS + 1, 10**6):
        with pytest.raises(QstateError, match=r"--threads .*: at most 1,024"):
            kernels.KernelsOptions(threads=value)
    with pytest.raises(QstateError, match="--threads 0: use 1 to 1024"):
        kernels.plan(kernels.KernelsOptions(threads=0, device="cpu"))


def test_threads_past_the_bound_is_a_one_line_usage_error():
    """--threads 1000000 segfaulted inside torch (exit 139, only the copy row kept)."""
    r = runner.invoke(app, ["bench", "kernels", "--device", "cpu", "--numel", "4096", "--threads", "1000000"])
    assert r.exit_code == 2, r.output
    assert "--threads 1000000: at most 1,024" in r.output and "Traceback" not in r.output


def test_threads_above_the_cpus_warn_once_in_the_log(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_affinity", lambda: 1)
    assert kernels.threads_warning(None) is None and kernels.threads_warning(1) is None
    lines = []
    opts = kernels.KernelsOptions(numel=[4096], config=["nearest-4bit"], baseline=["none"], device="cpu",
                                  threads=2, warmup_ms=0.0, rep_ms=1.0, rounds=1, copy_numel=4096)
    result = kernels.execute(opts, Progress(on_log=lines.append))
    assert [r["status"] for r in result.records] == ["ok", "ok"]
    warned = [line for line in lines if "--threads" in line]
    assert len(warned) == 1 and "\n" not in warned[0], lines
    assert warned[0].startswith("warning: --threads 2 is more than the 1 CPU this process may run on")


# -- 2. a memory estimate before allocating -------------------------------------------------

def test_cgroup_v2_room_takes_the_tightest_limit_less_reclaimable_cache(tmp_path):
    leaf = tmp_path / "user.slice" / "job"
    leaf.mkdir(parents=True)
    (tmp_path / "user.slice" / "memory.max").write_text(f"{4 * GIB}\n")
    (tmp_path / "user.slice" / "memory.current").write_text(f"{3 * GIB}\n")
    (leaf / "memory.max").write_text("max\n")  # no limit of its own: the parent's binds
    (leaf / "memory.current").write_text(f"{GIB}\n")
    (tmp_path / "user.slice" / "memory.stat").write_text(f"anon 1\ninactive_file {GIB}\n")
    me = tmp_path / "cgroup"
    me.write_text("0::/user.slice/job\n")
    assert hostmem.cgroup_room(str(tmp_path), str(me)) == 2 * GIB  # 4 - (3 - 1 inactive cache)
    (tmp_path / "user.slice" / "memory.max").write_text("max\n")
    assert hostmem.cgroup_room(str(tmp_path), str(me)) is None


def test_cgroup_v1_room_and_its_no_limit_value(tmp_path):
    cg = tmp_path / "memory" / "cap"
    cg.mkdir(parents=True)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(f"{14 * GIB}\n")
    (cg / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    (cg / "memory.usage_in_bytes").write_text(f"{GIB // 4}\n")
    (cg / "memory.stat").write_text("cache 5\ntotal_inactive_file 0\n")
    me = tmp_path / "cgroup"
    me.write_text("9:cpu,cpuacct:/\n4:memory:/cap\n0::/\n")
    assert hostmem.cgroup_room(str(tmp_path), str(me)) == GIB - GIB // 4
    (cg / "memory.usage_in_bytes").write_text(f"{2 * GIB}\n")  # over the limit: no room, not negative
    assert hostmem.cgroup_room(str(tmp_path), str(me)) == 0


def test_available_memory_is_the_smaller_of_meminfo_and_the_cgroup(monkeypatch, tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2097152 kB\n")
    assert hostmem.meminfo_available(str(info)) == 2 * GIB
    monkeypatch.setattr(hostmem, "meminfo_available", lambda: 2 * GIB)
    monkeypatch.setattr(hostmem, "cgroup_room", lambda: GIB)
    assert hostmem.available_memory("cpu") == GIB
    monkeypatch.setattr(hostmem, "cgroup_room", lambda: None)
    assert hostmem.available_memory("cpu") == 2 * GIB


def test_the_quick_sizes_fit_here():
    """The estimate must not refuse what runs: the CPU defaults (2^14, 2^18) and small-lm."""
    p = kernels.plan(kernels.KernelsOptions(device="cpu"))
    for target in p.targets:
        need = kernels.kernels_group_bytes(p, target, torch.float32)
        assert need < GIB and workset.memory_shortfall(p.device, need) is None
    mp = memory.plan(memory.MemoryOptions(device="cpu"))
    assert workset.memory_shortfall(mp.device, memory.target_bytes(mp, mp.targets[0], torch.float32)) is None


def test_the_estimate_counts_parameters_gradients_and_states():
    p = memory.plan(memory.MemoryOptions(model=["llama-7b"], config=["bred-4bit"], baseline=["none"], device="cpu"))
    n = p.targets[0].numel
    need = memory.target_bytes(p, p.targets[0], torch.float32)
    assert 12 * n < need < 16 * n  # fp32 parameters + 2 gradient sets, ~1 B of 4-bit states, temporaries


def test_bench_memory_refuses_a_model_that_cannot_fit_without_allocating_it(monkeypatch, tmp_path):
    """llama-7b under a 1 GiB cgroup was SIGKILLed at 6 s: no file, no message (exit 137)."""
    monkeypatch.setattr(workset, "available_memory", lambda device: GIB)
    made = []
    real = workset.Tensors
    monkeypatch.setattr(workset, "Tensors", lambda shapes, *a: made.append(shapes) or real(shapes, *a))
    out = tmp_path / "m.json"
    r = runner.invoke(app, ["bench", "memory", "--device", "cpu", "--model", "llama-7b", "--numel", "4096",
                            "-c", "bred-4bit", "--baseline", "none", "--json", str(out)])
    assert r.exit_code == 1, r.output  # a failed row
    rows = {row["model"] or row["params"]: row for row in json.loads(out.read_text())["records"]}
    assert rows[4096]["status"] == "ok"
    assert rows["llama-7b"]["status"] == "failed"
    assert rows["llama-7b"]["reason"].startswith("needs ~") and "GiB, 1 GiB available" in rows["llama-7b"]["reason"]
    assert made == [[(4096,)]]  # llama-7b's tensors were never made


def test_bench_kernels_refuses_a_size_that_cannot_fit_and_goes_on(monkeypatch, tmp_path):
    monkeypatch.setattr(workset, "available_memory", lambda device: GIB)
    out = tmp_path / "k.json"
    r = runner.invoke(app, ["bench", "kernels", "--device", "cpu", "--numel", "2^28,4096", "-c", "nearest-4bit",
                            "--baseline", "none", *FAST, "--json", str(out)])
    assert r.exit_code == 1, r.output
    rows = json.loads(out.read_text())["records"]
    assert [(x["name"], x["numel"], x["status"]) for x in rows] == [
        ("copy", 4096, "ok"), ("nearest-4bit", 2**28, "failed"), ("nearest-4bit", 4096, "ok")]
    assert re.match(r"needs ~\d[\d.]* GiB, 1 GiB available", rows[1]["reason"]), rows[1]["reason"]


def test_the_copy_row_is_estimated_too(monkeypatch):
    monkeypatch.setattr(workset, "available_memory", lambda device: 2**20)
    p = kernels.plan(kernels.KernelsOptions(device="cpu", copy_numel=2**26))
    row = kernels.measure_copy(p, results.device_info("cpu"))
    assert row["status"] == "failed" and row["reason"].startswith("needs ~0.562 GiB")  # 2 x 256 MiB + 64


# -- 3. trace info in chunks of steps -------------------------------------------------------

def odd_trace() -> Trace:
    """Two tensors, 7 steps: NaN and inf values, a dead block, a short last block."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(7, 2 * BLOCK, generator=gen).to(torch.bfloat16)
    a[:, :BLOCK] = 0  # block 0 dead
    a[2, BLOCK + 5], a[4, BLOCK + 9], a[6, -1] = math.nan, math.inf, -math.inf
    b = torch.randn(7, 1000, generator=gen).to(torch.bfloat16) * 1e3
    tensors = [TraceTensor("a", 0, (2 * BLOCK,), torch.tensor([0, 1]), a),
               TraceTensor("b", 1, (1000,), torch.tensor([0]), b)]
    hp = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    return Trace("adamw", hp, 0, 1, 7, "bf16", tensors, {"source": "tests/test_resource_limits.py"})


def test_trace_info_is_the_same_in_any_chunk_size():
    """An 800 MB trace peaked at 5.7 GB: info made several float copies of every tensor."""
    trace = odd_trace()
    whole = demo.info(trace)
    for chunk in (1, 1000, 2 * BLOCK, 3 * 2 * BLOCK + 1):
        assert demo.info(trace, chunk_elements=chunk) == whole
    summary, rows = whole
    assert summary["nonfinite_grads"] == 3 and summary["dead_blocks"].startswith("1 of 3 recorded blocks")
    for t, row in zip(trace.tensors, rows):  # the whole-tensor statistics, as before
        g = t.grads.float()
        finite = torch.isfinite(g)
        assert row["nonfinite"] == int((~finite).sum())
        assert row["grad_rms"] == pytest.approx(float(torch.where(finite, g, 0.0).pow(2).mean().sqrt()), rel=1e-6)


def test_step_chunks_are_views_of_whole_steps():
    grads = torch.zeros(10, 300)
    chunks = list(demo.step_chunks(grads, 1000))
    assert [c.shape[0] for c in chunks] == [3, 3, 3, 1]
    assert all(c.data_ptr() == grads[i * 3].data_ptr() for i, c in enumerate(chunks))
    assert [c.shape[0] for c in demo.step_chunks(grads, 1)] == [1] * 10  # at least one step each


# -- 4. the CPUs this process may run on ----------------------------------------------------

def test_env_records_the_cpus_this_process_may_run_on(monkeypatch):
    """Under taskset -c 0 a result said "2 CPUs on 2 cores" (os.cpu_count)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    env = results.device_info("cpu")
    assert env["cpu_count"] == 2 and env["cpu_affinity"] == 1
    assert results.cpus_on_cores(2, 2, 1) == "1 of 2 CPUs on 2 cores"
    assert results.cpus_on_cores(2, 2, 2) == results.cpus_on_cores(2, 2) == "2 CPUs on 2 cores"
    assert results.env_cpus({**env, "cpu_cores": 2}) == "1 of 2 CPUs on 2 cores"
    assert results.env_cpus({"cpu_count": 2, "cpu_cores": 2}) == "2 CPUs on 2 cores"  # an older file
    assert results.host_cpus().startswith("1 of 2 CPUs")


def test_cpu_affinity_without_the_call(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert results.cpu_affinity() == 3


def test_results_doc_lists_cpu_affinity():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
    assert "cpu_affinity" in doc


def test_a_trace_written_to_a_full_disk_says_so(tmp_path, monkeypatch):
    """torch's writer reports a short write on a full disk as "[enforce fail at
    inline_container.cc:672] . unexpected pos 9152 vs 9048": the error now says what it means."""
    from qstate_cli.errors import QstateError
    from qstate_cli.trace import io as trace_io
    from qstate_cli.trace import synthetic

    trace = synthetic.gaussian(256, 3, beta2=0.999, seed=1)

    def short_write(obj, fh):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9152 vs 9048")

    def full_while_the_partial_file_is_there(folder):
        # atomic_path removes the partial file, and with it the space it held, once the write failed:
        # asked after that, a disk that was full had room again (seen on a 4 MiB tmpfs)
        partial = list(tmp_path.glob(".t.pt.*.tmp"))
        return type("U", (), {"free": 4096 if partial else 1 << 30})()

    monkeypatch.setattr(trace_io.torch, "save", short_write)
    monkeypatch.setattr(trace_io.shutil, "disk_usage", full_while_the_partial_file_is_there)
    with pytest.raises(QstateError, match=r"t\.pt: cannot write \(No space left on device\)$"):
        trace_io.save_trace(trace, tmp_path / "t.pt")
    monkeypatch.setattr(trace_io.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 40})())
    with pytest.raises(QstateError, match=r"cannot write \(\[enforce fail at inline_container"):
        trace_io.save_trace(trace, tmp_path / "t.pt")  # space left: torch's own words
    assert not list(tmp_path.iterdir())
