"""`torchrun --nproc-per-node 2 -m qstate_cli diagnose`: the same records as one process.

Real subprocesses: torch.distributed.run (torchrun) with 2 gloo ranks on the CPU, on a
6-step demo trace; the ranks split the recorded elements (distributed.py); rank 0 writes
the JSON, rank 1 writes and prints nothing. Counts equal, floats to 1e-9 relative (sums
add in another order); many ranks, empty ranks and the configuration split run in one
process in tests/test_diagnose_split.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from diagnose_rows import ROWS, assert_rows_close
from typer.testing import CliRunner

from qstate_cli.cli import app

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = pytest.mark.distributed
# BReD and stochastic rounding (random bits keyed on global indices), a tensor scale (te-fp8:
# its absmax all-reduced every step), blocks of 128 and 256 (unit 256), a 16-bit float
CONFIGS = ["-c", "bred-4bit", "-c", "sr-4bit", "-c", "te-fp8", "-c", "bnb-8bit", "-c", "bf16"]


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "demo.pt"
    r = CliRunner().invoke(app, ["trace", "demo", "-o", str(path), "--steps", "6"])
    assert r.exit_code == 0, r.output
    return path


def run(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def test_torchrun_diagnose_equals_single_process(demo_trace, tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    r1 = run("-m", "qstate_cli", "diagnose", demo_trace, *CONFIGS, "--reset", "3", "--json", one)
    assert r1.returncode == 0, r1.stderr
    r2 = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "qstate_cli", "diagnose",
             demo_trace, *CONFIGS, "--reset", "3", "--split", "elements", "--json", two)  # auto: configs here
    assert r2.returncode == 0, r2.stderr[-3000:]
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["meta"]["ranks"] == 2 and a["meta"]["ranks"] == 1 and b["meta"]["split"] == "elements"
    assert [r["config"] for r in b["records"]] == [r["config"] for r in a["records"]]
    for key in ROWS:
        assert_rows_close(a[key], b[key], key)
    assert_rows_close(a["meta"]["gradient_checks"], b["meta"]["gradient_checks"], "gradient_checks")
    assert r2.stdout.count("qstate diagnose:") == 1  # one table, from rank 0
    assert r2.stdout.count("wrote ") <= 1


# A process group of one (no torchrun): `init` starts it, or finds the caller's. atexit runs
# last-in, first-out, so the print (registered before `init`) runs after `finish`.
GROUP_AT_EXIT = """
import atexit, gc, os, sys, weakref
import torch.distributed as dist
from qstate_cli.diagnose import distributed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")  # 0: any free port
if sys.argv[1] == "caller":
    dist.init_process_group("gloo")
    atexit.register(dist.destroy_process_group)  # the caller's own clean-up, after the print
atexit.register(lambda: print("at exit:", dist.is_initialized(), "freed:", gc.collect() >= 0 and group() is None))
print("device:", distributed.init(sys.argv[2]), "started:", dist.is_initialized())
group = weakref.ref(dist.group.WORLD)
"""


@pytest.mark.parametrize("who, left", [("qstate", "False freed: True"), ("caller", "True freed: False")])
def test_the_group_init_starts_is_destroyed_at_exit_and_a_callers_is_left(who, left):
    """qstate's group is destroyed and freed (its threads joined) before finalization."""
    r = run("-c", GROUP_AT_EXIT, who, "cpu", timeout=120)
    assert r.returncode == 0, r.stderr
    # torch 2.9's gloo prints "[Gloo] Rank 0 is connected to 0 peer ranks..." on stdout: torch's, not ours
    ours = [line for line in r.stdout.split("\n") if not line.startswith("[Gloo] ")]
    assert ours[:2] == ["device: cpu started: True", f"at exit: {left}"], r.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA and NCCL")
def test_an_nccl_group_init_starts_is_destroyed_at_exit_without_torchs_warning():
    """On CUDA `init` starts NCCL; destroyed at exit, torch has nothing to warn about."""
    r = run("-c", GROUP_AT_EXIT, "qstate", "cuda", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["device: cuda:0 started: True", "at exit: False freed: True"], r.stdout
    assert "destroy_process_group" not in r.stderr, r.stderr
