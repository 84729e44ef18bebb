"""scripts/cpu_compile_time.py (a diagnostic, not a timed test): its recorder counts each numba
compilation once per kernel, nested ones inside their caller's total, and each numba inlining
of a helper once per call site. No time is asserted beyond self <= total. A forceinline
helper (docs/cpu.md, "Compile time: LLVM's inlining") is compiled once as its own function and
inlined by LLVM, not by numba."""
import pytest

from script_module import load_script

pytest.importorskip("numba")


def test_recorder_counts_kernels_and_inlined_call_sites():
    from numba import njit
    from numba.core.inline_closurecall import InlineWorker

    numbas_own = InlineWorker.inline_function
    rec = load_script("cpu_compile_time").CompileRecorder()

    @njit(inline="always")
    def twice(x):
        return x + x

    @njit
    def inner(x):
        return twice(x) * 3

    @njit
    def outer(x):
        return twice(x) + twice(x + 1) + twice(x + 2) + inner(x)

    with rec.recording():
        assert outer(1) == 2 + 4 + 6 + 6
    name = f"{__name__.rsplit('.', 1)[-1]}.test_recorder_counts_kernels_and_inlined_call_sites.<locals>."
    kernels, inlined = rec.kernels, rec.inlined
    assert kernels["count"][name + "outer"] == 1 and kernels["count"][name + "inner"] == 1
    assert kernels["total"][name + "outer"] >= kernels["total"][name + "inner"]  # inner compiled inside outer
    assert kernels["self"][name + "outer"] <= kernels["total"][name + "outer"] - kernels["total"][name + "inner"] + 1e-6
    assert inlined["count"][name + "twice"] == 4  # 3 sites in outer, 1 in inner
    assert InlineWorker.inline_function is numbas_own
    report = rec.report(10)
    assert "outer" in report and "twice" in report


def test_a_forceinline_helper_compiles_once_and_llvm_inlines_it_at_every_site():
    import numpy as np
    from numba import njit

    rec = load_script("cpu_compile_time").CompileRecorder()

    @njit(forceinline=True)
    def probe_row_sum(a, n):
        s = 0.0
        for j in range(n):
            s += a[j]
        return s

    @njit
    def kernel(a):
        return probe_row_sum(a, a.size - 2) + probe_row_sum(a, a.size)  # one signature (a literal 3 would be another)

    a = np.arange(5, dtype=np.float64)
    with rec.recording():
        assert kernel(a) == 3.0 + 10.0
    name = f"{__name__.rsplit('.', 1)[-1]}.test_a_forceinline_helper_compiles_once_and_llvm_inlines_it_at_every_site.<locals>."
    assert rec.kernels["count"][name + "probe_row_sum"] == 1  # one signature: one compilation for both sites
    assert rec.inlined["count"][name + "probe_row_sum"] == 0  # numba did not copy it in
    llvm = kernel.inspect_llvm(kernel.signatures[0])
    calls = [line for line in llvm.splitlines() if "call " in line and "probe_row_sum" in line]
    assert calls == []  # LLVM did: no call to it is left in the kernel
    assert "alwaysinline" in probe_row_sum.inspect_llvm(probe_row_sum.signatures[0])  # because numba asked it to


def test_a_cache_that_is_not_a_folder_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    assert load_script("cpu_compile_time").main(["--cache", str(not_a_folder), "--", "formats"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--cache" in err
