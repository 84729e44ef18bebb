"""scripts/as_avx2.py runs a command built and dispatched for AVX2: the features it turns off,
and (with numba) a real child process whose torch dispatches AVX2 and whose numba compiles
no 512-bit instruction."""
import os
import subprocess
import sys

import pytest

from script_module import SCRIPTS, load_script

as_avx2 = load_script("as_avx2")


def test_only_the_hosts_haswell_features_stay_on():
    host = {"avx2": True, "fma": True, "bmi2": True, "avx512f": True, "avx512vl": True, "avx512fp16": True,
            "amx-tile": True, "avx10.1-512": True, "evex512": True, "avxvnni": True, "gfni": True,
            "sse4.2": True, "xop": False}
    env = as_avx2.avx2_env(host)
    flags = env["NUMBA_CPU_FEATURES"].split(",")
    assert sorted(f for f in flags if f.startswith("+")) == ["+avx2", "+bmi2", "+fma", "+sse4.2"]
    assert len(flags) == len(host) and "-xop" in flags and "-avx512fp16" in flags and "-gfni" in flags
    later = {"vaes": True, "sha": True, "adx": True, "sse4a": True, "egpr": True, "movdiri": True, "avx": True}
    assert as_avx2.avx2_env(later)["NUMBA_CPU_FEATURES"] == "-adx,+avx,-egpr,-movdiri,-sha,-sse4a,-vaes"
    assert env["NUMBA_CPU_NAME"] == "haswell" and env["ATEN_CPU_CAPABILITY"] == "avx2"


def test_without_a_command_it_prints_its_use_and_exits_2():
    run = subprocess.run([sys.executable, str(SCRIPTS / "as_avx2.py")], capture_output=True, text=True)
    assert run.returncode == 2 and "NUMBA_CPU_NAME=haswell" in run.stdout


def test_a_command_that_cannot_run_is_one_line_and_exit_2():
    pytest.importorskip("llvmlite")
    run = subprocess.run([sys.executable, str(SCRIPTS / "as_avx2.py"), "no-such-command-qstate"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == "as_avx2: cannot run 'no-such-command-qstate': No such file or directory\n"


PROBE = """
import numba, numpy as np, torch
import qstate_cli.kernels.cpu.codec  # the CPU path's own target (512-bit on an AVX-512 host unless told)
@numba.njit
def axpy(a, x, y):
    for i in range(x.size):
        y[i] += a * x[i]
x = np.ones(4096, np.float32)
axpy(np.float32(2), x, x.copy())
asm = next(iter(axpy.inspect_asm().values()))
print(torch.backends.cpu.get_cpu_capability(), numba.config.CPU_NAME, "zmm" in asm, "ymm" in asm)
"""


def test_the_child_dispatches_and_compiles_for_avx2():
    pytest.importorskip("numba")
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2" not in cpuinfo:
        pytest.skip("no AVX2 on this host (or no /proc/cpuinfo to say)")
    run = subprocess.run([sys.executable, str(SCRIPTS / "as_avx2.py"), sys.executable, "-c", PROBE],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["AVX2", "haswell", "False", "True"]
    if " avx512f" in cpuinfo:  # and without it, this host's own width: the probe can tell
        env = {k: v for k, v in os.environ.items() if k not in as_avx2.avx2_env({})}
        own = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
        assert own.returncode == 0, own.stderr[-2000:]
        assert own.stdout.split()[:3] == ["AVX512", "None", "True"]
