"""torch's CPU sums reproduced in numba (kernels/cpu/torch_sum.py), bit for bit: row sums in
fp32 and in fp64 (of fp32 rows and of fp64 rows) at every row length the probe knows and
beyond, the streamed 8-lane sum the statistics kernels use (units of 32 .. 2048 values and
the largest it takes), the step bookkeeping add_step, on awkward values (signed zeros,
subnormals, huge, inf and NaN); the probes find torch's lanes (fp64 rows: their own); and
with no lanes found the fused statistics fall back to torch's sums and still collect what
the torch path collects. Skipped without numba."""
import numpy as np
import pytest
import torch

from qstate_cli.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")


def awkward_rows(rows: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen) * torch.exp(4 * torch.randn(rows, n, generator=gen))
    pick = torch.rand(rows, n, generator=gen)
    x = torch.where(pick < 0.05, torch.zeros(()), x)
    x = torch.where((pick > 0.05) & (pick < 0.08), torch.tensor(-0.0), x)
    x = torch.where((pick > 0.08) & (pick < 0.1), torch.tensor(1e-42), x)  # subnormal
    return x


def test_the_probe_finds_torchs_lanes():
    from qstate_cli.kernels.cpu.torch_sum import f64_row_lanes, lanes

    found = lanes()
    assert found is not None, "no lane count reproduces this torch's sums"
    w32, w64 = found
    assert w32 in (4, 8, 16) and w64 in (2, 4, 8)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert found == (8, 4)  # x86: ATen's sum runs at 256 bits, AVX-512 too
        assert f64_row_lanes() == 4  # fp64 rows: 4 lanes of 256 bits too
    else:
        assert f64_row_lanes() in (2, 4, 8)


@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 9, 31, 33, 100, 256, 777, 2048, 4096, 9000, 40000])
def test_row_sums_are_torchs_bits(n):
    from qstate_cli.kernels.cpu.torch_sum import f64_row_lanes, lanes
    from qstate_cli.kernels.cpu.torch_sum_kernel import row_sums

    w32, w64 = lanes()
    x = awkward_rows(4, n, n)
    if n > 50:
        x[1, 5], x[2, 9], x[2, 17] = float("inf"), float("nan"), 3e38  # inf; NaN; an overflow in fp32
    a = x.numpy()
    got32, got64 = np.empty(4, np.float32), np.empty(4, np.float64)
    row_sums(a, w32, got32)
    row_sums(a, w64, got64)
    assert got32.tobytes() == x.sum(1).numpy().tobytes()
    assert got64.tobytes() == x.sum(1, dtype=torch.float64).numpy().tobytes()
    x64 = x.double() * x.double()  # fp64 rows (the dimension statistic's squares), their own probe
    got = np.empty(4, np.float64)
    row_sums(x64.numpy(), f64_row_lanes(), got)
    assert got.tobytes() == x64.sum(1).numpy().tobytes()
    other = np.empty(4, np.float32)
    row_sums(a, 4 if w32 != 4 else 16, other)  # another lane count: another order, other bits somewhere
    if n >= 256:
        assert other.tobytes() != got32.tobytes()


@pytest.mark.parametrize("lanes", [1, 2, 4, 8, 16])
def test_rows_summed_across_are_row_sums_bits(lanes):
    """row_sums_across (U interleaved rows at once: the dimension statistic's sums) adds each
    row in row_sum's order, for any lane count torch may have: the same bits as row_sums,
    on rows of 1 .. 9000 values (one lane, vectors left over, a tail, the cascade's levels)
    with inf, NaN and -0.0 in them, 8 and 3 rows at once."""
    from qstate_cli.kernels.cpu.torch_sum_kernel import row_sums, row_sums_interleaved

    for n in (1, 2, 3, 4, 5, 7, 8, 15, 31, 64, 100, 128, 129, 2048, 9000):
        for rows in (8, 3):
            x = awkward_rows(rows, n, n).double()
            x = x * x * torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
            if n > 50:
                x[1, 5], x[2, 9], x[0, 11] = float("inf"), float("nan"), -0.0
            a = np.ascontiguousarray(x.numpy())
            want, got = np.empty(rows, np.float64), np.empty(rows, np.float64)
            row_sums(a, lanes, want)
            row_sums_interleaved(a, lanes, got)
            assert got.tobytes() == want.tobytes(), (lanes, n, rows)


@pytest.mark.parametrize("unit", [32, 64, 128, 256, 512, 1024, 2048, 32 * 255])
def test_the_streamed_sum_is_torchs_bits(unit):
    from qstate_cli.kernels.cpu.torch_sum_kernel import MAX_GROUPS8, GROUP8, streamed8, streams8

    assert streams8(8, unit) and not streams8(8, GROUP8 * MAX_GROUPS8) and not streams8(4, unit)
    x = awkward_rows(6, unit, unit)
    got = np.empty(6, np.float32)
    streamed8(x.numpy(), got)
    assert got.tobytes() == x.sum(1).numpy().tobytes()


