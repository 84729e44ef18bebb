"""The replay's Triton codec (kernels/codec.py, diagnose/codec_triton.py) against the
reference QuantizedState, bit for bit: codes, scales and the values read back, on a layout
of several tensors with sampled trace blocks, short last blocks and padding, over three
steps; and the whole replay, whose records must not change with the codec. On CPU the
kernel runs in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from kernel_parity import assert_bits_equal

from qstate_cli.diagnose import codec
from qstate_cli.diagnose.codec_triton import TritonReplayState, triton_state, why_not
from qstate_cli.diagnose.layout import Layout
from qstate_cli.diagnose.step import stream_for
from qstate_cli.diagnose.run import diagnose
from qstate_cli.quant import QuantizedState, parse_config, parse_spec
from qstate_cli.trace.schema import Trace, TraceTensor

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEED = 1234


def _tensor(name, index, numel, blocks, gen, steps=3):
    n = sum(min(2048, numel - b * 2048) for b in blocks)
    return TraceTensor(name, index, (numel,), torch.tensor(blocks), torch.randn(steps, n, generator=gen))


@pytest.fixture(scope="module")
def trace():
    """Three tensors: 5000 elements recorded at trace blocks 0 and 2 (the last one short:
    904 elements), 6000 at block 1 only, and 33 (one short block)."""
    gen = torch.Generator().manual_seed(0)
    return Trace("adamw", {}, SEED, 0, 3, "fp32", [
        _tensor("a", 3, 5000, [0, 2], gen), _tensor("b", 8, 6000, [1], gen), _tensor("c", 11, 33, [0], gen)])


def _values(layout: Layout, gen: torch.Generator) -> torch.Tensor:
    """Heavy-tailed values, a NaN, an Inf, an all-zero block, and 0 at the padding (as the replay keeps it)."""
    x = torch.randn(layout.n, generator=gen) * torch.exp(2 * torch.randn(layout.n, generator=gen))
    x[5], x[700] = float("nan"), -float("inf")
    x[2048: 2048 + 128] = 0.0
    if layout.valid is not None:
        x[~layout.valid.cpu()] = 0.0
    return x.to(layout.device)


def _scale_bits(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.int16) if s.dtype == torch.bfloat16 else s


def assert_codec_parity(layout: Layout, text: str, steps=(1, 2, 7)) -> None:
    spec = parse_spec(text)
    stream = stream_for(layout, spec, SEED, 1)
    fused, why = triton_state(spec, layout, stream, None)
    assert why is None and isinstance(fused, TritonReplayState), why
    ref = QuantizedState(spec, (layout.n,), stream, device=layout.device)
    assert_bits_equal(f"{text} never written", fused.decode(), ref.decode())
    gen = torch.Generator().manual_seed(zlib.crc32(text.encode()))
    for step in steps:
        x = _values(layout, gen)
        ref.encode(x, step)
        fused.encode(x, step)
        assert fused.written == ref.written == step
        assert_bits_equal(f"{text} step {step} codes", fused.codes, ref.codes)
        assert_bits_equal(f"{text} step {step} scales", _scale_bits(fused.scales), _scale_bits(ref.scales))
        want = ref.decode()
        assert_bits_equal(f"{text} step {step} read back", fused.decode(), want)
        assert_bits_equal(f"{text} step {step} read again", fused.decode(), want)  # from the codes
    fused.reset()
    assert fused.written == 0 and not fused.decode().any()


# formats the kernels cover (linear signed / unsigned, code books, the no-zero map), 4 and 8 bits
FORMATS = ["int4:b128", "uint4:b64:sqrt", "de4:b32:sbf16", "lin4nz:b128", "int8:b64", "de8u:b128:sbf16",
           "uint8:b32:sqrt"]


@pytest.mark.triton
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "bred"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_codec_equals_the_reference(trace, fmt, rounding):
    name, *opts = fmt.split(":")
    assert_codec_parity(Layout(trace, 128, DEVICE), ":".join([name, rounding, *opts]))


@pytest.mark.triton
@pytest.mark.parametrize("text", ["int4:stochastic:b64", "de8:bred:b128"])
def test_codec_on_one_rank_s_part_of_the_layout(trace, text):
    """torchrun's element split: a part starts mid-tensor, its keys fold global indices."""
    part = Layout(trace, 128, DEVICE, part=(1, 3))
    assert part.start > 0
    assert_codec_parity(part, text, steps=(4,))


