"""StateStats' fused CPU counts (kernels/cpu/replay_stats.py) against its torch path, exactly:
the same inputs (a fused codec's packed codes and values read back, on a layout with padding,
over several steps with a reset) through both give identical collected arrays (per-step and
per-unit sums, per-code counts, staleness histogram) and identical last_change / prev_code,
for 4- and 8-bit linear formats, code books and minifloats under nearest, stochastic and BReD
rounding, and per binade for unscaled bf16 / fp16 (16-bit codes), on one thread and split
over threads. The whole replay's records through `--backend auto`
and `reference` are compared in test_replay_codec_cpu.py. Skipped without numba."""
import numpy as np
import pytest
import torch

from qstate_cli.diagnose.codec import replay_state
from qstate_cli.diagnose.layout import Layout
from qstate_cli.diagnose.step import stream_for
from qstate_cli.diagnose.stats import StateStats, unit_sums
from qstate_cli.kernels import cpu
from qstate_cli.kernels.cpu.layout import hist_copies
from qstate_cli.quant import parse_spec
from test_replay_codec_cpu import small_trace

pytestmark = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")

STEPS, RESET_AT, SNAP = 7, 4, 3  # a reset before step index 4; snapshots every 3 steps and at the end
SPECS = ["int4:nearest:b128", "uint4:stochastic:b32:sqrt", "de4:bred:b256", "lin4nz:stochastic:b64:sbf16",
         "int8:bred:b64", "de8u:nearest:b128:sqrt", "de8:stochastic:b256:sbf16", "uint8:nearest:b32",
         "e4m3:stochastic:b128", "e2m2:nearest:b64:sqrt",
         "bf16:nearest", "bf16:stochastic", "fp16:nearest", "fp16:stochastic:sqrt"]


def run_both(spec_text: str, layout: Layout):
    """(fused StateStats, torch StateStats) after the same STEPS observations."""
    spec = parse_spec(spec_text)
    q, path, why = replay_state(spec, layout, stream_for(layout, spec, 77, 1), None, "auto")
    assert path == cpu.PATH, why
    fused = StateStats(layout, spec, STEPS, SNAP, fused=True)
    plain = StateStats(layout, spec, STEPS, SNAP)
    assert fused._fused is not None and plain._fused is None
    gen = torch.Generator().manual_seed(len(spec_text))
    invalid = ~layout.valid
    prev = torch.zeros(layout.n)
    for i in range(STEPS):
        if i == RESET_AT:
            for st in (fused, plain):
                st.on_reset(i)
            q.reset()
            prev = torch.zeros(layout.n)
        # a nominal state: unchanged on ~30% of elements, nudged slightly (codes that stall)
        # on ~40%, moved a lot on the rest; on the first step and after the reset, from 0
        r = torch.rand(layout.n, generator=gen)
        noise = torch.randn(layout.n, generator=gen)
        big = torch.randn(layout.n, generator=gen) * torch.exp(2 * torch.randn(layout.n, generator=gen))
        x = torch.where(r < 0.3, prev, torch.where(r < 0.7, prev * (1 + 1e-3 * noise), big))
        if spec.sqrt:
            x = x.abs()
        x[invalid & (r < 0.5)] = 0.0
        x[torch.randint(layout.n, (6,), generator=gen)] = torch.tensor([float("nan"), float("inf"), -float("inf"),
                                                                          -0.0, 0.0, 1e-40])
        q.encode(x, 11 + i)
        new = q.decode().clone()
        new.masked_fill_(invalid, 0.0)  # padding stays 0, as the replay does
        shadow = torch.nan_to_num(x, 0.0, 0.0, 0.0) + 0.01 * torch.randn(layout.n, generator=gen)
        sx2 = unit_sums(shadow * shadow, layout.unit)
        for st in (fused, plain):
            st.observe(i, x, prev, new, shadow, sx2, q.codes)
        prev = new
    return fused, plain


def assert_same_stats(fused: StateStats, plain: StateStats, what: str) -> None:
    assert torch.equal(fused.last_change, plain.last_change), f"{what}: last_change"
    assert fused.prev_code.dtype == (torch.uint8 if fused.spec.fmt.bits <= 8 else torch.int32), what
    assert torch.equal(fused.prev_code.to(torch.int32), plain.prev_code), f"{what}: prev_code"
    a, b = fused.collect(), plain.collect()
    assert a.keys() == b.keys()
    for k, v in b.items():
        if isinstance(v, np.ndarray):
            assert a[k].dtype == v.dtype and np.array_equal(a[k], v), f"{what}: {k}"
        else:
            assert a[k] == v, f"{what}: {k}"
    # the inputs exercised every count: stalls, nominal updates, code stalls that are not value
    # stalls (or the reverse) and resets; 16-bit codes: a spread of binades
    assert b["stalls"].sum() > 0 and b["code_stalls"].sum() > 0, what
    assert (b["code_stalls"] != b["stalls"]).any(), what
    assert 0 < b["nominal"].sum() < STEPS * b["n"], what
    if b["code_mode"] == "binade":
        assert (b["codes"][:, 1:].sum(1) > 0).sum() > 10, what


@pytest.mark.parametrize("spec", SPECS)
def test_fused_state_stats_equal_the_torch_path(spec):
    assert_same_stats(*run_both(spec, Layout(small_trace(1), 256, "cpu")), spec)


