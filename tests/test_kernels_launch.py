"""Multi-tensor launches, the optimizers' kernel path and its fallbacks, checkpoints.

- one launch over many tensors equals one launch per tensor;
- a param group steps in one launch; launch tables are cached by address;
- a checkpoint resumes bit for bit, on the kernel path and across paths (one state layout);
- path_for names the path; uncovered parameters fall back to the reference."""
import io

import pytest
import torch
from conftest import triton_problem

if triton_problem():  # the kernel modules below do not even import with an older Triton
    pytest.skip(triton_problem(), allow_module_level=True)

from kernel_parity import DEVICE, assert_bits_equal, assert_same_state, make_pair, step_both  # noqa: E402
from qstate_cli.errors import QstateError  # noqa: E402
from qstate_cli.kernels import adamw, launch  # noqa: E402
from qstate_cli.optim import Adam, AdamW, Lion, rules  # noqa: E402
from qstate_cli.quant import QuantizedState, Stream, parse_config  # noqa: E402


def _members(shapes, cfg, dtype, gen):
    c = parse_config(cfg)
    out = []
    for tid, shape in enumerate(shapes):
        p = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        g = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        states = {n: QuantizedState(c.spec(n), shape, Stream(1, tid, i), device=DEVICE) for i, n in enumerate("mv")}
        nf = torch.zeros((), dtype=torch.int64, device=DEVICE)
        out.append(launch.Member(p, g, {n: (q.codes, q.scales) for n, q in states.items()}, nf, tensor_id=tid + 3))
    return c, out


def _launch(batch, c, step):
    s = rules.pack_scalars(rules.step_scalars(1e-2, 0.1, 0.9, 0.999, step, DEVICE))
    lm, lv = launch.kernel_layout(c.m), launch.kernel_layout(c.v)
    adamw.adamw_step(batch, s, lm, lv, p_kind=1, g_kind=1, step=step, written=(step - 1, step - 1),
                     fresh=(step == 1, step == 1), beta1=0.9, beta2=0.999, eps=1e-8,
                     tables=(lm.table(DEVICE), lv.table(DEVICE)))


def test_one_launch_over_many_tensors_equals_one_launch_per_tensor():
    shapes = [(37, 29), (5,), (256,), (3, 100)]
    c, together = _members(shapes, "m=int4:bred:b64,v=uint4:sr:b64:sqrt", torch.bfloat16, torch.Generator().manual_seed(0))
    _, alone = _members(shapes, "m=int4:bred:b64,v=uint4:sr:b64:sqrt", torch.bfloat16, torch.Generator().manual_seed(0))
    for step in (1, 2):
        batch = launch.build_batch(together, 64, seed=1)
        assert batch.meta.shape[0] == 4
        _launch(batch, c, step)
        for m in alone:
            _launch(launch.build_batch([m], 64, seed=1), c, step)
        for i, (a, b) in enumerate(zip(together, alone)):
            assert_bits_equal(f"param {i}", a.param, b.param)
            for n in "mv":
                assert_bits_equal(f"param {i} {n} codes", a.states[n][0], b.states[n][0])
                assert_bits_equal(f"param {i} {n} scales", a.states[n][1], b.states[n][1])


def test_a_param_group_steps_in_one_launch_and_reuses_its_tables(monkeypatch):
    ref, ker = make_pair(AdamW, [(37, 29), (300,), (5,), (64, 64)], states="bred-4bit")
    launches = []
    original = ker.launch_kernel
    monkeypatch.setattr(ker, "launch_kernel", lambda *a: (launches.append(a[1].meta.shape[0]), original(*a)))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        step_both(ref, ker, gen)
    assert launches == [4, 4]  # four tensors, one launch per step
    grads = [p.grad for p in ker.param_groups[0]["params"]]
    for p in ker.param_groups[0]["params"]:
        p.grad.copy_(torch.randn(p.shape, generator=gen))  # same gradient buffers
    ker.step()
    assert len(ker._kernel_batches) == 2  # steps 1-2: new gradient tensors; step 3: reused
    assert all(p.grad is g for p, g in zip(ker.param_groups[0]["params"], grads))


