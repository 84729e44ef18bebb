"""The one counter-based hash that produces every random bit in qstate.

All randomness (stochastic rounding, BReD dithers, sampled trace blocks) is a pure
function of integers, so the same seed replays the same bits on CPU and GPU, in the
reference and in the Triton kernels, with no generator state to carry or checkpoint.

    hash32(x)      lowbias32 (C. Wellons): x ^= x>>16; x *= 0x7feb352d; x ^= x>>15;
                   x *= 0x846ca68b; x ^= x>>16           (all mod 2**32)
    stream_keys    k  = hash32(seed); k = hash32(k ^ tensor_id); k = hash32(k ^ state_id)
                   k1 = hash32(k ^ step);  k2 = hash32(k1 ^ 0x9e3779b9)
    bits(counter)  hash32(hash32(counter ^ k1) ^ k2)
    uniform        (bits >> 8) * 2**-24, exactly representable in fp32, in [0, 1)
    uniform16      per element i: 16 of the bits of counter i >> 1, the low half for
                   even i and the high half for odd i, times 2**-16: one hash serves two
                   neighbouring elements (stochastic rounding)

`counter` is the block index for BReD (one dither per block, `uniform`) and the flat
element index for stochastic rounding (`uniform16`: two elements per hash, so a fused
kernel evaluates the hash once per pair; a 2**-16 grid biases P(round up) by less than
2**-16 of a code step). The second key k2 makes two streams whose first keys
collide after the XOR with the counter still differ. Only 32-bit unsigned integer
multiply, xor and shift are used, so a Triton kernel computes the same values with
`tl.uint32` arithmetic (see `kernels/common.py`).

In torch we hold uint32 values in int64 tensors and split each multiply into two 16-bit
halves, so no intermediate exceeds 2**49 (no signed overflow).
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B
GOLDEN = 0x9E3779B9
UNIFORM_BITS = 24


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) held in an int64 tensor or a Python int."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x):
    """lowbias32 on uint32 values (int64 tensor or Python int); a bijection of [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MUL2)
    return x ^ (x >> 16)


def stream_keys(seed: int, tensor_id: int, state_id: int, step: int) -> tuple[int, int]:
    """The two 32-bit keys of one random stream: one tensor, one state, one step."""
    k = hash32(int(seed) & MASK32)
    k = hash32(k ^ (int(tensor_id) & MASK32))
    k = hash32(k ^ (int(state_id) & MASK32))
    k1 = hash32(k ^ (int(step) & MASK32))
    k2 = hash32(k1 ^ GOLDEN)
    return k1, k2


def random_bits(keys: tuple[int, int], counter: torch.Tensor) -> torch.Tensor:
    """32 random bits per counter value (int64 tensor holding uint32 values)."""
    k1, k2 = keys
    c = counter.to(torch.int64) & MASK32
    return hash32(hash32(c ^ k1) ^ k2)


def uniform(keys: tuple[int, int], counter: torch.Tensor) -> torch.Tensor:
    """U[0, 1) on a 2**-24 grid, fp32, one value per counter."""
    bits = random_bits(keys, counter)
    return (bits >> (32 - UNIFORM_BITS)).to(torch.float32) * (2.0 ** -UNIFORM_BITS)


def uniform16(keys: tuple[int, int], counter: torch.Tensor) -> torch.Tensor:
    """U[0, 1) on a 2**-16 grid, fp32, one value per element counter i: bits 16 (i & 1) ..
    16 (i & 1) + 15 of random_bits(counter i >> 1)."""
    c = counter.to(torch.int64)
    bits = random_bits(keys, c >> 1)
    return ((bits >> ((c & 1) << 4)) & 0xFFFF).to(torch.float32) * (2.0 ** -16)


def uniform_for(seed: int, tensor_id: int, state_id: int, step: int, n: int,
                device=None) -> torch.Tensor:
    """Convenience: n uniforms for counters 0..n-1 of one stream."""
    keys = stream_keys(seed, tensor_id, state_id, step)
    return uniform(keys, torch.arange(n, device=device, dtype=torch.int64))
