"""Formats: code books, minifloats against torch dtypes, a brute-force nearest oracle,
encode->decode error bounds (hypothesis), packing, short and zero blocks, NaN policy, bytes."""
import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qstate_cli.quant import FORMATS, QuantizedState, Stream, decode, encode, parse_spec, state_bytes
from qstate_cli.quant.codebooks import check_table, codebook
from qstate_cli.quant.formats import Format, _register
from qstate_cli.quant.packing import pack, unpack


def roundtrip(x, text, step=1, stream=Stream(7, 3, 0)):
    spec = parse_spec(text)
    storage, scales = encode(x, spec, step, stream)
    return decode(storage, scales, spec, x.numel(), step, stream), storage, scales, spec


def representable(spec, scale) -> torch.Tensor:
    """Every value a block with absmax `scale` can read back under nearest/SR (sorted)."""
    fmt = spec.fmt
    delta = scale / fmt.top if spec.scaled else 1.0
    if fmt.kind == "linear":
        lo, hi = fmt.code_range
        vals = torch.arange(lo, hi + 1, dtype=torch.float32) * delta
    elif fmt.kind == "table":
        vals = torch.tensor(codebook(fmt.name)) * delta
    else:
        mags = fmt.ordinal_value(torch.arange(0, fmt.max_ordinal + 1)) * delta
        vals = torch.cat([-mags, mags]) if fmt.signed else mags
    return torch.unique(vals.float())


# ---- code books ---------------------------------------------------------------------
def test_de4_magnitudes_are_the_published_ones():
    mags = sorted({round(abs(v), 4) for v in codebook("de4")})
    assert mags == [0.0, 0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0]


@pytest.mark.parametrize("name,size", [("de8", 256), ("de8u", 256), ("de4", 16), ("de4u", 16), ("lin4nz", 16),
                                       ("de8nz", 255), ("de8unz", 255), ("de4nz", 15), ("de4unz", 15)])
def test_codebooks_are_sorted_unique_and_sized(name, size):
    t = codebook(name)
    assert len(t) == size and list(t) == sorted(set(t))
    assert max(t) == 1.0
    assert (0.0 in t) == (not name.endswith("nz"))


def test_lin4nz_is_sixteenths():
    assert codebook("lin4nz") == tuple(k / 16 for k in range(1, 17))


# ---- minifloats equal torch's own conversions ------------------------------------------
@pytest.mark.parametrize("name,dtype,limit", [
    ("bf16", torch.bfloat16, 1e30), ("fp16", torch.float16, 6e4),
    ("e4m3", torch.float8_e4m3fn, 440.0), ("e5m2", torch.float8_e5m2, 5.7e4)])
def test_minifloat_nearest_equals_torch_dtype(name, dtype, limit):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-6, 1e-3, 1.0, 30.0)])
    x = torch.cat([x, torch.tensor([0.0, -0.0, 2.0 ** -9, 2.0 ** -24, 1.5 * 2 ** -14])])
    x = x[x.abs() < limit]
    got, *_ = roundtrip(x, f"{name}:nearest")
    want = x.to(dtype).float()
    assert torch.equal(got, want), (x[got != want][:5], got[got != want][:5], want[got != want][:5])


def test_fp4_value_sets():
    e2m1 = FORMATS["e2m1"].ordinal_value(torch.arange(8)).tolist()
    e2m2 = FORMATS["e2m2"].ordinal_value(torch.arange(16)).tolist()
    assert e2m1 == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert e2m2 == [0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7]
    assert FORMATS["e4m3"].fmax == 448.0 and FORMATS["e5m2"].fmax == 57344.0


# ---- the brute-force nearest oracle -----------------------------------------------------
NEAREST = ["int4:b32", "uint4:b64", "int8:b256", "uint8:b128", "de8", "de8u", "de4", "de4nz", "de4u",
           "lin4nz", "de8unz", "e4m3:b64", "e5m2:b32", "e2m1:b32", "e2m2:b32", "fp16", "e4m3", "e2m1"]


