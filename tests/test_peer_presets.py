"""The peer presets `te-fp8` and `flashoptim-8bit` store what their peers store.

FlashOptim (installed as `flashoptim`): its own Triton quantize / dequantize kernels run
in Triton's interpreter on the same input, and our codes, fp16 scales and read-back values
must equal theirs bit for bit. Transformer Engine needs a CUDA build: where it is
importable its Float8Quantizer is compared; everywhere, our per-tensor E4M3 codes equal
torch's own float8_e4m3fn cast of x * (1 / (absmax / 448)), the recipe of TE's FusedAdam.
"""
import pytest
import torch

from qstate_cli.kernels import launch
from qstate_cli.quant import Stream, decode, encode, parse_config
from qstate_cli.quant.state import QuantizedState

N = 1000  # not a multiple of 32: a short last group


def _inputs():
    g = torch.Generator().manual_seed(12)
    m = torch.randn(N, generator=g) * torch.logspace(-6, 1, N)[torch.randperm(N, generator=g)]
    v = (torch.randn(N, generator=g) * 1e-2) ** 2
    v[:40] = 0.0  # a whole all-zero group and a partial one
    return m, v


def _flashoptim():
    fo = pytest.importorskip("flashoptim.optimizers", reason="FlashOptim is not installed")
    if launch.interpreting() or torch.cuda.is_available():
        return fo
    pytest.skip("FlashOptim's kernels need a GPU or TRITON_INTERPRET=1 set before triton is imported")