def test_states_without_a_kernel_keep_the_reference_with_the_reason(trace):
    layout = Layout(trace, 128, DEVICE)
    cases = {"e4m3:nearest:tensor": "tensor scale", "e4m3:bred:b128": "no kernel",
             "int8:nearest:b128:sfp16": "FlashOptim"}
    for text, reason in cases.items():
        spec = parse_spec(text)
        state, why = triton_state(spec, layout, stream_for(layout, spec, SEED, 0), None)
        assert state is None and reason in why, (text, why)
    spec = parse_spec("int4:bred:b128")  # a stream that is not the layout's: its keys would be wrong
    assert "not this layout's" in why_not(spec, layout, stream_for(Layout(trace, 128, DEVICE), spec, SEED, 0))
    assert codec.FUSED["cuda"] is not None  # the replay picks the codec on CUDA (conftest: no GPU here)


@pytest.mark.triton
def test_code_books_without_zero_keep_the_reference_for_stochastic_padding(trace):
    """de4nz / de8nz hold no code for 0, so the padding's 0 rounds by random bits, and the
    kernel hashes padding as the block's next elements where LayoutStream draws counter 0:
    on a padded layout the reference stores them (codes differed at ~half the padding
    before); nearest and BReD stay on the codec, exact; without padding so does stochastic."""
    layout = Layout(trace, 128, DEVICE)
    assert layout.valid is not None
    for text in ("de4nz:stochastic:b32", "de8nz:stochastic:b128"):
        spec = parse_spec(text)
        state, why = triton_state(spec, layout, stream_for(layout, spec, SEED, 0), None)
        assert state is None and "no code for 0" in why, (text, why)
    assert_codec_parity(layout, "de4nz:nearest:b32", steps=(2,))
    assert_codec_parity(layout, "de8nz:bred:b128", steps=(2,))
    whole = Trace("adamw", {}, SEED, 0, 3, "fp32", [_tensor("d", 2, 4096, [0, 1], torch.Generator().manual_seed(1))])
    unpadded = Layout(whole, 128, DEVICE)
    assert unpadded.valid is None
    assert_codec_parity(unpadded, "de4nz:stochastic:b32", steps=(2, 3))


def test_without_triton_a_state_no_kernel_covers_says_why(monkeypatch):
    """CUDA without Triton (simulated): a covered state falls back saying Triton is missing,
    a minifloat (bf16) says it has no kernel, not that Triton is missing."""
    import types

    from qstate_cli import kernels
    monkeypatch.setattr(kernels, "_triton_import_error", lambda: "triton is not importable: simulated")
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"))
    assert codec.FUSED["cuda"](parse_spec("int4:nearest:b128"), on_cuda, None, None) == \
        (None, "triton is not importable: simulated")
    state, why = codec.FUSED["cuda"](parse_spec("bf16"), on_cuda, None, None)
    assert state is None and "no kernel" in why and "triton" not in why, why
    assert "tensor scale" in codec.FUSED["cuda"](parse_spec("e4m3:nearest:tensor"), on_cuda, None, None)[1]


def _replay_both(trace, configs, device, monkeypatch=None):
    if monkeypatch is not None:  # on CPU: the Triton codec in the interpreter stands in for the CPU one
        monkeypatch.setitem(codec.FUSED, "cpu", triton_state)
    kw = dict(keep_states=True, device=device)
    ref_doc, ref = diagnose(trace, configs, backend="reference", **kw)
    doc, raw = diagnose(trace, configs, backend="auto", **kw)
    return ref_doc, ref, doc, raw