@pytest.mark.parametrize("text", NEAREST)
def test_nearest_picks_a_nearest_representable_value(text):
    spec = parse_spec(text + ":nearest")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, generator=g) * 3
    if not spec.fmt.signed:
        x = x.abs()
    y, *_ = roundtrip(x, str(spec))
    B = spec.block or x.numel()
    for b in range(0, x.numel(), B):
        xb, yb = x[b:b + B], y[b:b + B]
        grid = representable(spec, xb.abs().max())
        dist = (xb[:, None] - grid[None, :]).abs().min(dim=1).values
        assert torch.all((yb - xb).abs() <= dist * (1 + 1e-6) + 1e-30), text
        assert torch.all(torch.isin(yb, grid)), text


# ---- encode -> decode error bounds for every format and rounding ----------------------------
SPECS = ["int4:{r}:b128", "uint4:{r}:b32", "int8:{r}:b256", "uint8:{r}:b64:sqrt", "de8:{r}", "de8u:{r}",
         "de4:{r}", "lin4nz:{r}", "e4m3:{r}:b256", "e2m1:{r}:b32", "e2m2:{r}:b128", "bf16:{r}", "fp16:{r}:b128",
         "int4:{r}:b128:sbf16"]
arrays = st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=300)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "bred"])
@pytest.mark.parametrize("template", SPECS)
@given(values=arrays, step=st.integers(1, 10_000))
def test_error_is_bounded_by_the_local_grid(template, rounding, values, step):
    spec = parse_spec(template.format(r=rounding))
    x = torch.tensor(values, dtype=torch.float32)
    if not spec.fmt.signed or spec.sqrt:
        x = x.abs()
    y, _, scales, _ = roundtrip(x, str(spec), step=step)
    assert torch.isfinite(y).all()
    B = spec.dither_block
    for b in range(0, x.numel(), B):
        xb, yb = x[b:b + B], y[b:b + B]
        if spec.sqrt:
            xb, yb = xb.double().sqrt().float(), yb.clamp(min=0).double().sqrt().float()
        absmax = xb.abs().max()
        if spec.scaled:
            scale = scales[b // B].float()
            if spec.scale_dtype == "bf16":  # rounded up to a bf16 value: >= absmax, < 1 bf16 ulp above
                assert scale >= absmax and scale.bfloat16().float() == scale
                assert scale <= absmax * (1 + 2 ** -7) or absmax < 2 ** -126
            else:
                assert scale == absmax
            absmax = scale
        if spec.scaled and absmax < spec.fmt.top * 2 ** -126:  # zero block, or a subnormal step: reads 0
            assert torch.all(yb == 0)
            continue
        grid = representable(spec, absmax)
        idx = torch.searchsorted(grid, xb).clamp(1, grid.numel() - 1)
        lo, hi = grid[idx - 1], grid[idx]
        gaps = torch.diff(grid)
        local = torch.maximum(hi - lo, torch.cat([gaps, gaps[-1:]])[idx.clamp(max=gaps.numel() - 1)])
        local = torch.maximum(local, gaps[(idx - 2).clamp(min=0)])
        err = (yb - xb).abs()
        # signed DE maps stop at -0.98..: values beyond the grid's ends are clamped to it
        outside = torch.clamp(torch.maximum(grid[0] - xb, xb - grid[-1]), min=0)
        slack = 1e-6 * xb.abs() + 1e-30 + outside
        if spec.sqrt:  # the square read back is an fp32 number: near 0 it is a subnormal
            slack = slack + 2.0 ** -74
        if rounding == "nearest":
            assert torch.all(err <= 0.5 * (hi - lo) + slack)
        elif rounding == "stochastic":
            assert torch.all(err <= (hi - lo) + slack)
        else:  # subtractive dither: half an ordinal step, interpolated
            assert torch.all(err <= 0.5 * local + slack)
        if spec.fmt.kind == "linear" and rounding == "bred" and not spec.sqrt:
            assert torch.all(err <= 0.5 * absmax / spec.fmt.top * (1 + 1e-5) + 1e-30)


# ---- packing, short blocks, zero blocks, NaN policy, bytes ----------------------------------
@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("n", [1, 2, 7, 128, 1001])
def test_packing_round_trips(bits, n):
    codes = torch.randint(0, 2 ** bits, (n,), dtype=torch.int32)
    storage = pack(codes, bits)
    assert storage.numel() * storage.element_size() == math.ceil(n * bits / 8)
    assert torch.equal(unpack(storage, bits, n), codes)


@pytest.mark.parametrize("text", ["int4:bred:b128", "de4:nearest:b128", "e2m1:stochastic:b32", "uint8:nearest:b2048"])
def test_short_last_block(text):
    x = torch.randn(1000).abs() + 0.1
    x[-5:] = torch.tensor([10.0, 0.0, 1.0, 2.0, 3.0])  # last block's own absmax
    y, storage, scales, spec = roundtrip(x, text)
    assert y.shape == (1000,)
    assert scales.numel() == math.ceil(1000 / spec.block)
    assert scales[-1] == x[(scales.numel() - 1) * spec.block:].abs().max()


@pytest.mark.parametrize("text", [f"{f}:{r}" for f in ["int4:b32", "uint4:b32", "de4:b32", "lin4nz:b32", "de8unz:b32",
                                                       "e2m1:b32", "e4m3:b32"] for r in ["nearest", "stochastic", "bred"]])
def test_all_zero_blocks_read_back_zero(text):
    x = torch.zeros(100)
    y, *_ = roundtrip(x, text)
    assert torch.equal(y, torch.zeros(100))


def test_unscaled_float_zero_under_bred_stays_tiny():
    y, *_ = roundtrip(torch.zeros(300), "bf16:bred")
    assert torch.isfinite(y).all() and y.abs().max() <= 2.0 ** -133


@pytest.mark.parametrize("text", ["int4:bred:b32", "de8:nearest:b32", "e4m3:stochastic:b32", "bf16:nearest", "fp32"])
def test_nonfinite_inputs_are_stored_as_zero(text):
    x = torch.randn(96)
    bad = x.clone()
    bad[[3, 40, 77]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    clean = x.clone()
    clean[[3, 40, 77]] = 0.0
    yb, sb, scb, _ = roundtrip(bad, text)
    yc, sc, scc, _ = roundtrip(clean, text)
    assert torch.equal(sb, sc) and torch.equal(yb, yc)
    assert scb is None or torch.equal(scb, scc)


@pytest.mark.parametrize("text", ["int4:b128", "uint8:b256", "de4:b32", "e2m1:b2048", "bf16", "fp32", "int4:b128:sbf16",
                                  "e4m3:b256"])
@pytest.mark.parametrize("numel", [1, 33, 128, 1000, 4097])
def test_state_bytes_match_the_accounting(text, numel):
    spec = parse_spec(text)
    st_ = QuantizedState(spec, (numel,))
    st_.encode(torch.randn(numel), step=1)
    block = spec.block if spec.scaled else None
    want = math.ceil(numel * spec.bits / 8) + (math.ceil(numel / block) * spec.scale_bytes if block else 0)
    assert st_.nbytes == want == state_bytes(spec.fmt, numel, block, spec.scale_bytes) == st_.expected_nbytes()


def test_normalize_multiplies_by_one_reciprocal_per_block():
    """n = x * (top / absmax), one true fp32 division per block; a block with
    absmax < top * 2**-126 (subnormal step) or all zero has step 0 and reads back as 0."""
    from qstate_cli.quant.quantizer import normalize, step_of

    absmax = torch.tensor([2.59, 1e-40, 0.0, 21.0, 7 * 2.0 ** -126])
    delta = step_of(absmax, 7.0)
    assert delta[0].item() == (torch.tensor(2.59) / torch.tensor(7.0)).item()
    assert delta[1].item() == 0.0 and delta[2].item() == 0.0 and delta[4].item() == 2.0 ** -126
    xb = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    xb[1] *= 1e-41
    n = normalize(xb, absmax, 7.0)
    assert torch.equal(n[0], xb[0] * (torch.tensor(7.0) / absmax[0]))
    assert torch.equal(n[3], xb[3] * (torch.tensor(7.0) / absmax[3]))
    assert torch.equal(n[1], torch.zeros(64)) and torch.equal(n[2], torch.zeros(64)) and torch.isfinite(n).all()
    y, _, _, _ = roundtrip(torch.tensor([1e-40, -3e-39] * 64), "int4:bred:b128")
    assert torch.equal(y, torch.zeros(128))


# ---- BReD on a float grid: uniform in code units, biased where the spacing changes -------
@pytest.mark.parametrize("text, eps", [("bf16:bred", 2.0 ** -7), ("e4m3:bred", 2.0 ** -3)])
@pytest.mark.parametrize("x0, a", [(1.0, 0.0), (1.0, 0.25), (1.0, -0.25), (2.0, 0.0), (1.5, None), (0.75, None)])
def test_bred_on_a_minifloat_is_biased_at_a_binade_boundary(text, eps, x0, a):
    """The dither is added to the ordinal and subtracted there (config.py), so the error is
    uniform in code units: zero-mean in value mid-binade, but at a distance of a codes from a
    binade boundary x0 = 2^e, where the spacing goes from s_down = eps*x0/2 to s_up = eps*x0,
    its mean is (s_up - s_down) * (1/2 - |a|)^2 / 2: (s_up - s_down)/8 = eps*x0/16 at x0
    itself (bf16 at 1.0: +4.9e-4, the numerics probe's +5.0e-4). a=None: a mid-binade code
    (1.5, 0.75), where the mean is 0. One dither per block of 128 and step, so the samples
    are one element per block over 16 steps x 2048 blocks: n = 32,768 independent errors,
    each within (-s_up/2, s_up/2], so their standard deviation is at most s_up/sqrt(12) and
    the mean lies within 6 standard errors of its expectation."""
    blocks, block, steps = 2048, 128, 16
    if a is None:
        x, expected = x0, 0.0
        s_up = eps * 2.0 ** math.floor(math.log2(x0))  # the binade's own spacing, both sides
    else:
        s_up, s_down = eps * x0, eps * x0 / 2
        x = x0 + a * (s_up if a > 0 else s_down)
        expected = (s_up - s_down) * (0.5 - abs(a)) ** 2 / 2
    errors = []
    for step in range(1, steps + 1):
        xt = torch.full((blocks * block,), x)
        y, _, _, _ = roundtrip(xt, text, step=step)
        errors.append((y.double() - x).view(blocks, block)[:, 0])
    err = torch.cat(errors)
    n = err.numel()
    assert err.abs().max().item() <= s_up / 2 + 1e-12  # within half a code (the larger spacing)
    tolerance = 6 * (s_up / math.sqrt(12)) / math.sqrt(n)
    mean = err.mean().item()
    assert abs(mean - expected) <= tolerance, (text, x, mean, expected, tolerance)
    if a == 0.0:
        assert expected == pytest.approx(eps * x0 / 16) and expected > 6 * tolerance  # the bias is resolved


# ---- what a new format is checked for (formats._register, codebooks.check_table) ------------
def test_every_table_is_a_valid_code_book():
    tables = {name: fmt.table for name, fmt in FORMATS.items() if fmt.kind == "table"}
    assert len(tables) >= 10 and all(tables.values())


@pytest.mark.parametrize("table,signed,why", [
    ((-1.0, 0.5, 0.0, 1.0), True, "not strictly ascending"),
    ((-1.0, 0.0, 0.0, 1.0), True, "not strictly ascending"),
    ((-1.5, 0.0, 1.0), True, "values outside [-1, 1]"),
    ((-0.5, 0.0, 1.0), False, "values outside [0, 1]"),
    ((0.0, 0.5, 0.9), False, "its largest value is 0.9, not 1"),
    (tuple(i / 16 for i in range(1, 18)), False, "17 entries; a 4-bit code indexes 1 to 16"),
    ((), False, "0 entries"),
])
def test_a_wrong_code_book_is_refused(table, signed, why):
    with pytest.raises(ValueError, match=re.escape(f"code book 'mine': {why}")):
        check_table("mine", table, 4, signed)


def test_a_code_width_packing_cannot_store_is_refused():
    with pytest.raises(ValueError, match=r"format 'int3': 3-bit codes; quant/packing.py packs 4, 8, 16-bit codes"):
        _register(Format("int3", "linear", 3, True, "3-bit", levels=3))
    assert "int3" not in FORMATS
