"""The CPU path's closed-form rounding onto the no-zero linear code books {1, ..., UNIT} / UNIT
(lin4nz, lin8nz: v of every 4- and 8-bit preset; kernels/cpu/rounding._unit) against the
reference quantizer, bit for bit: on every code's value, the midpoints between codes (the
ties nearest rounding sends up), one ulp either side of both, below the first code (the
clamp at k = 0), at and beyond the top (the clamp at k = NT - 2), zeros and negatives, with
blocks whose n is exact (absmax = top) and not (absmax = 3 / 1.7), for every rounding.

The kernels compute (n - lo) * UNIT as n * UNIT - t with t = k + 1 (rounding._unit_t); this is
where a difference in the last bit of either would show. Skipped where numba is not
installed; each layout compiles a small helper (seconds)."""
import numpy as np
import pytest
import torch

from qstate_cli.kernels import cpu
from test_kernels_cpu_minifloat import B, _codec_for

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")


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
    from qstate_cli.kernels.launch import kernel_layout, stream_key
    from qstate_cli.quant import parse_spec
    from qstate_cli.quant.quantizer import Stream, decode, encode
    spec = parse_spec(f"{book}:{rounding}:b{B}")
    lay, lim, tab = host.layout_arrays(kernel_layout(spec), None)
    unit = 16 if book == "lin4nz" else 256
    assert lay[UNIT] == unit  # the closed form, not the searched book
    x = crafted(unit)
    numel = x.numel() - 3  # a short last block
    x = x[:numel]
    stream, step, written = Stream(seed=3, tensor_id=1, state_id=1), 5, 5
    want_codes, want_scales = encode(x, spec, step, stream)
    key = stream_key(3, 1, 1)
    keys = np.array(host.keys(key, step) + host.keys(key, written), np.uint32)
    codes = np.zeros(want_codes.numel(), np.uint8)
    s16 = np.zeros(want_scales.numel() * want_scales.element_size() // 2, np.uint16)
    out = np.zeros(numel, np.float32)
    _codec_for(lay, B)(x.numpy(), lim, tab, keys, codes, s16, out, np.zeros(B, np.int32), np.zeros(B, np.float32))
    assert torch.equal(torch.from_numpy(codes), want_codes)
    assert torch.equal(torch.from_numpy(s16).view(want_scales.dtype), want_scales)
    want = decode(want_codes, want_scales, spec, numel, written, stream)
    assert torch.equal(torch.from_numpy(out).view(torch.int32), want.view(torch.int32))
    # the crafted values reach both clamps and every code
    from qstate_cli.quant.packing import unpack
    got = unpack(want_codes, spec.fmt.bits, numel)
    assert int(got.min()) == 0 and int(got.max()) == unit - 1
