"""The no-zero linear maps (lin4nz, lin8nz: entries (j + 1) / NT) are computed in the kernels
instead of loaded from the table (codes.py, NOZERO). The state codec alone, on values
chosen to sit on, between and one ulp either side of the grid points and its midpoints,
with tiny, zero-step and non-power-of-two block scales, against the reference quantizer
(quant/quantizer.py), bit for bit, for every rounding, with and without masks."""
import pytest
import torch
import triton
import triton.language as tl

from kernel_parity import DEVICE, assert_bits_equal
from qstate_cli.kernels import codes as cd
from qstate_cli.kernels import common as c
from qstate_cli.kernels import memory as mem
from qstate_cli.kernels.launch import ROUNDING_CODES, as_int32, kernel_layout
from qstate_cli.quant import parse_spec
from qstate_cli.quant.quantizer import Stream, decode, encode

B, ROWS = 128, 4


@triton.jit
def _codec(x_ptr, codes_ptr, scales_ptr, stored_ptr, stored_scales_ptr, out_ptr, table_ptr, rem,
           k1, k2, w1, w2, KIND: tl.constexpr, BITS: tl.constexpr, NT: tl.constexpr, ROUND: tl.constexpr,
           B: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr):
    """Encode x (step keys k1, k2) into codes/scales; decode stored (written with w1, w2) to out."""
    loc, mask = mem.tile(rem, B, B, ROWS)
    row0 = tl.program_id(0).to(tl.int64)  # 0: one program
    x = tl.load(x_ptr + loc, mask=mask, other=0.0)
    k1u, k2u = k1.to(tl.uint32, bitcast=True), k2.to(tl.uint32, bitcast=True)
    w1u, w2u = w1.to(tl.uint32, bitcast=True), w2.to(tl.uint32, bitcast=True)
    FMT: tl.constexpr = c.Format(KIND, BITS, False, 1.0, NT, ROUND, False, False)  # unsigned, TOP 1, fp32 scales
    cd.encode_state(x, codes_ptr, scales_ptr, table_ptr, rem, row0, k1u, k2u, FMT, False, B, B, ROWS, MASKED)
    val = cd.decode_state(stored_ptr, stored_scales_ptr, table_ptr, rem, row0, w1u, w2u, FMT, False, B, B, ROWS, MASKED)
    tl.store(out_ptr + loc, val, mask=mask)


def crafted(nt: int) -> torch.Tensor:
    """ROWS blocks of B values: grid points j/NT, midpoints, each +-1 ulp, tiny values and 0,
    scaled by a block absmax of 1, 3, 2**-125 (a step below 2**-126 reads 0) and 1e-20."""
    grid = torch.arange(nt + 1, dtype=torch.float32) / nt
    mids = (torch.arange(nt, dtype=torch.float32) + 0.5) / nt
    pts = torch.cat([grid, mids])
    up = torch.nextafter(pts, torch.tensor(2.0))
    down = torch.nextafter(pts, torch.tensor(-1.0)).clamp(min=0)
    vals = torch.cat([pts, up, down, torch.tensor([1e-30, 1e-40, 0.0, 1.0])])
    vals = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(0))]
    blocks = []
    for i, scale in enumerate((1.0, 3.0, 2.0 ** -125, 1e-20)):
        v = vals[(torch.arange(B) * 7 + i * 13) % vals.numel()].clone()
        v[i] = 1.0  # the block's absmax is `scale` itself
        blocks.append((v * scale).clamp(max=scale))
    return torch.stack(blocks).reshape(-1)


@pytest.mark.parametrize("fmt", ["lin4nz", "lin8nz"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "bred"])
@pytest.mark.parametrize("numel", [ROWS * B, ROWS * B - 77])
def test_nozero_codec_equals_the_reference(fmt, rounding, numel):
    spec = parse_spec(f"{fmt}:{rounding}:b{B}")
    lay = kernel_layout(spec)
    assert lay.kind == 2 and lay.table(DEVICE) is None  # computed, no table
    x = crafted(lay.table_len)[:numel].to(DEVICE)
    stream, step = Stream(seed=5, tensor_id=2, state_id=1), 9
    want_codes, want_scales = encode(x, spec, step, stream)
    stored, stored_scales = encode(x * 0.7, spec, step - 1, stream)
    want_out = decode(stored, stored_scales, spec, numel, step - 1, stream)
    codes, scales = torch.zeros_like(want_codes), torch.zeros_like(want_scales)
    out = torch.zeros(numel, device=DEVICE)
    k1, k2 = stream.keys(step)
    w1, w2 = stream.keys(step - 1)
    _codec[(1,)](x, codes, scales, stored, stored_scales, out, scales, numel,
                 as_int32(k1), as_int32(k2), as_int32(w1), as_int32(w2), KIND=2, BITS=lay.bits,
                 NT=lay.table_len, ROUND=ROUNDING_CODES[rounding], B=B, ROWS=ROWS, MASKED=numel < ROWS * B)
    assert_bits_equal("codes", codes, want_codes)
    assert_bits_equal("scales", scales, want_scales)
    assert_bits_equal("decoded", out, want_out)
