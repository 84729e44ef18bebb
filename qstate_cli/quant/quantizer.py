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
       stochastic  d = u_i - 1/2                    u_i per element  (counter = index i;
                                                    hash.uniform16: 2**-16 grid)
       bred        d = u_b - 1/2                    u_b per block    (counter = block b)
     (BRIEF §2: q = round(x/delta + u), u ~ U[-1/2, 1/2); P(round up) = the position
     of n between its neighbours, up to fp32 rounding of n + d)
  5. other formats: floor ordinal k and position frac of n (formats.py; for signed
     floats on |n|); rounding picks r in {0, 1} and q = k + r:
       nearest     r = frac > 1/2, ties to even q   (tables: n - lo >= (hi - lo)/2)
       stochastic  r = u_i < frac
       bred        r = u_b >= 1 - frac
  6. q is clamped to the code range
  Peer recipes (config.py): `tensor` takes one absmax over the whole tensor instead of
  one per block, with Transformer Engine's arithmetic: n = x * (1 / (absmax / top)),
  read back times 1 / (1 / (absmax / top)) (steps 4-6 unchanged; `reduce_absmax`, when
  x is one piece of the tensor, turns the piece's absmax into the tensor's: an all-reduce
  MAX across torchrun ranks, diagnose/distributed.py); `sfp16` / `softsign` (FlashOptim) replace steps
  3-4 on a linear format by: absmax = max(absmax, 1e-12), r = x / absmax per element,
  softsign r <- 2r / (1 + |r|), q = floor(r * top + d + 1/2), scale stored as fp16(absmax)
  (nearest); read back t = (q - d) / top, softsign t <- t / (2 - |t|), x_hat = t * scale.
decode(q):
  t = q (bred: t = q - d, d = u_b - 1/2, replayed from the step the state was written;
  for non-linear formats evaluated as the integer k and fraction f of t, exactly)
  x_hat = value(t) * delta  (signed floats: sign applied to the magnitude), then squared
  in the sqrt domain.

Random numbers: over stream (seed, tensor_id, state_id, step), hash.uniform per block
(BReD, 2**-24 grid) and hash.uniform16 per element (stochastic: one hash per two
neighbouring elements, 2**-16 grid). Counters are
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

    def element_uniforms(self, step: int, n: int, device) -> torch.Tensor:
        """hash.uniform16 at counters offset .. offset + n - 1: stochastic rounding's one
        uniform per element (optim/small.py draws them for tensors laid end to end)."""
        return qhash.uniform16(self.keys(step), torch.arange(n, device=device) + self.offset)


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


FLASH_MIN_ABSMAX = 1e-12  # FlashOptim's floor on a block absmax


def _encode_per_element(xb: torch.Tensor, spec: StateSpec, d: torch.Tensor | float):
    """FlashOptim's quantizer on block rows xb (module docstring): (codes, stored scales)."""
    absmax = xb.abs().amax(dim=1).clamp(min=FLASH_MIN_ABSMAX)
    r = xb / absmax[:, None]
    if spec.softsign:
        r = 2.0 * r / (1.0 + r.abs())
    q = torch.floor(r * spec.fmt.top + d + 0.5).to(torch.int32)
    scales = absmax.to(torch.float16) if spec.scale_dtype == "fp16" else absmax
    return q, scales


def _decode_per_element(val: torch.Tensor, scales: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    t = val / spec.fmt.top
    if spec.softsign:
        t = t / (2.0 - t.abs())
    return t * scales.to(torch.float32)[:, None]


def _tensor_inverse_scale(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """Transformer Engine's per-tensor scale, as its FusedAdam computes it: s = absmax / top
    (fp32), the quantizer multiplies by 1 / s and reads back times 1 / (1 / s); 0 where
    the tensor is not scaled() (all zero)."""
    ok = scaled(absmax, top)
    s = div_scalar(torch.where(ok, absmax, 1.0), top)
    return torch.where(ok, 1.0 / s, 0.0)


def _uniform_elements(stream: Stream, step: int, shape, device) -> torch.Tensor:
    return stream.element_uniforms(step, shape[0] * shape[1], device).view(shape)


def _uniform_blocks(stream: Stream, step: int, nblocks: int, block: int, device) -> torch.Tensor:
    counter = torch.arange(nblocks, device=device) + stream.offset // block
    return qhash.uniform(stream.keys(step), counter)


def encode(x: torch.Tensor, spec: StateSpec, step: int, stream: Stream = Stream(), reduce_absmax=None):
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
    if spec.per_element_division:
        q, scales = _encode_per_element(xb, spec, _linear_dither(spec, stream, step, xb))
        return _store(q, fmt, spec, scales, numel, signbit=None)
    if spec.scaled:
        absmax = _block_scale(xb, spec)
        n = normalize(xb, absmax, spec.fmt.top)
    elif spec.tensor_scale:
        absmax = x.abs().amax().reshape(1) if numel else torch.zeros(1, device=x.device)
        if reduce_absmax is not None:
            absmax = reduce_absmax(absmax)
        n = xb * _tensor_inverse_scale(absmax, spec.fmt.top)
    else:
        n = xb
    is_float = fmt.kind == "float"
    if fmt.kind == "linear":
        q = torch.round(n + _linear_dither(spec, stream, step, n)).to(torch.int32)  # half to even
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


def _linear_dither(spec: StateSpec, stream: Stream, step: int, n: torch.Tensor):
    """d added to n before rounding a linear grid: 0 (nearest), u_i - 1/2 (stochastic),
    u_b - 1/2 (BReD)."""
    if spec.rounding == "stochastic":
        return _uniform_elements(stream, step, n.shape, n.device) - 0.5
    if spec.rounding == "bred":
        return _uniform_blocks(stream, step, n.shape[0], spec.dither_block, n.device)[:, None] - 0.5
    return 0.0


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
        if spec.per_element_division:
            val = _decode_per_element(val, scales, spec)
        elif spec.tensor_scale:
            inv = _tensor_inverse_scale(scales.to(torch.float32), fmt.top)
            val = val * torch.where(inv > 0, 1.0 / torch.where(inv > 0, inv, 1.0), 0.0)
        elif spec.scaled:
            delta = step_of(scales.to(torch.float32), fmt.top)
            val = val * delta[:, None]
        x = val.reshape(-1)[:numel]
    if spec.sqrt:
        x = x * x
    return x
