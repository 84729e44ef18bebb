"""The CPU path's minifloat codec (e4m3, e5m2, e2m1, e2m2 with block scales; kernels/cpu:
rounding._minifloat, codec.decode_value) against the reference quantizer, bit for bit, on
values chosen to sit on every magnitude ordinal, on the midpoints between them (the ties
that round-half-to-even settles), one ulp either side, in the subnormal grid, at -0.0 and
beyond the largest value, for every rounding, with and without `:sqrt` and bf16 scales; then
whole steps of Lion, SGD and Muon through the optimizers (tests/kernel_parity.py; AdamW's:
MINIFLOAT_CASES in tests/test_kernels_cpu.py's grid).

Skipped where numba is not installed. Each layout compiles a small helper (seconds)."""
import numpy as np
import pytest
import torch

from kernel_parity import assert_cpu_codec_equals_reference, run_parity
from qstate_cli.kernels import cpu
from qstate_cli.optim import SGD, Lion, Muon

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")
B = 64


def crafted(fmt) -> torch.Tensor:
    """Blocks of B values of n = x * (top / absmax): every ordinal's value, the midpoints,
    each +-1 ulp, negated (signed formats), zeros and values in the subnormal grid; blocks
    scaled so n is exact (absmax = top and 2 top) or not (absmax = 3 top / 1.7), one with a
    step below 2**-126 (reads 0)."""
    k = torch.arange(fmt.max_ordinal + 2)
    pts = fmt.code_value(k)
    mids = (pts[1:] + pts[:-1]) / 2
    base = torch.cat([pts, mids])
    vals = torch.cat([base, torch.nextafter(base, torch.tensor(1e9)), torch.nextafter(base, torch.tensor(-1.0)),
                      torch.tensor([0.0, -0.0, 1e-30, 2.0 ** (fmt.emin - fmt.man_bits - 1)])])
    if fmt.signed:
        vals = torch.cat([vals, -vals])
    vals = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(0))]
    top = float(fmt.top)
    blocks = []
    for i, absmax in enumerate((top, 2 * top, 3 * top / 1.7, 2.0 ** -127)):
        for first in range(0, vals.numel(), B - 1):
            v = vals[first:first + B - 1].clamp(-top, top) * (absmax / top)
            blocks.append(torch.cat([torch.tensor([absmax]), v, torch.zeros(B - 1 - v.numel())]))
    return torch.cat(blocks)


MINIFLOATS = ["e4m3", "e5m2", "e2m1", "e2m2"]


@needs_numba
@pytest.mark.parametrize("fmt", MINIFLOATS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "bred"])
@pytest.mark.parametrize("extra", ["", ":sqrt:sbf16"])
def test_minifloat_codec_equals_the_reference_at_every_ordinal_midpoint_and_neighbour(fmt, rounding, extra):
    from qstate_cli.kernels.launch import kernel_layout
    from qstate_cli.quant import parse_spec
    spec = parse_spec(f"{fmt}:{rounding}:b{B}{extra}")
    kl = kernel_layout(spec, minifloats=True)
    assert kernel_layout(spec) is None and kl.kind == 3  # the CPU path's only
    x = crafted(spec.fmt)
    if spec.sqrt:
        x = x * x.abs()  # sqrt(|x| x) = the crafted |n| again for x >= 0
    x = x[:x.numel() - 5]  # a short last block
    assert_cpu_codec_equals_reference(spec, kl, x, B)
    if not extra:  # the crafted values hold ties (frac = 1/2) below both even and odd ordinals
        from qstate_cli.quant.packing import to_blocks
        from qstate_cli.quant.quantizer import normalize
        xb = to_blocks(x, B)
        k, frac = spec.fmt.floor_frac(normalize(xb, xb.abs().amax(1), spec.fmt.top))
        ties = frac == 0.5
        assert int((ties & (k % 2 == 0)).sum()) > 0 and int((ties & (k % 2 == 1)).sum()) > 0


@needs_numba
@pytest.mark.parametrize("fmt", MINIFLOATS)
@pytest.mark.parametrize("rounding", ["nearest", "bred"])
def test_minifloat_decode_of_every_code_byte(fmt, rounding):
    """Every code, those above the largest ordinal included (0x7F of e4m3: a byte no encode
    writes, read as the reference reads it), in blocks of absmax 3 and of a step below 2**-126."""
    from numba import njit
    from qstate_cli.kernels.cpu import codec as c
    from qstate_cli.kernels.cpu import host
    from qstate_cli.kernels.launch import kernel_layout, stream_key
    from qstate_cli.quant import parse_spec
    from qstate_cli.quant.packing import pack
    from qstate_cli.quant.quantizer import Stream, decode
    spec = parse_spec(f"{fmt}:{rounding}:b{B}")
    lay, lim, tab = host.layout_arrays(kernel_layout(spec, minifloats=True), None)
    every = torch.arange(2 ** spec.fmt.bits, dtype=torch.int32)
    q = torch.cat([every.repeat(B // every.numel() or 1)[:B], every.flip(0).repeat(B // every.numel() or 1)[:B]])
    codes, scales = pack(q, spec.fmt.bits), torch.tensor([3.0, 2.0 ** -127])
    key = stream_key(5, 2, 1)
    keys = np.array(host.keys(key, 7), np.uint32)

    @njit(error_model="numpy")
    def read(codes, s16, keys, out, q, row):
        for b in range(2):
            c.read_state(False, codes, s16, False, lay, lim, tab, b, b * B, B, keys[0], keys[1], q, row)
            for j in range(B):
                out[b * B + j] = row[j]

    out = np.zeros(2 * B, np.float32)
    read(codes.numpy(), scales.view(torch.int16).numpy().view(np.uint16), keys, out, np.zeros(B, np.int32),
         np.zeros(B, np.float32))
    want = decode(codes, scales, spec, 2 * B, 7, Stream(seed=5, tensor_id=2, state_id=1))
    assert torch.equal(torch.from_numpy(out).view(torch.int32), want.view(torch.int32))


@needs_numba
@pytest.mark.parametrize("cls,states,options", [
    (Lion, "m=e4m3:sr:b128", dict(lr=1e-3, weight_decay=0.1)),
    (SGD, "m=e2m1:bred:b32", dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (Muon, "m=e5m2:nearest:b256:sbf16", dict(lr=0.02, momentum=0.95))], ids=["lion", "sgd", "muon"])
def test_cpu_one_state_optimizers_with_minifloat_momentum_equal_reference(cls, states, options):
    _, ker = run_parity(cls, states, [(37, 29), (33,)], torch.bfloat16, backend="cpu", device="cpu", **options)
    assert {ker.path_for(p) for p in ker.param_groups[0]["params"]} == {cpu.PATH}


def test_minifloats_stay_off_the_triton_kernels():
    """The Triton kernels do not take minifloats: on CUDA (or the interpreter) they keep the reference."""
    from qstate_cli.kernels.launch import kernel_layout, why_not_covered
    from qstate_cli.quant import parse_spec
    spec = parse_spec("e4m3:nearest:b256")
    assert kernel_layout(spec) is None and "has no kernel" in why_not_covered(spec)
    assert why_not_covered(spec, minifloats=True) is None
    for unscaled in ("bf16:stochastic", "e4m3:nearest:tensor", "e4m3:nearest"):
        assert why_not_covered(parse_spec(unscaled), minifloats=True) is not None, unscaled
