"""The replay's fused CPU codec (kernels/cpu/replay.py) against the reference QuantizedState,
bit for bit: codes, scales and the values read back, on a layout of several partly recorded
tensors with padding, over every covered format, rounding, 4/8 bits, block sizes, sqrt and
bf16 scales, at several steps (the stream keys change per step); the replay's records are
the same through either codec; states it does not cover fall back with the reason in meta.

Skipped where numba is not installed, except the fallback test. One kernel serves every
layout (compiled once per machine, then cached on disk)."""
import pytest
import torch

from qstate_cli.diagnose import diagnose
from qstate_cli.diagnose.codec import replay_state
from qstate_cli.diagnose.layout import Layout
from qstate_cli.diagnose.step import stream_for
from qstate_cli.kernels import cpu
from qstate_cli.quant import QuantizedState, parse_config, parse_spec
from qstate_cli.trace.schema import Trace, TraceTensor

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")

# (shape, recorded 2048-element blocks): partial recording, short last blocks, a tiny tensor
TENSORS = [((5000,), [0, 2]), ((40, 70), [1]), ((33,), [0]), ((3000,), [0])]


def small_trace(steps: int = 6, seed: int = 5, optimizer: str = "adamw") -> Trace:
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for i, (shape, blocks) in enumerate(TENSORS):
        t = TraceTensor(f"w{i}", i + 3, shape, torch.tensor(blocks), torch.zeros(0))
        n = t.element_index().numel()
        scale = torch.exp(2 * torch.randn(n, generator=gen))  # a spread of magnitudes
        t.grads = torch.randn(steps, n, generator=gen) * scale
        tensors.append(t)
    hp = {"betas": [0.9, 0.999], "eps": 1e-8, "lr": 1e-3, "weight_decay": 0.0}
    return Trace(optimizer, hp, 77, 1, steps, "fp32", tensors)


def values(layout: Layout, gen: torch.Generator) -> torch.Tensor:
    """A state to store: a spread of magnitudes and signs, non-finite values, an all-zero
    block and a block of subnormals; padding not zero (the codec must not care)."""
    x = torch.randn(layout.n, generator=gen) * torch.exp(3 * torch.randn(layout.n, generator=gen))
    x[5], x[77], x[300] = float("nan"), float("inf"), -float("inf")
    x[2048:2080] = 0.0
    x[2080:2112] = 1e-41
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1)
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_same(fused: QuantizedState, ref: QuantizedState, what: str) -> None:
    assert fused.written == ref.written, what
    assert fused.codes.dtype == ref.codes.dtype and torch.equal(fused.codes, ref.codes), f"{what}: codes"
    if ref.scales is None:  # an unscaled state
        assert fused.scales is None, f"{what}: scales"
    else:
        assert fused.scales.dtype == ref.scales.dtype and torch.equal(bits(fused.scales), bits(ref.scales)), \
            f"{what}: scales"
    got, want = fused.decode(), ref.decode()
    bad = torch.nonzero(bits(got) != bits(want)).flatten()
    assert bad.numel() == 0, f"{what}: values read back differ first at {bad[:5].tolist()}"
    again = fused.decode()  # later reads: the reference decode of the stored codes
    assert torch.equal(bits(again), bits(want)), f"{what}: second read"


def assert_finished_as_the_replay(fused, ref, x: torch.Tensor, step: int, layout: Layout, what: str) -> None:
    """encode(..., clamp_zero, zero_padding): the value read back as the replay keeps it,
    equal to the reference's decode, then torch's clamp(min=0) (-0.0 and NaN kept) and the
    padding's index_fill_ (step.store's torch path); the codes and scales as without."""
    padding = (~layout.valid).nonzero().squeeze(1)
    assert padding.numel() > 0  # the layout has padding to zero
    for clamp, pad in ((True, False), (False, True), (True, True)):
        fused.encode(x, step, clamp_zero=clamp, zero_padding=pad)
        want = ref.decode()
        want = want.clamp(min=0.0) if clamp else want.clone()
        if pad:
            want.index_fill_(0, padding, 0.0)
        got = fused.decode()
        bad = torch.nonzero(bits(got) != bits(want)).flatten()
        assert bad.numel() == 0, f"{what} clamp {clamp} padding {pad}: differ first at {bad[:5].tolist()}"
    assert_same(fused, ref, f"{what}, codes after the finished encodes")


