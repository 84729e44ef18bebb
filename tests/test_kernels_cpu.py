"""The CPU path (kernels/cpu, numba) against the reference, bit for bit, on the Triton
kernels' parity grid (tests/test_kernels_adamw.py: every format, rounding, block size and
scale dtype; weird shapes; NaN/Inf gradients at step 2), and its fallbacks.

Skipped where numba is not installed (`pip install 'qstate-cli[cpu]'`), except the tests of
the fallback itself and of host.run_parts' split (plain Python). The first run compiles the kernels (minutes on a loaded 2-core
machine); numba caches them on disk for every later run."""
import pytest
import torch

from kernel_parity import make_pair, run_parity, step_both
from qstate_cli.errors import QstateError
from qstate_cli.kernels import cpu
from qstate_cli.optim import Adam, AdamW, Lion
from test_kernels_adamw import CASES, WEIRD

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")
MINIFLOAT_CASES = [  # the block-scaled minifloats only the CPU path takes (the codec alone: test_kernels_cpu_minifloat.py)
    ("fp8", torch.float32),
    ("fp4-sr", torch.bfloat16),
    ("m=e5m2:bred:b64,v=e2m2:bred:b64:sqrt", torch.float32),
    ("m=e2m1:bred:b96:sbf16,v=e4m3:nearest:b96:sqrt", torch.bfloat16),
    ("m=e4m3:sr:b2048,v=e5m2:nearest:b2048:sbf16", torch.float32),
]
CPU_CASES = [(s, d) for s, d in CASES if d in (torch.float32, torch.bfloat16)] + MINIFLOAT_CASES  # fp16: reference


@needs_numba
@pytest.mark.parametrize("states,dtype", CPU_CASES, ids=[f"{s}-{str(d)[6:]}" for s, d in CPU_CASES])
def test_cpu_adamw_equals_reference(states, dtype):
    _, ker = run_parity(AdamW, states, WEIRD, dtype, backend="cpu", device="cpu", lr=1e-2, weight_decay=0.1)
    assert {ker.path_for(p) for p in ker.param_groups[0]["params"]} == {cpu.PATH}


@needs_numba
@pytest.mark.parametrize("states", ["nearest-4bit", "sr-4bit", "bred-4bit"])
def test_cpu_adamw_presets_equal_reference_with_resets_on_threads(states):
    """A tensor big enough to be split over threads (host.MIN_THREAD_ELEMENTS), a reset at
    step 3: state, counters and parameters equal at every step. Two threads, whatever
    OMP_NUM_THREADS says (the split is asserted, not assumed)."""
    from qstate_cli.kernels.cpu import host
    from qstate_cli.runtime import torch_threads
    with torch_threads(2):
        assert host.parts_of(300 * 700) == 2
        run_parity(AdamW, states, [(300, 700), (4097,)], torch.float32, steps=4, backend="cpu", device="cpu",
                   reset=3, lr=1e-2)


@needs_numba
@pytest.mark.parametrize("states,pairs", [("m=int8:nearest:b32,v=lin4nz:sr:b32", (False, True)),
                                          ("m=int4:sr:b32:sbf16,v=uint4:sr:b32:sqrt", (True, True))],
                         ids=["one-state-sr", "sqrt-sbf16"])
def test_cpu_adamw_pair_encoder_of_one_state_and_of_sqrt_with_bf16_scales(states, pairs):
    """The pair encoder's cases the grid above does not hold: one state by pairs under
    stochastic rounding (its own pair counter: pairs.encode_pack4), and linear 4-bit states
    with a :sqrt v and bf16 block scales; that the pair encoder is the one that runs is
    asserted too (pairs.by_pairs)."""
    from qstate_cli.kernels.cpu import host
    from qstate_cli.kernels.cpu import pairs as pair_codec
    from qstate_cli.kernels.launch import kernel_layout
    from qstate_cli.quant import parse_config
    cfg = parse_config(states)
    lays = [host.layout_arrays(kernel_layout(spec), None)[0] for spec in (cfg.m, cfg.v)]
    assert tuple(pair_codec.by_pairs(lay) for lay in lays) == pairs
    run_parity(AdamW, states, WEIRD, torch.bfloat16, steps=3, backend="cpu", device="cpu", lr=1e-2, weight_decay=0.1)