def _fo_quantize(fo, x, signed, sqrt, softsign):
    """FlashOptim's own quantize kernel; its autotuner needs a GPU driver, so the kernel is
    launched directly with one of its configurations (BLOCK_SIZE_N = 256)."""
    import triton.language as tl

    q = torch.empty_like(x, dtype=torch.int8 if signed else torch.uint8)
    scales = torch.empty(-(-x.numel() // 32), dtype=torch.float16, device=x.device)
    fo._triton_quantize_kernel.fn[(-(-x.numel() // 256),)](
        x, q, scales, x.numel(), 127.0 if signed else 255.0, tl.int8 if signed else tl.uint8,
        32, sqrt, softsign, BLOCK_SIZE_N=256)
    return q, scales


def _fo_dequantize(fo, q, scales, signed, sqrt, softsign):
    out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    fo._triton_dequantize_kernel.fn[(-(-q.numel() // 256),)](
        q, scales, out, q.numel(), 127.0 if signed else 255.0, 32, sqrt, softsign, BLOCK_SIZE_N=256)
    return out


@pytest.mark.parametrize("state", ["m", "v"])
def test_flashoptim_codes_scales_and_values_equal_flashoptims_own(state):
    fo = _flashoptim()
    cfg = parse_config("flashoptim-8bit")
    spec = cfg.spec(state)
    x = _inputs()[0 if state == "m" else 1]
    signed, sqrt, softsign = state == "m", state == "v", state == "m"
    theirs, their_scales = _fo_quantize(fo, x, signed, sqrt, softsign)
    ours, our_scales = encode(x, spec, 1, Stream())
    ours_as_theirs = ours.view(torch.int8) if signed else ours
    bad = (ours_as_theirs != theirs).nonzero().flatten()[:5].tolist()
    assert not bad, f"codes differ at {bad}: ours {ours_as_theirs[bad].tolist()} theirs {theirs[bad].tolist()}"
    assert our_scales.dtype == torch.float16 and torch.equal(our_scales, their_scales)
    back = _fo_dequantize(fo, theirs, their_scales, signed, sqrt, softsign)
    assert torch.equal(decode(ours, our_scales, spec, N, 1, Stream()), back)


def test_te_fp8_codes_equal_torchs_e4m3_cast_of_tes_recipe():
    spec = parse_config("te-fp8").m
    x = _inputs()[0]
    ours, scale = encode(x, spec, 1, Stream())
    s = x.abs().max() / 448.0
    theirs = (x * (1.0 / s)).to(torch.float8_e4m3fn)
    assert scale.shape == (1,) and scale.dtype == torch.float32
    assert torch.equal(ours, theirs.view(torch.uint8))
    assert torch.equal(decode(ours, scale, spec, N, 1, Stream()), theirs.float() * (1.0 / (1.0 / s)))
    zeros, zscale = encode(torch.zeros(7), spec, 1, Stream())
    assert torch.equal(decode(zeros, zscale, spec, 7, 1, Stream()), torch.zeros(7))


def test_te_fp8_codes_equal_transformer_engines_own():
    te = pytest.importorskip("transformer_engine.pytorch.tensor.float8_tensor",
                             reason="Transformer Engine is not installed (it needs a CUDA build)")
    tex = pytest.importorskip("transformer_engine_torch")
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine's FP8 cast runs on CUDA only")
    x = _inputs()[0].cuda()
    s = x.abs().max().reshape(1) / 448.0
    quantizer = te.Float8Quantizer(scale=1.0 / s, amax=torch.zeros(1, device="cuda"),
                                   fp8_dtype=tex.DType.kFloat8E4M3)
    theirs = quantizer(x)
    ours, _ = encode(x, parse_config("te-fp8").m, 1, Stream())
    assert torch.equal(ours, theirs._data)


def test_peer_presets_parse_print_and_count_their_bytes():
    te, fo = parse_config("te-fp8"), parse_config("flashoptim-8bit")
    assert te.canonical() == "m=e4m3:nearest:tensor,v=e4m3:nearest:tensor"
    assert fo.canonical() == "m=int8:nearest:b32:softsign:sfp16,v=uint8:nearest:b32:sqrt:sfp16"
    assert parse_config(fo.canonical()).name == "flashoptim-8bit"
    # FlashOptim: 1 byte + one fp16 scale per 32 = 1.0625 B per state; TE: 1 byte + 4 per tensor
    assert fo.m.bytes_per_element() == fo.v.bytes_per_element() == 1 + 2 / 32
    st = QuantizedState(te.m, (37, 29))
    st.encode(torch.randn(37, 29), 1)
    assert st.nbytes == st.expected_nbytes() == 37 * 29 + 4
    st = QuantizedState(fo.v, (37, 29))
    st.encode(torch.rand(37, 29), 1)
    assert st.nbytes == st.expected_nbytes() == 37 * 29 + 2 * -(-37 * 29 // 32)


@pytest.mark.parametrize("text, words", [
    ("int8:b32:tensor", "either block scales"), ("int8:tensor", "needs block scales"),
    ("e4m3:softsign", "block-scaled linear"), ("uint8:b32:softsign", "signed"),
])
def test_peer_options_refuse_what_they_cannot_mean(text, words):
    from qstate_cli.errors import QstateError
    with pytest.raises(QstateError, match=words):
        parse_config(text)


def test_kernels_leave_peer_recipes_to_the_reference():
    fo = parse_config("flashoptim-8bit")
    assert "FlashOptim" in launch.why_not_covered(fo.m)
    assert launch.why_not_covered(parse_config("te-fp8").m) is not None


@pytest.mark.parametrize("preset", ["te-fp8", "flashoptim-8bit"])
def test_optimizer_steps_peer_presets_and_their_state_round_trips(preset):
    """The reference optimizer steps with the peers' states close to fp32 AdamW on a smooth
    problem, and a state_dict saved with weights_only=True restores the same next step."""
    import io

    from qstate_cli.optim import AdamW

    torch.manual_seed(0)
    target = torch.randn(64, 48)

    def run(opt_fn, steps, w=None):
        w = torch.nn.Parameter(torch.zeros(64, 48) if w is None else w.clone())
        opt = opt_fn([w])
        for _ in range(steps):
            opt.zero_grad()
            ((w - target) ** 2).sum().backward()
            opt.step()
        return w, opt

    w, opt = run(lambda p: AdamW(p, lr=1e-2, states=preset, min_quant_numel=0, backend="reference"), 20)
    ref, _ = run(lambda p: torch.optim.AdamW(p, lr=1e-2), 20)
    assert torch.isfinite(w).all()
    # E4M3 keeps 3 fraction bits: a stored m or v is off by up to 2**-4 of itself, so an
    # update m / sqrt(v) by up to ~(1 + 2**-4) / (1 - 2**-4) ** 0.5 - 1 = 9.5%
    assert (w - ref).norm() < 0.1 * ref.norm()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = AdamW([w2], lr=1e-2, states=preset, min_quant_numel=0, backend="reference")
    opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for o, p in ((opt, w), (opt2, w2)):
        o.zero_grad()
        ((p - target) ** 2).sum().backward()
        o.step()
    assert torch.equal(w, w2)