@needs_numba
def test_finish_read_back_is_torchs_clamp_then_the_padding_fill():
    """The kernels' last loop on crafted values: -0.0 and NaN kept by the clamp, a negative
    (subnormal, -inf) value made +0, positions from the recorded count on made +0."""
    import numpy as np

    from qstate_cli.kernels.cpu.replay_kernel import finish_read_back
    row = torch.tensor([-0.0, 0.0, float("nan"), -1.0, 1.0, -float("inf"), -1e-45, 1e-45, -2.0, float("nan")])
    for clamp in (False, True):
        for nv in (10, 6, 0):
            out = np.full(row.numel() + 3, 7.0, np.float32)
            finish_read_back(row.numpy(), row.numel(), nv, clamp, True, out, np.uint64(2))
            want = row.clamp(min=0.0) if clamp else row.clone()
            want[nv:] = 0.0
            assert torch.equal(bits(torch.from_numpy(out[2:12])), bits(want)), (clamp, nv)
            assert out[0] == out[1] == out[12] == 7.0  # nothing outside [i0, i0 + cnt)


def check_spec(spec_text: str, layout: Layout, steps=(1, 2, 9)) -> None:
    spec = parse_spec(spec_text)
    stream = stream_for(layout, spec, 77, 1)
    fused, path, why = replay_state(spec, layout, stream, None, "auto")
    assert why is None and path == cpu.PATH, why
    ref = QuantizedState(spec, (layout.n,), stream, device="cpu")
    gen = torch.Generator().manual_seed(len(spec_text))
    for step in steps:
        x = values(layout, gen)
        fused.encode(x, step)
        ref.encode(x, step)
        assert_same(fused, ref, f"{spec_text} step {step}")
        assert_finished_as_the_replay(fused, ref, x, step, layout, f"{spec_text} step {step}")
    fused.reset()
    ref.reset()
    assert torch.equal(fused.decode(), ref.decode())


FORMATS_4 = ["int4", "uint4", "de4", "de4u", "lin4nz", "de4unz"]
FORMATS_8 = ["int8", "uint8", "de8", "de8u", "lin8nz", "de8nz"]
CASES = []
for _i, _f in enumerate(FORMATS_4 + FORMATS_8):
    for _j, _r in enumerate(("nearest", "stochastic", "bred")):
        _b = (32, 128, 256)[(_i + _j) % 3]
        _extra = [":sqrt" if not _f.startswith("int") and _f != "de4" and _f != "de8" else "", ":sbf16"][(_i + _j) % 2]
        CASES.append(f"{_f}:{_r}:b{_b}{_extra}")
for _i, _f in enumerate(["e4m3", "e5m2", "e2m1", "e2m2"]):  # minifloats: the CPU codec only
    for _j, _r in enumerate(("nearest", "stochastic", "bred")):
        _b = (32, 128, 256)[(_i + _j) % 3]
        _extra = [":sqrt" if _f == "e2m2" else "", ":sbf16"][(_i + _j) % 2]
        CASES.append(f"{_f}:{_r}:b{_b}{_extra}")
CASES += ["bf16:nearest", "bf16:stochastic", "bf16:stochastic:sqrt", "fp16:nearest:sqrt", "fp16:stochastic"]  # unscaled


@needs_numba
@pytest.mark.parametrize("spec", CASES)
def test_fused_codec_equals_the_reference_bit_for_bit(spec):
    check_spec(spec, Layout(small_trace(1), 256, "cpu"))