@needs_numba
def test_cpu_adam_with_l2_weight_decay_equals_reference():
    run_parity(Adam, "bred-8bit", [(37, 29), (300,)], torch.bfloat16, backend="cpu", device="cpu",
               lr=1e-2, weight_decay=0.05)


@needs_numba
def test_cpu_nonfinite_gradients_are_zeroed_and_counted():
    ref, ker = run_parity(AdamW, "bred-4bit", [(37, 29), (300,)], steps=2, poison_step=1, backend="cpu",
                          device="cpu")
    assert ker.nonfinite_count() == ref.nonfinite_count() == 6


@needs_numba
@pytest.mark.parametrize("cls,states", [(AdamW, "nearest-4bit"), (AdamW, "bf16"), (Lion, "bred-4bit")],
                         ids=["AdamW-nearest-4bit", "AdamW-bf16", "Lion/bred-4bit"])  # make test-cpu-path: the first
def test_cpu_bf16_nan_parameters_equal_reference(cls, states):
    """A bf16 parameter holding NaN and +-inf (a diverged run), where the step makes NaNs of
    its own (lr x weight decay = 1: inf x 0, x86's negative NaN), and an inf gradient (zeroed,
    counted): the kernels store torch's NaN bits (kernels/cpu.bf16_nan: 0xFFFF from torch's
    vectorized cast on x86, where they stored 0x7FC0 before), the reference's parameters and
    states bit for bit."""
    from qstate_cli.kernels.cpu import bf16_nan
    if bf16_nan() is None:
        pytest.skip("this torch casts NaNs to more than one bf16 pattern (the next test's case)")
    runs = []
    for backend in ("reference", "cpu"):
        p0 = torch.full((300,), 0.5)
        p0[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
        p = torch.nn.Parameter(p0.to(torch.bfloat16))
        opt = cls([p], lr=0.5, weight_decay=2.0, states=states, min_quant_numel=0, backend=backend)
        for step in range(3):
            g = torch.linspace(-1, 1, 300)
            if step == 1:
                g[10] = float("inf")
            p.grad = g.to(torch.bfloat16)
            opt.step()
        runs.append((p.detach().view(torch.int16).clone(), opt))
    (a, ref), (b, ker) = runs
    assert ker.path_for(ker.param_groups[0]["params"][0]) == cpu.PATH
    assert (a[:3] == torch.tensor(bf16_nan(), dtype=torch.int32).to(torch.int16)).all()  # NaN: given and made
    assert torch.equal(a, b)
    for name in ref.state_names:
        assert torch.equal(ref.decoded_state(ref.param_groups[0]["params"][0])[name],
                           ker.decoded_state(ker.param_groups[0]["params"][0])[name])


def test_bf16_parameters_take_the_reference_where_torch_keeps_a_nans_payload(monkeypatch):
    """Where torch's bf16 cast gives NaNs of other signs or payloads other bits (bf16_nan None),
    the kernels could not match it: bf16 parameters take the reference, and say why."""
    from qstate_cli.optim import fused
    monkeypatch.setattr(cpu, "bf16_nan", lambda: None)
    monkeypatch.setattr(cpu, "unavailable_reason", lambda device: None)
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    p.grad = torch.randn(300, dtype=torch.bfloat16)
    opt = AdamW([p], states="bred-4bit", min_quant_numel=0)
    why = fused.why_reference(opt, opt.param_groups[0], p, on_cpu=True)
    assert why is not None and "NaN" in why
    q = torch.nn.Parameter(torch.randn(300))
    q.grad = torch.randn(300)
    assert fused.why_reference(opt, opt.param_groups[0], q, on_cpu=True) is None


@needs_numba
def test_auto_picks_the_cpu_path_and_uncovered_parameters_fall_back():
    covered = torch.nn.Parameter(torch.randn(300))
    half = torch.nn.Parameter(torch.randn(300, dtype=torch.float16))
    opt = AdamW([covered, half], states="bred-4bit", min_quant_numel=0)
    assert opt.path_for(covered) == cpu.PATH and opt.why_reference(covered) is None
    assert opt.path_for(half) == "reference" and "float16" in opt.why_reference(half)
    ref, ker = make_pair(AdamW, [(37, 29), (20,)], torch.float16, backend="auto", device="cpu", states="bred-4bit")
    gen = torch.Generator().manual_seed(2)
    step_both(ref, ker, gen)  # fp16: both steps by the reference, equal
    for a, b in zip(ref.param_groups[0]["params"], ker.param_groups[0]["params"]):
        assert torch.equal(a, b)


def test_without_numba_auto_falls_back_with_the_reason_and_cpu_is_an_error(monkeypatch):
    monkeypatch.setattr(cpu, "_import_error", ["numba is not importable (ModuleNotFoundError: test)"])
    p = torch.nn.Parameter(torch.randn(300))
    opt = AdamW([p], min_quant_numel=0)
    assert opt.path_for(p) == "reference" and "numba is not importable" in opt.why_reference(p)
    with pytest.raises(QstateError, match="backend='cpu' needs numba"):
        AdamW([p], backend="cpu").path_for(p)
    p.grad = torch.randn(300)
    opt.step()  # the reference steps it
    assert int(opt.state[p]["step"]) == 1


@needs_numba
def test_cpu_scratch_rows_are_cache_line_aligned():
    """native.scratch_* rows (the kernels' block rows, on the stack) start on a 64-byte line
    whatever the stack's offset: Linux starts each process's stack at a random 16-byte offset,
    and a row 16, 32 or 48 bytes into a line made every 64-byte access span two lines (4.7
    against 4.0 ms for nearest-4bit's kernel in 5 of 8 processes: docs/cpu.md, "A Zen 4 EPYC")."""
    from numba import njit
    from qstate_cli.kernels.cpu import native as nv

    @njit
    def addresses(depth):
        a = nv.scratch_f32(128)
        b = nv.scratch_i32(7)  # an odd size before another row
        c = nv.scratch_f64(3)
        a[0], b[0], c[0] = 1.0, 1, 1.0
        if depth > 0:  # a deeper frame: a different stack offset
            return addresses(depth - 1)
        return a.ctypes.data, b.ctypes.data, c.ctypes.data

    for depth in range(4):
        assert [addr % 64 for addr in addresses(depth)] == [0, 0, 0]


@needs_numba
def test_cpu_shifts32_are_the_widened_shifts_truncated_and_pack_on_32_bit_lanes():
    """native.shl32 / shr32 / sar32 give the bits of numba's own (64-bit) shift of the same
    operands truncated to 32, for every shift in [0, 31] and operands of each width and sign;
    and, on an AVX2 (or later) x86 build, a loop of shifts by a run-time amount packs on 32-bit
    lanes (vpsllvd), where numba's
    widened shift took 64-bit ones (vpsllvq) and the conversions between (docs/cpu.md, "32-bit shifts")."""
    import re

    import numpy as np
    from numba import njit
    from qstate_cli.kernels.cpu import native as nv

    @njit
    def ours(x, s):
        return nv.shl32(x, s), nv.shr32(x, s), nv.sar32(x, s)

    @njit
    def widened(x, s):
        return np.uint32(np.uint32(x) << np.uint32(s)), np.uint32(np.uint32(x) >> np.uint32(s)), \
            np.int32(np.int32(x) >> np.int32(s))

    rng = np.random.default_rng(0)
    words = np.concatenate([rng.integers(0, 2**32, 64), [0, 1, 2**31 - 1, 2**31, 2**32 - 1]]).astype(np.uint32)
    for x in words:
        for s in range(32):
            want = widened(x, np.int64(s))
            for typed in (np.uint32(x), np.int32(x.view(np.int32)), np.int64(x)):
                assert ours(typed, np.int32(s)) == want, (x, s, typed.dtype)

    @njit
    def row_shift(a, s, out):
        for i in range(a.size):
            out[i] = nv.shl32(a[i], s[i])  # s unmasked: numba's own shift of these packs on 64-bit lanes

    a = words[:64].copy()
    s = np.arange(64, dtype=np.uint32) % 32
    out = np.empty(64, np.uint32)
    row_shift(a, s, out)
    assert np.array_equal(out, (a.astype(np.uint64) << s).astype(np.uint32))
    import platform

    import numba
    from numba.core.codegen import get_host_cpu_features
    features = (numba.config.CPU_FEATURES or get_host_cpu_features()).split(",")
    if platform.machine() not in ("x86_64", "AMD64") or numba.config.CPU_NAME == "generic" or "+avx2" not in features:
        return  # the packing is checked where numba compiles for an AVX2 (or later) x86 core
    asm = next(iter(row_shift.inspect_asm().values()))
    assert re.search(r"vpsllvd", asm) and not re.search(r"vpsllvq", asm)


@needs_numba
def test_cpu_code_of_needs_the_layout_as_a_compile_time_constant():
    """rounding.code_of picks one format's branch-free rounding from lay's literal values; a
    lay known only at run time (an argument) is a typing error that says so, not a silent
    every-branch fallback (docs/cpu.md, "Encode by pairs: kept": that cost 5x the compile)."""
    import numpy as np
    from numba import njit
    from numba.core.errors import TypingError
    from qstate_cli.kernels.cpu import codec as c

    lay = (c.LINEAR, 4, 1, 0, c.NEAREST, 0, 0, 0, 0, 0, 0, 0)  # int4, nearest

    @njit(error_model="numpy")
    def constant(n):
        return c.code_of(n, lay, np.zeros(1, np.float32), c.ZERO, c.ZERO)

    @njit(error_model="numpy")
    def runtime(n, lay_arg):
        return c.code_of(n, lay_arg, np.zeros(1, np.float32), c.ZERO, c.ZERO)

    # clamp(rint(n), -8, 7) & 15: 2.5 -> 2 (half to even), -3.5 -> -4 -> 12, 9 -> 7, -20 -> -8 -> 8
    assert [int(constant(np.float32(x))) for x in (2.5, -3.5, 9.0, -20.0)] == [2, 12, 7, 8]
    with pytest.raises(TypingError, match="closure constant"):
        runtime(np.float32(1.0), lay)


def test_run_parts_keeps_the_part_count_a_caller_sized_its_output_with(monkeypatch):
    """A per-part output (replay_model's counts, replay_stats' histogram rows) is sized
    before run_parts splits the blocks: passed that size, run_parts never hands a kernel a
    part past it, even if the thread count grew in between (the kernels do not bound-check)."""
    from qstate_cli.kernels.cpu import host
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1024)
    monkeypatch.setattr(host, "threads", lambda: 2)
    out = [0] * host.parts_of(4096)  # sized at 2 threads
    monkeypatch.setattr(host, "threads", lambda: 3)  # then a third thread appears

    def kernel(b0, b1, part, out):
        out[part] += b1 - b0  # IndexError past the size (a numba kernel would write out of bounds)
        return 0

    host.run_parts(kernel, 4096, 128, (out,), parts=len(out))
    assert out == [16, 16]
    with pytest.raises(IndexError):  # without it the split follows the new count
        host.run_parts(kernel, 4096, 128, ([0, 0],))
