"""`make test-cpu-path`'s scheduling (tests/conftest.py): under `--dist loadgroup` the replay's
CPU test files, which share its numba kernels, run on one xdist worker; every other test is
its own unit of work."""
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPLAY_CPU_FILES, work_unit

ROOT = Path(__file__).resolve().parents[1]


def test_the_replay_files_are_one_unit_and_the_others_one_per_test():
    units = {work_unit(f"tests/{name}::test_x[a]") for name in REPLAY_CPU_FILES}
    assert units == {"replay-cpu"}
    assert work_unit("tests/test_kernels_cpu.py::test_a[b]") == "tests/test_kernels_cpu.py::test_a[b]"
    assert work_unit("tests/test_kernels_cpu.py::test_c") != work_unit("tests/test_kernels_cpu.py::test_d")


def test_every_grouped_file_exists_and_make_runs_it():
    """A renamed file would drop out of the group (and of `make test-cpu-path`) silently."""
    make = (ROOT / "Makefile").read_text()
    listed = re.search(r"^CPU_PATH_TESTS := ((?:.*\\\n)*.*)$", make, re.M).group(1)
    for name in REPLAY_CPU_FILES:
        assert (ROOT / "tests" / name).is_file(), name
        assert f"tests/{name}" in listed, name
    assert "--dist loadgroup" in make


def test_two_workers_run_the_replay_files_on_one_of_them():
    """A real xdist run (the tests skip or pass quickly with or without numba)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    files = ["tests/test_torch_sum_cpu.py", "tests/test_replay_rule_cpu.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist",
                          "loadgroup", *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    workers = set(re.findall(r"^\[(gw\d+)\] .*tests/test_(?:torch_sum|replay_rule)_cpu\.py::", out.stdout, re.M))
    ran = re.findall(r"^\[gw\d+\] .*(?:PASSED|SKIPPED)", out.stdout, re.M)
    assert len(ran) >= 10 and len(workers) == 1, out.stdout[-3000:]