@needs_numba
@pytest.mark.parametrize("fmt", ["de8", "de8u", "de8nz", "de4", "de4unz"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_code_book_search_at_every_entry_and_its_neighbours(fmt, rounding):
    """Blocks whose absmax is 1 (n = x exactly): every table entry, the fp32 values next to
    it on both sides and the midpoints between entries, so the bucketed floor-code search
    (replay.search_buckets) is checked at every place it can go wrong."""
    from qstate_cli.quant.codebooks import codebook_tensor
    table = codebook_tensor(fmt, "cpu")
    up, down = torch.nextafter(table, torch.tensor(2.0)), torch.nextafter(table, torch.tensor(-2.0))
    cands = torch.cat([table, up, down, (table[1:] + table[:-1]) / 2, -table, -up, torch.tensor([0.0, -0.0, 1e-38])])
    layout = Layout(small_trace(1), 256, "cpu")
    spec = parse_spec(f"{fmt}:{rounding}:b32")
    x = cands.repeat(-(-layout.n // cands.numel()))[:layout.n].clone()
    x[::32] = 1.0
    stream = stream_for(layout, spec, 77, 0)
    fused, _, why = replay_state(spec, layout, stream, None, "auto")
    assert why is None
    ref = QuantizedState(spec, (layout.n,), stream, device="cpu")
    fused.encode(x, 4)
    ref.encode(x, 4)
    assert_same(fused, ref, f"{spec} at the code book's entries")


@needs_numba
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "e2m2"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "bred"])
def test_minifloat_at_every_ordinal_midpoint_and_neighbour(fmt, rounding):
    """Blocks of 64 whose normalised values sit on every magnitude ordinal, the midpoints
    between them (ties: half to even), one ulp either side, the subnormal grid, -0.0, and
    blocks whose scale makes n exact or not (test_kernels_cpu_minifloat.crafted)."""
    from test_kernels_cpu_minifloat import crafted
    layout = Layout(small_trace(1), 256, "cpu")
    spec = parse_spec(f"{fmt}:{rounding}:b64")
    x = crafted(spec.fmt)
    x = x.repeat(-(-layout.n // x.numel()))[:layout.n].clone()
    stream = stream_for(layout, spec, 77, 0)
    fused, _, why = replay_state(spec, layout, stream, None, "auto")
    assert why is None
    ref = QuantizedState(spec, (layout.n,), stream, device="cpu")
    for step in (4, 5):
        fused.encode(x, step)
        ref.encode(x, step)
        assert_same(fused, ref, f"{spec} at the ordinals, step {step}")


def every_16bit_ordinal(dtype) -> torch.Tensor:
    """fp32 values at every finite magnitude of a 16-bit float (bf16 / fp16), the midpoints
    between neighbours (ties), one fp32 ulp either side of each, both signs, values past the
    largest (clamped), fp32 subnormals and -0.0."""
    top = 0x7F7F if dtype == torch.bfloat16 else 0x7BFF
    v = torch.arange(0, top + 1, dtype=torch.int32).to(torch.int16).view(dtype).float()
    mid = ((v[1:].double() + v[:-1].double()) / 2).float()  # exact in fp32
    big, tiny = torch.tensor(3.0e38), torch.tensor(1e-44)
    fmax = torch.tensor(torch.finfo(torch.float32).max)  # bf16: rounds past the largest ordinal, clamped
    extra = torch.stack([big, fmax, torch.nextafter(v[-1], big), tiny, torch.tensor(-0.0), torch.tensor(1e-41)])
    pos = torch.cat([v, mid, torch.nextafter(mid, big), torch.nextafter(mid, torch.tensor(0.0)), extra])
    return torch.cat([pos, -pos])


@needs_numba
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_16bit_float_at_every_ordinal_midpoint_and_neighbour(fmt, rounding):
    """An unscaled bf16 / fp16 state (replay_codec16; bf16 by its bits: round_bf16) over
    every_16bit_ordinal, a layout's worth per step: codes and values read back equal the
    reference's."""
    layout = Layout(small_trace(1), 256, "cpu")
    spec = parse_spec(f"{fmt}:{rounding}")
    cands = every_16bit_ordinal(torch.bfloat16 if fmt == "bf16" else torch.float16)
    cands = cands[torch.randperm(cands.numel(), generator=torch.Generator().manual_seed(3))]
    stream = stream_for(layout, spec, 77, 0)
    fused, _, why = replay_state(spec, layout, stream, None, "auto")
    assert why is None
    ref = QuantizedState(spec, (layout.n,), stream, device="cpu")
    for step, at in enumerate(range(0, cands.numel(), layout.n), start=1):
        x = cands[at: at + layout.n]
        x = torch.cat([x, torch.ones(layout.n - x.numel())]) if x.numel() < layout.n else x
        fused.encode(x, step)
        ref.encode(x, step)
        assert_same(fused, ref, f"{spec} at the ordinals, step {step}")


@needs_numba
def test_fused_codec_on_a_part_of_the_layout_and_over_threads(monkeypatch):
    """torchrun's element split (a part of the layout: its own positions, the whole
    tensors' counters) and a layout split over threads (host.run_blocks)."""
    from qstate_cli.kernels.cpu import host
    for spec in ("int4:stochastic:b128", "lin4nz:bred:b128", "de8:stochastic:b256:sbf16", "e2m1:stochastic:b64"):
        check_spec(spec, Layout(small_trace(1), 256, "cpu", part=(1, 3)), steps=(3, 4))
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1024)
    monkeypatch.setattr(host, "threads", lambda: 3)
    check_spec("uint4:stochastic:b32:sqrt", Layout(small_trace(1), 256, "cpu"), steps=(1, 2))
    for spec in ("bf16:stochastic", "fp16:nearest"):  # unscaled: in runs of the layout's (smaller) unit
        check_spec(spec, Layout(small_trace(1), 64, "cpu"), steps=(1, 2))


@needs_numba
def test_a_block_at_an_odd_element_falls_back_under_stochastic_rounding(monkeypatch):
    """The kernel hashes stochastic rounding's pairs of elements from a block's first index,
    which must be even (recorded blocks are 2048-aligned, so it always is); a layout whose
    block starts at an odd index would get the reference, with the reason."""
    from qstate_cli.kernels.cpu import replay as cpu_replay
    layout = Layout(small_trace(1), 256, "cpu")
    plan = cpu_replay._plan(layout, 32)
    assert not (plan[:, 1] & 1).any()
    odd = plan.copy()
    odd[3, 1] += 1
    monkeypatch.setattr(cpu_replay, "_plan", lambda layout, B: odd)
    for rounding, fused in (("stochastic", False), ("nearest", True), ("bred", True)):
        spec = parse_spec(f"int4:{rounding}:b32")
        state, why = cpu_replay.fused_state(spec, layout, stream_for(layout, spec, 77, 1))
        assert (state is not None) == fused, why
        assert fused or "odd element index" in why


def comparable(doc: dict) -> dict:
    """The document less what may differ: timings, the codec paths, the creation time and the
    checkout's commit (a commit made while the suite runs changes it between the two replays)."""
    meta = {k: v for k, v in doc["meta"].items() if k not in ("profile", "codec")}
    env = {k: v for k, v in doc["env"].items() if k not in ("created", "git_sha")}
    return {**doc, "meta": meta, "env": env}


CONFIGS = ["sr-4bit", "bred-4bit", "bnb-8bit", "torchao-4bit", "m=int8:nearest:b64,v=de8u:bred:b32:sbf16", "fp8-sr",
           "m=e2m1:bred:b64,v=e2m2:nearest:b32:sqrt:sbf16", "bf16-sr", "m=bf16:bred,v=bf16:nearest:sqrt"]


@needs_numba
@pytest.mark.parametrize("reset", ["none", "3"])
def test_replay_records_are_the_same_through_either_codec(reset):
    trace = small_trace(8)
    cfgs = [parse_config(c) for c in CONFIGS]
    auto, raw_auto = diagnose(trace, cfgs, reset=reset, backend="auto", keep_states=True)
    ref, raw_ref = diagnose(trace, cfgs, reset=reset, backend="reference", keep_states=True)
    assert comparable(auto) == comparable(ref)
    for name, states in raw_ref.final_states.items():
        for s, pieces in states.items():
            for a, b in zip(raw_auto.final_states[name][s], pieces):
                assert torch.equal(bits(a), bits(b)), f"{name} {s}"
    codec = auto["meta"]["codec"]
    assert codec[str(cfgs[0])]["m"] == [cpu.PATH, None] and codec[str(cfgs[2])]["v"] == [cpu.PATH, None]
    assert codec["fp8-sr"] == {"m": [cpu.PATH, None], "v": [cpu.PATH, None]}  # 8-bit minifloats: fused
    assert codec["bf16-sr"] == {"m": [cpu.PATH, None], "v": [cpu.PATH, None]}  # unscaled 16-bit: fused
    assert codec[str(cfgs[-1])]["m"][0] == "reference" and "BReD" in codec[str(cfgs[-1])]["m"][1]
    assert codec[str(cfgs[-1])]["v"] == [cpu.PATH, None]
    assert all(v == ["reference", "--backend reference"] for c in ref["meta"]["codec"].values() for v in c.values())


def test_uncovered_states_fall_back_with_the_reason_in_meta():
    """A tensor-scaled fp8 v (Transformer Engine's recipe) and an FlashOptim m: the
    reference runs them, and meta.codec says why (numba missing: that reason instead)."""
    trace = small_trace(3)
    cfgs = [parse_config("m=int8:nearest:b64:softsign,v=e4m3:tensor")]
    doc, _ = diagnose(trace, cfgs, backend="auto")
    m, v = doc["meta"]["codec"][str(cfgs[0])]["m"], doc["meta"]["codec"][str(cfgs[0])]["v"]
    assert m[0] == "reference" and v[0] == "reference"
    assert "FlashOptim" in m[1] and "e4m3" in v[1]  # with or without numba: the spec is why


def test_numba_missing_is_the_reason_only_for_states_it_would_cover(monkeypatch):
    """Without numba (simulated): a covered state falls back saying numba is missing, a
    state no fused codec covers (te-fp8: a tensor scale) says why it is not covered, and numba
    is not needed."""
    missing = "numba is not importable (ModuleNotFoundError: simulated); pip install 'qstate-cli[cpu]'"
    monkeypatch.setattr(cpu, "_import_error", [missing])
    cfgs = [parse_config("sr-4bit"), parse_config("bf16"), parse_config("te-fp8")]
    doc, _ = diagnose(small_trace(3), cfgs, backend="auto")
    codec = doc["meta"]["codec"]
    assert codec["sr-4bit"] == {"m": ["reference", missing], "v": ["reference", missing]}
    assert codec["bf16"] == {"m": ["reference", missing], "v": ["reference", missing]}
    assert all(why[0] == "reference" and "e4m3" in why[1] and "numba" not in why[1] for why in codec["te-fp8"].values())


def test_backend_reference_also_runs_the_reset_check_replays(monkeypatch):
    """`--backend reference` reaches every replay: validate.py's reset-check replays
    (one forced candidate period on this short trace) store their states through the
    codec backend the diagnose was asked for, not the default auto."""
    from qstate_cli.diagnose import codec, replay as replay_mod, run, validate as validate_mod
    asked = []

    def spy(spec, layout, stream, reduce_absmax, backend="auto"):
        asked.append(backend)
        return codec.replay_state(spec, layout, stream, reduce_absmax, backend)

    monkeypatch.setattr(replay_mod, "replay_state", spy)
    monkeypatch.setattr(validate_mod, "candidates", lambda spec, beta, period: [2])
    result, _ = run.replay_result(small_trace(8), [parse_config("sr-4bit")], check_resets=True, backend="reference")
    assert "every 2:" in result.records[0]["reset_reason"]  # the check did replay a reset every 2 steps
    assert len(asked) > 2 and set(asked) == {"reference"}, asked