def _close(a, b, rel: float) -> bool:
    """Equal, floats to `rel` (0: exactly), through nested records."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and rel:
        return a == pytest.approx(b, rel=rel, abs=1e-300, nan_ok=True)
    return a == b or (a != a and b != b)


def _assert_same_replay(ref_doc, ref, doc, raw, configs, rel: float = 0.0):
    for cfg in configs:
        for s in ("m", "v"):
            for a, b in zip(ref.final_states[str(cfg)][s], raw.final_states[str(cfg)][s]):
                assert_bits_equal(f"{cfg} {s} final state", b.cpu(), a.cpu())
    paths = {str(c.cfg): c.codec for c in raw.configs}
    assert all(paths[str(c)][s][0] == "triton" for c in configs for s in ("m", "v")), paths
    # every statistic: exactly on CPU; on CUDA float sums may add in another order (atomics)
    assert _close(ref_doc["records"], doc["records"], rel)


@pytest.mark.triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need Triton's interpreter")
def test_replay_records_do_not_change_with_the_triton_codec(trace, monkeypatch):
    configs = [parse_config(c) for c in ("bred-4bit", "sr-4bit", "bnb-8bit")]
    _assert_same_replay(*_replay_both(trace, configs, "cpu", monkeypatch), configs)


@pytest.mark.triton
@pytest.mark.cuda
def test_replay_on_cuda_goes_through_the_codec_and_records_do_not_change(trace):
    configs = [parse_config(c) for c in ("bred-4bit", "sr-4bit", "nearest-4bit", "bnb-8bit", "torchao-4bit")]
    _assert_same_replay(*_replay_both(trace, configs, "cuda"), configs, rel=1e-9)


PROBE = """
import json, re, sys, numpy as np, torch
from qstate_cli.kernels import codec as kc, fastmath as fm, sass
from qstate_cli.kernels.launch import kernel_layout
from qstate_cli.quant import parse_spec
for text in sys.argv[1:]:
    spec = parse_spec(text); lay = kernel_layout(spec); n = 1 << 16; nb = n // spec.block
    rec = sass._Recorder(kc._codec_kernel); kc._codec_kernel = rec
    try:
        kc.encode_decode(torch.zeros(n), torch.zeros(n), torch.zeros(n * spec.fmt.bits // 8, dtype=torch.uint8),
                         torch.zeros(nb, dtype=torch.int16 if lay.sbf16 else torch.float32),
                         torch.zeros(nb, dtype=torch.int32), torch.zeros(nb, dtype=torch.int32), lay, 3,
                         interpret=False, table=lay.table("cpu"))
    finally:
        kc._codec_kernel = rec.jit
    try:
        ptx = sass.compile_kernel(rec.jit, rec.calls[0], 90).asm["ptx"]
    except Exception as exc:
        from triton.compiler.errors import CompilationError
        if isinstance(exc, CompilationError):
            raise
        print(json.dumps({"unavailable": f"{type(exc).__name__}: {exc}"}))
        continue
    bad = len(re.findall(r"div\\.(full|approx)|sqrt\\.approx", ptx))
    # fastmath.div_top's FMAs are not contractions: fma(-q, TOP, a) and fma(e, rn(1/TOP), q),
    # Markstein's exact division. Triton 3.9 folds the negation into the multiplier, -TOP;
    # 3.6 and 3.7 negate q (neg.f32, or 0 - q: sub.rn.f32 from a zero) and multiply by +TOP
    spell = lambda x: "0f%08X" % int(np.array(x, dtype=np.float32).view(np.uint32))
    folded = {spell(c) for d, r in fm.RECIP.value.items() for c in (-d, r)}
    tops = {spell(d) for d in fm.RECIP.value}
    zeros = {"0f00000000", "0f80000000"} | set(re.findall(r"mov\\.b32\\s+(%\\w+),\\s*0f[08]0000000;", ptx))
    negated = set(re.findall(r"neg\\.f32\\s+(%\\w+),", ptx)) | {
        n for n, z in re.findall(r"sub\\.rn\\.f32\\s+(%\\w+),\\s*([^,]+),", ptx) if z.strip() in zeros}
    fmas = [(x.strip(), c.strip()) for x, c in re.findall(r"fma\\.rn\\.f32\\s+[^,]+,\\s*([^,]+),\\s*([^,]+),", ptx)]
    print(json.dumps({"spec": text, "fma": sum(not (c in folded or (c in tops and x in negated)) for x, c in fmas),
                      "ftz": len(re.findall(r"\\.ftz\\b", ptx)), "div_rn": ptx.count("div.rn.f32"), "bad": bad}))
"""


def test_codec_kernel_compiles_for_sm90_without_fma_or_flush_to_zero():
    """What the interpreter cannot show: the kernel compiles for a GPU (one return type per
    function, ...) and rounds as the reference (no FMA but fastmath.div_top's exact division
    by a format's top, no flushed subnormals, true division)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    specs = ["uint4:stochastic:b128:sqrt", "de4:bred:b32:sbf16", "lin4nz:bred:b128", "int8:nearest:b256"]
    out = subprocess.run([sys.executable, "-c", PROBE, *specs], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if all("unavailable" in r for r in rows):
        pytest.skip(f"Triton cannot compile for CUDA here: {rows[0]['unavailable']}")
    assert len(rows) == len(specs)
    for r in rows:
        assert r["fma"] == 0 and r["ftz"] == 0 and r["bad"] == 0 and r["div_rn"] > 0, r