def test_fused_state_stats_over_threads(monkeypatch):
    """Unit ranges on 3 threads (host.run_parts), each its own per-code histogram copies
    (8 of a 4-bit state's, 4 of the others')."""
    from qstate_cli.kernels.cpu import host
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1024)
    monkeypatch.setattr(host, "threads", lambda: 3)
    for spec in ("uint4:stochastic:b128", "de8:bred:b64", "bf16:stochastic"):
        fused, plain = run_both(spec, Layout(small_trace(1), 512, "cpu"))
        bits = parse_spec(spec).fmt.bits
        assert fused._fused.hist.shape[:2] == (3, hist_copies(bits)) == (3, 8 if bits == 4 else 4)
        assert_same_stats(fused, plain, f"{spec} on 3 threads")


def test_torch_path_without_the_fused_codec():
    """fused=False (the reference codec, no numba, CUDA) and an fp32 state (no code
    statistics) keep the torch path."""
    layout = Layout(small_trace(1), 256, "cpu")
    assert StateStats(layout, parse_spec("int4:nearest:b128"), 2, 1)._fused is None
    assert StateStats(layout, parse_spec("bf16:nearest"), 2, 1)._fused is None
    assert StateStats(layout, parse_spec("fp32"), 2, 1, fused=True)._fused is None


@pytest.mark.parametrize("unit, threads", [(32, 1), (256, 3), (2048, 1)])
def test_fused_dimension_snapshot_equals_the_torch_path(unit, threads, monkeypatch):
    """A snapshot's dimension statistic per unit (CodeCounts.dimension: fp64 pair sums, squares
    and row sums in torch's order) gives StateStats' torch ops' bits, at 0, 1, a middle and
    every level of chunk sums below the unit (log2(unit) of them: the last sum is then over
    rows of one value), on errors spread over 2**±13 and more, with zeros, -0.0 and +-inf."""
    from qstate_cli.kernels.cpu import host
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1024)
    monkeypatch.setattr(host, "threads", lambda: threads)
    layout = Layout(small_trace(1), unit, "cpu")
    spec = parse_spec("int4:nearest:b32")
    gen = torch.Generator().manual_seed(unit)
    err = torch.randn(layout.n, generator=gen) * torch.exp(3 * torch.randn(layout.n, generator=gen))
    err[::11] = 0.0
    err[3::13] = -0.0
    err[5], err[unit + 7] = float("inf"), -float("inf")
    sx2 = unit_sums(err * err, layout.unit)
    top = unit.bit_length() - 1
    for levels in sorted({0, 1, top // 2, top}):
        fused = StateStats(layout, spec, 2, 1, fused=True)
        plain = StateStats(layout, spec, 2, 1)
        for st in (fused, plain):
            st.dims = [2 ** k for k in range(levels)] + [unit, 2 * unit]  # d >= unit: dimension_ms's, not here
        assert fused._fused.dimension(err, levels) is not None, "the kernel did not run"
        for st in (fused, plain):
            st._snapshot(1, err, sx2)
        for name in ("snap_small", "snap_units"):
            a, b = getattr(fused, name)[0], getattr(plain, name)[0]
            assert a.shape == b.shape and a.dtype == b.dtype == torch.float64, (levels, name)
            assert torch.equal(a.view(torch.int64), b.view(torch.int64)), f"unit {unit}, {levels} levels: {name}"


@pytest.mark.parametrize("tensors, threads, split", [(1, 1, False), (8, 2, False), (8, 2, True)])
def test_fused_gradient_stats_equal_the_torch_path(tensors, threads, split, monkeypatch):
    """GradientStats' one-pass step (replay_stats.gradient_step) against its torch ops, bit for
    bit over 4 steps: the per-element g**2 and g**4 sums, the per-step sum of g**2 (above
    torch's grain on 2 threads: split as torch splits it) and the count of exact zeros among
    the recorded elements (padding excluded; +0.0 and -0.0 both count). split: the kernel's
    elements over two threads' ranges (host.run_parts; a layout this small is one thread's
    unless the threshold is lowered)."""
    from qstate_cli.diagnose.stats import GradientStats
    from qstate_cli.kernels.cpu import host, replay_stats

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layout = Layout(small_trace(1) if tensors == 1 else big_trace(tensors), 256, "cpu")
        assert layout.valid is not None and (tensors == 1 or layout.n > 32768)
        if split:
            monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", replay_stats.GRADIENT_BLOCK)
            assert host.parts_of(layout.n) == 2 and layout.n > 4 * replay_stats.GRADIENT_BLOCK
        fused, plain = GradientStats(layout, 4, fused=True), GradientStats(layout, 4)
        assert fused._sq is not None and plain._sq is None
        gen = torch.Generator().manual_seed(tensors)
        for i in range(4):
            g = torch.randn(layout.n, generator=gen) * torch.exp(3 * torch.randn(layout.n, generator=gen))
            g[::9] = 0.0
            g[4::9] = -0.0
            g.masked_fill_(~layout.valid, 0.0)
            for st in (fused, plain):
                st.observe(i, g)
        for name in ("g2", "g4", "series"):
            a, b = getattr(fused, name), getattr(plain, name)
            assert torch.equal(a.view(torch.int64), b.view(torch.int64)), name
        assert 0 < plain.series[1].min() < layout.n_valid
        a, b = fused.collect(), plain.collect()
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    finally:
        torch.set_num_threads(old)


def big_trace(tensors: int):
    """small_trace's tensors, repeated: a layout above torch's sum grain (32768 elements)."""
    from dataclasses import replace

    t = small_trace(1)
    return replace(t, tensors=[replace(x, index=x.index + 10 * k) for k in range(tensors) for x in t.tensors])