def test_add_step_is_torchs_two_ops():
    from qstate_cli.kernels.cpu.torch_sum import add_step

    u = awkward_rows(6, 106, 1)
    units = awkward_rows(6, 106, 2).double()
    series = torch.zeros(6, 9, dtype=torch.float64)
    want_units, want_series = units.clone(), series.clone()
    add_step(u, units, series, 4)
    want_units += u
    want_series[:, 4] = u.sum(1, dtype=torch.float64)
    assert units.numpy().tobytes() == want_units.numpy().tobytes()
    assert series.numpy().tobytes() == want_series.numpy().tobytes()


def test_without_lanes_the_statistics_sum_in_torch(monkeypatch):
    """lanes() None (a torch whose order no candidate reproduces): the kernels write the
    errors and products, torch sums them, and the records are the torch path's still."""
    from qstate_cli.kernels.cpu import torch_sum
    from test_replay_stats_cpu import assert_same_stats, run_both
    from qstate_cli.diagnose.layout import Layout
    from test_replay_codec_cpu import small_trace

    monkeypatch.setattr(torch_sum, "lanes", lambda: None)
    monkeypatch.setattr(torch_sum, "f64_row_lanes", lambda: None)
    for spec in ("de4:bred:b256", "bf16:stochastic"):
        fused, plain = run_both(spec, Layout(small_trace(1), 256, "cpu"))
        assert fused._fused.dimension(torch.zeros(fused.layout.n), 3) is None  # the snapshots: torch's ops
        assert_same_stats(fused, plain, f"{spec}, torch's sums")


def test_unit_sums_of_large_units_are_the_torch_paths():
    """Units of 1024 and 2048 values (the cascade's second level) through the fused statistics."""
    from test_replay_stats_cpu import assert_same_stats, run_both
    from qstate_cli.diagnose.layout import Layout
    from test_replay_codec_cpu import small_trace

    for unit, spec in ((1024, "int4:bred:b1024"), (2048, "de8:stochastic:b2048")):
        assert_same_stats(*run_both(spec, Layout(small_trace(1), unit, "cpu")), f"{spec}, unit {unit}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_sum64_is_torchs_bits_at_every_split(threads):
    """A sum to one value (ModelStats' per-step sums) splits over torch's threads above the
    grain: sum64 reproduces the chunks at 1, 2 and 3 threads, at and around the grain and
    beyond, on awkward values (and NaN / inf)."""
    from qstate_cli.kernels.cpu import torch_sum

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            w = torch_sum.lanes()[1]
            assert torch_sum._split_found(threads, torch.float32, w), "the probe did not find torch's split"
            assert torch_sum._split_found(threads, torch.float64, torch_sum.f64_row_lanes())
        g = torch_sum.GRAIN
        for n in (1, 100, g - 1, g, g + 1, 2 * g + 3, 3 * g - 1, 123457, 1 << 20):
            x = awkward_rows(1, n, n).reshape(-1)
            want = x.sum(dtype=torch.float64).item()
            assert np.float64(torch_sum.sum64(x)).tobytes() == np.float64(want).tobytes(), (threads, n)
        x[5], x[777] = float("inf"), -float("inf")
        assert np.isnan(torch_sum.sum64(x)) and np.isnan(x.sum(dtype=torch.float64).item())
    finally:
        torch.set_num_threads(old)


def test_the_split_probe_rejects_another_split(monkeypatch):
    """Chunks other than torch's give other bits on the probe: sum64 then keeps torch's sum."""
    from qstate_cli.kernels.cpu import torch_sum

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(torch_sum, "split_parts", lambda n: 1)
        torch_sum._split_found.cache_clear()
        assert not torch_sum._split_found(2, torch.float32, torch_sum.lanes()[1])
        x = awkward_rows(1, 1 << 18, 9).reshape(-1)
        assert torch_sum.sum64(x) == x.sum(dtype=torch.float64).item()
    finally:
        torch_sum._split_found.cache_clear()
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [2, 3])
def test_sum64_inside_torch_aside_keeps_the_order_of_torchs_threads(threads):
    """host.torch_aside(n) runs torch on one thread while the kernels keep n: sum64 there gives
    torch's bits at n threads (the split probed before, torch_sum.split_found), which differ
    from its bits at one thread on these values; torch has its n threads back afterwards."""
    from qstate_cli.kernels.cpu import host, torch_sum

    x = awkward_rows(1, 1 << 18, 9).reshape(-1)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = np.float64(x.sum(dtype=torch.float64).item()).tobytes()
        torch.set_num_threads(threads)
        want = np.float64(x.sum(dtype=torch.float64).item()).tobytes()
        assert want != one  # so the check below can fail
        assert torch_sum.split_found()
        with host.torch_aside(threads):
            assert (torch.get_num_threads(), host.threads(), host.parts_of(x.numel())) == (1, threads, threads)
            assert np.float64(torch_sum.sum64(x)).tobytes() == want
        assert torch.get_num_threads() == threads and host.threads() == threads
    finally:
        torch.set_num_threads(old)
