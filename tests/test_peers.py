"""Our DE code books and nearest-rounded codes equal bitsandbytes' and torchao's.

Runs where the optional extra `qstate-cli[peers]` is installed; skips cleanly otherwise.
"""
import pytest
import torch

from qstate_cli.quant import Stream, encode, parse_spec
from qstate_cli.quant.codebooks import codebook
from qstate_cli.quant.packing import unpack


def _codes(x, text):
    spec = parse_spec(text)
    storage, scales = encode(x, spec, 1, Stream())
    return unpack(storage, spec.bits, x.numel()), scales


def test_codebooks_equal_torchao():
    qu = pytest.importorskip("torchao.optim.quant_utils")
    assert tuple(qu.create_dynamic_map(True, 3, 4)) == codebook("de4")
    assert tuple(qu.create_dynamic_map(True, 7, 8)) == codebook("de8")
    assert tuple(qu.create_dynamic_map(False, 7, 8)) == codebook("de8u")
    assert tuple(torch.linspace(0, 1, 17)[1:].tolist()) == codebook("lin4nz")


@pytest.mark.parametrize("signed", [True, False])
def test_codebooks_equal_bitsandbytes(signed):
    F = pytest.importorskip("bitsandbytes.functional")
    ours = codebook("de8" if signed else "de8u")
    assert tuple(F.create_dynamic_map(signed=signed).tolist()) == ours


def test_4bit_codes_equal_torchao():
    qu = pytest.importorskip("torchao.optim.quant_utils")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128 * 64, generator=g)
    ours, scales = _codes(x, "de4:nearest:b128")
    scaled, scale = qu.scale_tensor(x, 128)
    theirs = qu.quantize_4bit_with_qmap(scaled, torch.tensor(codebook("de4")))
    assert torch.equal(scales, scale)
    assert torch.equal(ours, theirs.to(torch.int32))
    v = x.abs()
    ours_v, _ = _codes(v, "lin4nz:nearest:b128")
    theirs_v = qu.quantize_4bit_with_qmap(qu.scale_tensor(v, 128)[0], torch.tensor(codebook("lin4nz")))
    assert torch.equal(ours_v, theirs_v.to(torch.int32))


def test_8bit_codes_equal_torchao():
    qu = pytest.importorskip("torchao.optim.quant_utils")
    x = torch.randn(256 * 64, generator=torch.Generator().manual_seed(1))
    ours, _ = _codes(x, "de8:nearest:b256")
    theirs = qu.quantize_8bit_with_qmap(qu.scale_tensor(x, 256)[0], torch.tensor(codebook("de8")))
    assert torch.equal(ours, theirs.to(torch.int32))


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_codes_match_bitsandbytes(signed):
    F = pytest.importorskip("bitsandbytes.functional")
    x = torch.randn(256 * 64, generator=torch.Generator().manual_seed(2))
    if not signed:
        x = x.abs()
    code = F.create_dynamic_map(signed=signed)
    try:
        theirs, state = F.quantize_blockwise(x, code=code, blocksize=256)
    except Exception as exc:  # noqa: BLE001 - some bnb builds have no CPU blockwise kernel
        pytest.skip(f"bitsandbytes blockwise quantization unavailable here: {exc}")
    ours, scales = _codes(x, "de8:nearest:b256" if signed else "de8u:nearest:b256")
    theirs = theirs.to(torch.int32)
    torch.testing.assert_close(scales, state.absmax.float())
    # bitsandbytes' native blockwise kernel is approximate: on ~0.2% of elements it picks
    # the farther of the two neighbouring codes. Ours is always a nearest code, and the
    # codes agree everywhere else.
    n = (x.view(-1, 256) / scales[:, None]).reshape(-1)
    d_ours = (n - code[ours.long()]).abs()
    d_theirs = (n - code[theirs.long()]).abs()
    assert torch.all(d_ours <= d_theirs)
    assert (ours == theirs).float().mean() > 0.99
    # bitsandbytes' pure-torch reference semantics (nearest by code midpoints) agree exactly
    midpoints = (code[:-1] + code[1:]) / 2
    assert torch.equal(ours, torch.bucketize(n, midpoints).to(torch.int32))