def test_parameters_of_two_dtypes_take_two_launches(monkeypatch):
    ps = [torch.nn.Parameter(torch.randn(300, device=DEVICE)), torch.nn.Parameter(torch.randn(300, device=DEVICE).bfloat16())]
    opt = AdamW(ps, states="bred-4bit", min_quant_numel=0, backend="triton")
    sizes = []
    original = opt.launch_kernel
    monkeypatch.setattr(opt, "launch_kernel", lambda *a: (sizes.append(a[1].meta.shape[0]), original(*a)))
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert sizes == [1, 1]


def _checkpoint(opt, params):
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("first,then", [("triton", "triton"), ("reference", "triton"), ("triton", "reference")])
def test_checkpoint_resume_continues_bit_for_bit(first, then):
    """Four steps, checkpoint, four more; a fresh optimizer loaded from the checkpoint
    (possibly on the other path) ends bit for bit where the uninterrupted run ended."""
    shapes = [(37, 29), (300,)]
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(s, generator=gen).to(DEVICE) for s in shapes] for _ in range(8)]

    def make(backend):
        ps = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(9)).to(DEVICE)) for s in shapes]
        return ps, AdamW(ps, states="m=int4:bred:b128,v=uint4:sr:b128:sqrt", min_quant_numel=0, seed=77,
                         reset=6, backend=backend)

    def run(ps, opt, steps):
        for t in steps:
            for p, g in zip(ps, grads[t]):
                p.grad = g.clone()
            opt.step()

    ps, opt = make(first)
    run(ps, opt, range(4))
    ck = _checkpoint(opt, ps)
    run(ps, opt, range(4, 8))
    ps2, opt2 = make(then)
    with torch.no_grad():
        for p, saved in zip(ps2, ck["params"]):
            p.copy_(saved)
    opt2.load_state_dict(ck["opt"])
    run(ps2, opt2, range(4, 8))
    for i, (a, b) in enumerate(zip(ps, ps2)):
        assert_bits_equal(f"param {i}", b, a)
        for n in ("m", "v"):
            for part in ("codes", "scales", "written"):
                assert_bits_equal(f"param {i} {n}.{part}", opt2.state[b][n][part], opt.state[a][n][part])
        assert opt2.state[b][n]["written"].device.type == "cpu"  # step counters stay on the host


def test_path_for_names_the_path_and_uncovered_parameters_fall_back():
    covered = torch.nn.Parameter(torch.randn(300, device=DEVICE))
    small = torch.nn.Parameter(torch.randn(30, device=DEVICE))
    wide = torch.nn.Parameter(torch.randn(300, device=DEVICE, dtype=torch.float64))
    opt = AdamW([covered, small, wide], states="bred-4bit", min_quant_numel=64, backend="triton")
    want = "triton" if DEVICE == "cuda" else "triton-interpreter"
    assert opt.path_for(covered) == want and opt.why_reference(covered) is None
    assert opt.path_for(small) == "reference" and "min_quant_numel" in opt.why_reference(small)
    assert opt.path_for(wide) == "reference" and "float64" in opt.why_reference(wide)
    for states, why in [("fp8", "e4m3"), ("bf16-sr", "bf16"), ("m=int4:b64,v=uint4:b128", "block sizes")]:
        o = AdamW([covered], states=states, min_quant_numel=0, backend="triton")
        assert o.path_for(covered) == "reference" and why in o.why_reference(covered)
    assert AdamW([covered], backend="reference").path_for(covered) == "reference"
    if DEVICE == "cpu":  # auto on CPU: the CPU path where numba imports (tests/test_kernels_cpu.py)
        from qstate_cli.kernels import cpu
        want = "reference" if cpu.unavailable_reason("cpu") else cpu.PATH
        assert AdamW([covered], backend="auto", min_quant_numel=0).path_for(covered) == want


def test_fallback_parameters_step_like_the_reference_beside_kernel_ones():
    ref, ker = make_pair(AdamW, [(37, 29), (20,)], states="bred-4bit", min_quant_numel=64)
    gen = torch.Generator().manual_seed(2)
    for t in (1, 2):
        step_both(ref, ker, gen)
        a, b = ref.param_groups[0]["params"][1], ker.param_groups[0]["params"][1]
        assert ker.path_for(b) == "reference"
        assert_bits_equal("small param", b, a)


