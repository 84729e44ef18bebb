"""Encode and decode one state tensor: the reference every kernel must equal bit for bit.

encode(x):                                   (all fp32; `/` and sqrt correctly rounded
                                              on every device: see sqrt_rn, div_scalar)
  1. non-finite values are stored as 0 (policy; the optimizers count them in gradients)
  2. sqrt domain: x <- sqrt(max(x, 0));  unsigned formats: x <- max(x, 0)
  3. block scaling: absmax per block (bf16 scales: rounded up); a block with
     absmax < top * 2**-126 (a subnormal step, absmax < ~1e-36; or all zero) has step 0
     and reads back as 0; otherwise the step (decode) is delta = absmax / top and
     n = x * (top / absmax): one division per block, not per element (as bitsandbytes);
     unscaled: n = x
  4. linear formats: q = rint(n + d) (fp32 add, then round half to even), with
       nearest     d = 0
       stochastic  d = u_i - 1/2                    u_i per element  (counter = index i)
       bred        d = u_b - 1/2                    u_b per block    (counter = block b)
     (BRIEF §2: q = round(x/delta + u), u ~ U[-1/2, 1/2); P(round up) = the position
     of n between its neighbours, up to fp32 rounding of n + d)
  5. other formats: floor ordinal k and position frac of n (formats.py; for signed
     floats on |n|); rounding picks r in {0, 1} and q = k + r:
       nearest     r = frac > 1/2, ties to even q   (tables: n - lo >= (hi - lo)/2)
       stochastic  r = u_i < frac
       bred        r = u_b >= 1 - frac
  6. q is clamped to the code range
decode(q):
  t = q (bred: t = q - d, d = u_b - 1/2, replayed from the step the state was written;
  for non-linear formats evaluated as the integer k and fraction f of t, exactly)
  x_hat = value(t) * delta  (signed floats: sign applied to the magnitude), then squared
  in the sqrt domain.

Random numbers: hash.uniform over stream (seed, tensor_id, state_id, step). Counters are
global: element counter = stream.offset + i, block counter = stream.offset // B + b, where
`offset` is the flat index of x's first element in the whole tensor (0 unless x is one
rank's shard of a sharded parameter, optim/sharding.py). A shard that starts and ends on
block boundaries therefore draws exactly the bits the whole tensor draws for its blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import hash as qhash
from .config import StateSpec
from .packing import pack, to_blocks, unpack


@dataclass(frozen=True)
class Stream:
    """Identity of a random stream: which seed, tensor and state (0 = m, 1 = v), and the
    flat index in the whole tensor of the first element it covers (`offset`, see the
    module docstring: non-zero only for a shard of a sharded parameter)."""

    seed: int = 0
    tensor_id: int = 0
    state_id: int = 0
    offset: int = 0

    def keys(self, step: int) -> tuple[int, int]:
        return qhash.stream_keys(self.seed, self.tensor_id, self.state_id, step)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (torch's vectorised CPU sqrt is not; CUDA's is)."""
    if x.is_cuda:
        return torch.sqrt(x)
    return torch.sqrt(x.double()).float()


