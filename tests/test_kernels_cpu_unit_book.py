"""The CPU path's closed-form rounding onto the no-zero linear code books {1, ..., UNIT} / UNIT
(lin4nz, lin8nz: v of every 4- and 8-bit preset; kernels/cpu/rounding._unit) against the
reference quantizer, bit for bit: on every code's value, the midpoints between codes (the
ties nearest rounding sends up), one ulp either side of both, below the first code (the
clamp at k = 0), at and beyond the top (the clamp at k = NT - 2), zeros and negatives, with
blocks whose n is exact (absmax = top) and not (absmax = 3 / 1.7), for every rounding.

The kernels compute (n - lo) * UNIT as n * UNIT - t with t = k + 1 (rounding._unit_t); this is
where a difference in the last bit of either would show. They also leave out the clamp of the
fraction that stochastic rounding and BReD compare (u and the dither lie in [0, 1)): blocks
holding NaN, infinities and huge values show that nothing else changes, for the unit books
and for a searched one. Skipped where numba is not
installed; each layout compiles a small helper (seconds)."""
import pytest
import torch

from qstate_cli.kernels import cpu
from kernel_parity import assert_cpu_codec_equals_reference

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")
B = 64


def crafted(unit: int) -> torch.Tensor:
    """Blocks of B values whose largest is absmax, the rest n * absmax for the crafted n."""
    pts = torch.arange(0, unit + 2, dtype=torch.float32) / unit  # 0, every code's value, beyond the top
    mids = (pts[1:] + pts[:-1]) / 2
    base = torch.cat([pts, mids, torch.tensor([1e-30, 0.5 / unit, 1.0 - 2.0 ** -24])])
    vals = torch.cat([base, torch.nextafter(base, torch.tensor(2.0)), torch.nextafter(base, torch.tensor(-1.0))])
    vals = torch.cat([vals, -vals[:8], torch.tensor([-0.0])])
    vals = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(1))]
    blocks = []
    for absmax in (1.0, 3.0 / 1.7):
        for first in range(0, vals.numel(), B - 1):
            v = vals[first:first + B - 1].clamp(-1.0, 1.0) * absmax
            blocks.append(torch.cat([torch.tensor([absmax]), v, torch.zeros(B - 1 - v.numel())]))
    return torch.cat(blocks)


@needs_numba
@pytest.mark.parametrize("book", ["lin4nz", "lin8nz"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "bred"])
def test_unit_book_codes_equal_the_reference_at_every_code_midpoint_and_neighbour(book, rounding):
    from qstate_cli.kernels.cpu import host
    from qstate_cli.kernels.cpu.layout import UNIT
    from qstate_cli.kernels.launch import kernel_layout
    from qstate_cli.quant import parse_spec
    from qstate_cli.quant.quantizer import Stream, encode
    spec = parse_spec(f"{book}:{rounding}:b{B}")
    kl = kernel_layout(spec)
    unit = 16 if book == "lin4nz" else 256
    assert host.layout_arrays(kl, None)[0][UNIT] == unit  # the closed form, not the searched book
    x = crafted(unit)
    x = x[:x.numel() - 3]  # a short last block
    assert_cpu_codec_equals_reference(spec, kl, x, B)
    # the crafted values reach both ends of the code range (the clamps)
    from qstate_cli.quant.packing import unpack
    codes, _ = encode(x, spec, 9, Stream(seed=5, tensor_id=2, state_id=1))
    got = unpack(codes, spec.fmt.bits, x.numel())
    assert int(got.min()) == 0 and int(got.max()) == unit - 1


@needs_numba
@pytest.mark.parametrize("fmt", ["lin4nz", "lin8nz", "de8"])
@pytest.mark.parametrize("rounding", ["stochastic", "bred"])
def test_blocks_with_non_finite_or_huge_values_round_as_the_reference(fmt, rounding):
    """rounding._unit and _book compare u < f and dither >= 1 - f with the fraction f not
    clamped to [0, 1]: the same codes and scales as the reference's clamped compare, in blocks
    where one value is NaN or infinite (stored as 0) or huge (every other value then rounds
    at the bottom of the book); one block per value; de8: a searched book."""
    from qstate_cli.kernels.launch import kernel_layout
    from qstate_cli.quant import parse_spec
    spec = parse_spec(f"{fmt}:{rounding}:b{B}")
    bad = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]
    x = torch.rand(len(bad) * B + 7, generator=torch.Generator().manual_seed(3)) * 2.0 - 0.6
    for i, value in enumerate(bad):
        x[i * B + 5 + i] = value  # the block's absmax, or every other element far below it
    assert_cpu_codec_equals_reference(spec, kernel_layout(spec), x, B, book=fmt == "de8")