def test_triton_backend_without_the_interpreter_is_a_clear_error(monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("CUDA tensors need no interpreter")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = torch.nn.Parameter(torch.randn(300))
    with pytest.raises(QstateError, match="TRITON_INTERPRET"):
        Lion([p], backend="triton").path_for(p)


def test_covered_formats_are_exactly_the_linear_and_table_ones():
    from qstate_cli.quant import FORMATS, parse_spec

    covered = {name for name, f in FORMATS.items() if launch.kernel_layout(parse_spec(name)) is not None}
    assert covered == {"int4", "uint4", "int8", "uint8", "de4", "de4u", "de4nz", "de4unz", "de8", "de8u",
                       "de8nz", "de8unz", "lin4nz", "lin8nz"}


@pytest.mark.cuda
def test_tensors_beyond_two_to_the_31_elements_use_64_bit_offsets():
    """Nearest rounding is block-local, so the tail of a 2**31 + 300 element tensor must
    equal the reference run on that tail alone (starting at a block boundary)."""
    n = 2 ** 31 + 300
    tail = 128 * 8
    p = torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16))
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    start = (n // 128) * 128 - tail + 128
    q = torch.nn.Parameter(p.detach()[start:].clone())
    opt = AdamW([p], states="nearest-4bit", min_quant_numel=0, backend="triton")
    ref = AdamW([q], states="nearest-4bit", min_quant_numel=0, backend="reference")
    p.grad, q.grad = g, g[start:].clone()
    opt.step()
    ref.step()
    assert_bits_equal("tail of param", p.detach()[start:], q.detach())
    assert_bits_equal("tail of m codes", opt.state[p]["m"]["codes"][start // 2:], ref.state[q]["m"]["codes"])
    assert_bits_equal("tail of v scales", opt.state[p]["v"]["scales"][start // 128:], ref.state[q]["v"]["scales"])


def test_programs_that_loop_over_several_tiles_equal_one_tile_per_program():
    """A program steps up to 8 consecutive tiles (launch.tiles_per_program); the last one
    of a tensor may be short. Same bits as one tile per program."""
    _, rows, _ = launch.tile_shape(128, 2)  # bf16, block 128: tiles of `rows` blocks (32: 4096 elements)
    shapes = [(6 * rows * 128 + 77,), (3000,)]
    c, looped = _members(shapes, "m=int4:bred:b128,v=uint4:sr:b128:sqrt", torch.bfloat16, torch.Generator().manual_seed(1))
    _, single = _members(shapes, "m=int4:bred:b128,v=uint4:sr:b128:sqrt", torch.bfloat16, torch.Generator().manual_seed(1))
    for step in (1, 2):
        batch = launch.build_batch(looped, 128, seed=1, tiles=4)
        assert batch.tiles == 4 and batch.grid == 2 + 1  # 7 tiles -> 2 programs; 2 tiles -> 1
        _launch(batch, c, step)
        _launch(launch.build_batch(single, 128, seed=1, tiles=1), c, step)
        for i, (a, b) in enumerate(zip(looped, single)):
            assert_bits_equal(f"param {i}", a.param, b.param)
            for n in "mv":
                assert_bits_equal(f"param {i} {n} codes", a.states[n][0], b.states[n][0])
                assert_bits_equal(f"param {i} {n} scales", a.states[n][1], b.states[n][1])


def test_optimizer_with_looping_programs_equals_reference(monkeypatch):
    monkeypatch.setattr(launch, "PROGRAMS_WANTED", 1)  # small tensors get 8 tiles per program
    _, rows, _ = launch.tile_shape(128, 2)
    ref, ker = make_pair(AdamW, [(9 * rows * 128 + 5,), (300,)], dtype=torch.bfloat16, states="bred-4bit")
    gen = torch.Generator().manual_seed(7)
    for t in (1, 2):
        step_both(ref, ker, gen, poison=(t == 2))
        assert_same_state(ref, ker, t)
    assert next(iter(ker._kernel_batches.values())).tiles == 8  # 10 + 1 tiles: programs of 8 + 2 and 1


def test_tiles_per_program_fills_the_gpu_first():
    assert launch.tiles_per_program(10) == 1
    assert launch.tiles_per_program(2 * launch.PROGRAMS_WANTED) == 2
    assert launch.tiles_per_program(10 ** 6) == launch.MAX_TILES_PER_PROGRAM


FULL_TILE_CASES = [("nearest-4bit", torch.bfloat16, AdamW), ("nearest-4bit", torch.float32, AdamW),
                   ("bred-4bit", torch.float32, AdamW), ("sr-4bit", torch.float32, AdamW),
                   ("m=int4:bred:b128,v=uint4:sr:b128:sqrt", torch.bfloat16, AdamW),
                   ("nearest-4bit", torch.bfloat16, Adam)]


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")  # on purpose
@pytest.mark.parametrize("states,dtype,cls", FULL_TILE_CASES,
                         ids=[f"{s}-{str(d)[6:]}-{c.__name__}" for s, d, c in FULL_TILE_CASES])
def test_full_tiles_with_nonfinite_values_equal_reference(states, dtype, cls):
    """Full tiles take the unmasked path: 4-bit codes decoded from 32/16-bit words
    (kernels/nibbles.py), and the tile checked for NaN/Inf gradients, m and v once
    (adamw._adamw_tile), stepped again element by element only if it holds one. A tile
    whose v overflows (g * g > FLT_MAX: stored as 0), one with NaN and Inf gradients at
    step 2 (zeroed and counted) and all-finite tiles, in one launch, equal the reference."""
    _, rows, _ = launch.tile_shape(128, dtype.itemsize)
    n = 3 * rows * 128 + 5  # three full tiles and a short one
    wd = dict(weight_decay=0.05) if cls is Adam else {}
    ref, ker = make_pair(cls, [(n,)], dtype=dtype, states=states, **wd)
    gen = torch.Generator().manual_seed(5)
    for t in (1, 2, 3):
        g = torch.randn(n, generator=gen)
        g[rows * 128 + 7: rows * 128 + 300] *= 1e20  # in the second tile only
        if t == 2:
            g[2 * rows * 128 + 11], g[2 * rows * 128 + 50] = float("nan"), -float("inf")  # the third
        (a,), (b,) = ref.param_groups[0]["params"], ker.param_groups[0]["params"]
        a.grad, b.grad = g.to(dtype).to(a.device), g.to(dtype).to(b.device)
        ref.step()
        ker.step()
        assert_same_state(ref, ker, t)
    assert int(ker.state[b]["nonfinite"]) == 2


def test_a_view_at_an_odd_offset_takes_the_unaligned_path_and_equals_an_aligned_copy():
    """Word and 16-byte vector reads need every address 16-byte aligned (Batch.aligned). A
    bf16 parameter and gradient that are views 2 bytes into their storage must be reported
    unaligned, and their launch (element reads) must give the aligned copies' bits."""
    shape = (3 * 128 * 16 + 7,)
    c, (m,) = _members([shape], "m=int4:nearest:b128,v=uint4:nearest:b128:sqrt", torch.bfloat16,
                       torch.Generator().manual_seed(9))
    big_p = torch.zeros(m.param.numel() + 1, dtype=torch.bfloat16, device=DEVICE)
    big_g = torch.zeros_like(big_p)
    big_p[1:].copy_(m.param)
    big_g[1:].copy_(m.grad)
    odd = launch.Member(big_p[1:], big_g[1:], {n: tuple(t.clone() for t in s) for n, s in m.states.items()},
                        m.nonfinite.clone(), tensor_id=m.tensor_id)
    assert launch.build_batch([m], 128, seed=1).aligned
    assert not launch.build_batch([odd], 128, seed=1).aligned
    for step in (1, 2):
        for member in (m, odd):
            _launch(launch.build_batch([member], 128, seed=1), c, step)
        assert_bits_equal("param", m.param, odd.param)
        for n in "mv":
            assert_bits_equal(f"{n} codes", m.states[n][0], odd.states[n][0])
            assert_bits_equal(f"{n} scales", m.states[n][1], odd.states[n][1])