def div_scalar(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c, correctly rounded on every device. (On CUDA, `tensor / python_number` is
    computed as `tensor * (1 / c)`, which can differ in the last bit; a tensor divisor
    keeps the true division, as the kernels' `div_rn` does.)"""
    return x / torch.full_like(x, c)


MIN_STEP = 2.0 ** -126  # smallest normal fp32: blocks with a smaller (subnormal) step read 0


def scaled(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """Blocks that are quantized at all: absmax >= top * 2**-126 (exact comparison)."""
    return absmax >= top * MIN_STEP


def step_of(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """delta = absmax / top (true fp32 division), 0 in blocks that are not scaled()."""
    return torch.where(scaled(absmax, top), div_scalar(absmax, top), torch.zeros((), device=absmax.device))


def normalize(xb: torch.Tensor, absmax: torch.Tensor, top: float) -> torch.Tensor:
    """n = x * (top / absmax) per block row (one true fp32 division per block), 0 in
    blocks that are not scaled()."""
    ok = scaled(absmax, top)
    safe = torch.where(ok, absmax, torch.ones((), device=absmax.device))
    inv = torch.where(ok, torch.full_like(safe, top) / safe, torch.zeros((), device=safe.device))
    return xb * inv[:, None]


def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest bf16 value >= x (x >= 0), returned in fp32."""
    bits = x.view(torch.int32)
    down = bits & ~0xFFFF
    up = torch.where((bits & 0xFFFF) != 0, down + 0x10000, down)
    return up.view(torch.float32)


def _block_scale(xb: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    absmax = xb.abs().amax(dim=1)
    if spec.scale_dtype == "bf16":
        absmax = bf16_round_up(absmax)
    return absmax


def _uniform_elements(stream: Stream, step: int, shape, device) -> torch.Tensor:
    n = shape[0] * shape[1]
    counter = torch.arange(n, device=device) + stream.offset
    return qhash.uniform(stream.keys(step), counter).view(shape)


def _uniform_blocks(stream: Stream, step: int, nblocks: int, block: int, device) -> torch.Tensor:
    counter = torch.arange(nblocks, device=device) + stream.offset // block
    return qhash.uniform(stream.keys(step), counter)


def encode(x: torch.Tensor, spec: StateSpec, step: int, stream: Stream = Stream()):
    """Quantize x (any shape) -> (storage, scales or None). See module docstring."""
    fmt = spec.fmt
    x = x.detach().reshape(-1).to(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.zeros((), device=x.device))
    if spec.sqrt:
        x = sqrt_rn(x.clamp(min=0.0))
    if fmt.kind == "identity":
        return x.clone(), None
    if not fmt.signed:
        x = x.clamp(min=0.0)
    numel = x.numel()
    xb = to_blocks(x, spec.dither_block)  # [nblocks, B]
    absmax = None
    if spec.scaled:
        absmax = _block_scale(xb, spec)
        n = normalize(xb, absmax, spec.fmt.top)
    else:
        n = xb
    is_float = fmt.kind == "float"
    if fmt.kind == "linear":
        if spec.rounding == "stochastic":
            n = n + (_uniform_elements(stream, step, n.shape, x.device) - 0.5)
        elif spec.rounding == "bred":
            n = n + (_uniform_blocks(stream, step, n.shape[0], spec.dither_block, x.device)[:, None] - 0.5)
        q = torch.round(n).to(torch.int32)  # half to even
        return _store(q, fmt, spec, absmax, numel, signbit=None)
    k, frac = fmt.floor_frac(n)
    if spec.rounding == "nearest":
        if fmt.kind == "table":
            lo, hi = fmt.code_value(k), fmt.code_value(k + 1)
            up = (n - lo) >= (hi - lo) * 0.5
        else:
            up = (frac > 0.5) | ((frac == 0.5) & ((k & 1) == 1))
    elif spec.rounding == "stochastic":
        up = _uniform_elements(stream, step, n.shape, x.device) < frac
    else:  # bred
        u = _uniform_blocks(stream, step, n.shape[0], spec.dither_block, x.device)[:, None]
        up = u >= (1.0 - frac)
    q = k + up.to(torch.int32)
    return _store(q, fmt, spec, absmax, numel, signbit=torch.signbit(n) if is_float and fmt.signed else None)


def _store(q, fmt, spec: StateSpec, absmax, numel: int, signbit):
    """Clamp codes to the format's range, add the sign bit of signed floats (or reduce
    signed linear codes to two's complement), pack; scales as stored."""
    lo_code, hi_code = fmt.code_range
    q = q.clamp(lo_code, hi_code)
    if signbit is not None:
        q = q | (signbit.to(torch.int32) << (fmt.bits - 1))
    elif fmt.kind == "linear" and fmt.signed:
        q = q & ((1 << fmt.bits) - 1)
    storage = pack(q.reshape(-1)[:numel], fmt.bits)
    if absmax is not None and spec.scale_dtype == "bf16":
        absmax = absmax.to(torch.bfloat16)  # exact: rounded up to a bf16 value above
    return storage, absmax


def decode(storage: torch.Tensor, scales: torch.Tensor | None, spec: StateSpec, numel: int,
           step: int, stream: Stream = Stream()) -> torch.Tensor:
    """Dequantize to a flat fp32 tensor of numel values."""
    fmt = spec.fmt
    if fmt.kind == "identity":
        x = storage.to(torch.float32)
    else:
        codes = unpack(storage, fmt.bits, numel)
        neg = None
        if fmt.kind == "linear" and fmt.signed:
            half = 1 << (fmt.bits - 1)
            codes = (codes ^ half) - half
        elif fmt.kind == "float" and fmt.signed:
            sign_bit = 1 << (fmt.bits - 1)
            neg = (codes & sign_bit) != 0
            codes = codes & (sign_bit - 1)
        B = spec.dither_block
        cb = to_blocks(codes, B)
        if spec.rounding == "bred":
            d = _uniform_blocks(stream, step, cb.shape[0], B, codes.device)[:, None] - 0.5
            if fmt.kind == "linear":
                val = cb.to(torch.float32) - d
            else:  # read at ordinal q - d, as (k, f) = (q - 1, 1 - d) if d > 0 else (q, -d)
                pos = d > 0
                val = fmt.interp(torch.where(pos, cb - 1, cb), torch.where(pos, 1.0 - d, -d))
        else:
            val = fmt.ordinal_value(cb)
        if neg is not None:
            val = torch.where(to_blocks(neg, B), -val, val)
        if spec.scaled:
            delta = step_of(scales.to(torch.float32), fmt.top)
            val = val * delta[:, None]
        x = val.reshape(-1)[:numel]
    if spec.sqrt:
        x = x * x
    return x
