"""Helpers of the kernel tests (tests/test_kernels_*.py): run the reference optimizer and
the kernel path side by side on the same parameters and gradients, and compare bits."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so -0.0 != 0.0 and NaN == NaN, as 'bit for bit' means)."""
    t = t.detach()
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def assert_bits_equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, else fail naming the first mismatching flat indices."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs reference {want.dtype}{tuple(want.shape)}"
    diff = (bits(got) != bits(want)).reshape(-1)
    if diff.any():
        idx = diff.nonzero().flatten()[:8]
        g, w = got.reshape(-1)[idx].tolist(), want.reshape(-1)[idx].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} differ; first at {idx.tolist()}: "
                             f"kernel {g} vs reference {w}")


def make_pair(cls, shapes, dtype=torch.float32, seed=0, backend="triton", device=None, **kw):
    """Two optimizers of class `cls` on equal parameters: (reference, `backend` path)."""
    device = device or DEVICE
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    ref_params = [torch.nn.Parameter(w.clone().to(device)) for w in init]
    ker_params = [torch.nn.Parameter(w.clone().to(device)) for w in init]
    kw = dict(dict(min_quant_numel=0, seed=11), **kw)
    return cls(ref_params, backend="reference", **kw), cls(ker_params, backend=backend, **kw)


def step_both(ref, ker, gen: torch.Generator, scale: float = 1.0, poison: bool = False) -> None:
    """One step of both with the same fresh gradients (poison: a NaN, +Inf, -Inf in each)."""
    for a, b in zip(_params(ref), _params(ker)):
        g = (torch.randn(a.shape, generator=gen) * scale).to(a.dtype)
        if poison and g.numel() >= 3:
            g.view(-1)[[0, g.numel() // 2, g.numel() - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(g.dtype)
        a.grad, b.grad = g.to(a.device), g.clone().to(b.device)
    ref.step()
    ker.step()


def assert_same_state(ref, ker, step: int = -1) -> None:
    """Parameters, codes, scales and counters of the two optimizers are equal bit for bit."""
    for i, (a, b) in enumerate(zip(_params(ref), _params(ker))):
        assert ker.path_for(b) != "reference", f"param {i} was not stepped by the kernels: {ker.why_reference(b)}"
        assert_bits_equal(f"step {step} param {i} {tuple(a.shape)}", b, a)
        sa, sb = ref.state[a], ker.state[b]
        for name in ref.state_names:
            for part in sa[name]:
                assert_bits_equal(f"step {step} param {i} {name}.{part}", sb[name][part], sa[name][part])
        for key in ("step", "since_reset", "nonfinite"):
            assert int(sa[key]) == int(sb[key]), f"param {i} {key}: {int(sb[key])} vs {int(sa[key])}"


def run_parity(cls, states: str, shapes, dtype=torch.float32, steps: int = 3, poison_step: int = 2,
               seed: int = 0, **kw):
    """Step both paths `steps` times and compare after every step (kw: make_pair's backend,
    device and the optimizer's arguments)."""
    ref, ker = make_pair(cls, shapes, dtype, seed=seed, states=states, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    for t in range(1, steps + 1):
        step_both(ref, ker, gen, poison=(t == poison_step))
        assert_same_state(ref, ker, t)
    return ref, ker


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def run_compile_probe(script: str, timeout: int) -> list[dict]:
    """The JSON lines a probe script under tests/ prints, run in a subprocess with Triton
    compiling for CUDA (TRITON_INTERPRET unset; no GPU needed): test_kernels_ptx.py's and
    test_kernels_fastmath.py's SASS/PTX probes."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(root / "tests" / script)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _codec_for(lay: tuple, block: int):
    """A numba helper for the CPU codec (kernels/cpu/codec.py): encode_block + pack_codes over
    every block of x, then read_state (decode_block) of the codes and scales."""
    from numba import njit
    from qstate_cli.kernels.cpu import codec as c

    @njit(error_model="numpy")
    def run(x, lim, table, keys, codes, s16, out, q, row):
        numel = x.size
        nb = (numel + block - 1) // block
        for b in range(nb):
            start = b * block
            cnt = min(block, numel - start)
            for j in range(cnt):
                row[j] = x[start + j]
            scale = c.encode_block(row, cnt, lay, lim, table, b, start, keys[0], keys[1], False, q)
            c.store_scale(s16, b, scale, lay[c.SBF16] != 0)
            c.pack_codes(q, lay[c.BITS], start, cnt, codes)
        for b in range(nb):
            start = b * block
            cnt = min(block, numel - start)
            c.read_state(False, codes, s16, lay[c.SBF16] != 0, lay, lim, table, b, start, cnt, keys[2], keys[3],
                         q, row)
            for j in range(cnt):
                out[start + j] = row[j]
    return run


def assert_cpu_codec_equals_reference(spec, kl, x: torch.Tensor, block: int, book: bool = False) -> None:
    """The CPU codec (layout kl of spec) encodes the fp32 tensor x into the reference's codes
    and scales (quant/quantizer.encode, at step 9 of a fixed stream) and reads back the
    reference's decode (the state written at step 7), bit for bit. book: kl is a searched code
    book, whose table the codec takes."""
    import numpy as np
    from qstate_cli.kernels.cpu import host
    from qstate_cli.kernels.launch import stream_key
    from qstate_cli.quant.quantizer import Stream, decode, encode
    lay, lim, tab = host.layout_arrays(kl, kl.table(torch.device("cpu")) if book else None)
    numel = x.numel()
    stream, step, written = Stream(seed=5, tensor_id=2, state_id=1), 9, 7
    want_codes, want_scales = encode(x, spec, step, stream)
    key = stream_key(5, 2, 1)
    keys = np.array(host.keys(key, step) + host.keys(key, written), np.uint32)
    codes = np.zeros(want_codes.numel(), np.uint8)
    s16 = np.zeros(want_scales.numel() * want_scales.element_size() // 2, np.uint16)
    out = np.zeros(numel, np.float32)
    _codec_for(lay, block)(x.numpy(), lim, tab, keys, codes, s16, out, np.zeros(block, np.int32),
                           np.zeros(block, np.float32))
    assert torch.equal(torch.from_numpy(codes), want_codes)
    assert torch.equal(torch.from_numpy(s16).view(want_scales.dtype), want_scales)
    want = decode(want_codes, want_scales, spec, numel, written, stream)
    assert torch.equal(torch.from_numpy(out).view(torch.int32), want.view(torch.int32))
