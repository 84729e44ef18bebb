"""Code books (sorted value tables on [-1, 1] or [0, 1]) used by the table formats.

A block-scaled table format stores, per element, the index of a table entry; the value
read back is `table[index] * absmax(block)`.

Dynamic-exponent (DE) maps, as bitsandbytes and torchao build them (Dettmers 2015,
"8-Bit Approximations for Parallelism in Deep Learning"): for each decade
i = 0..E-1 the magnitudes 10**(i-E+1) * mid, where `mid` are the midpoints of an fp32
`linspace(0.1, 1, n_i + 1)` with n_i = 2**i (signed) or 2**(i+1) (unsigned) fraction
items, plus 0 and 1. Computed in fp32 exactly as those libraries do, so the tables
are equal to theirs bit for bit (checked in tests when the peers are installed).

  de8   = dynamic_map(signed=True,  E=7, bits=8)   bitsandbytes' signed 8-bit map (m)
  de8u  = dynamic_map(signed=False, E=7, bits=8)   its unsigned map (v)
  de4   = dynamic_map(signed=True,  E=3, bits=4)   torchao/lpmm 4-bit map for m;
          magnitudes {0, .0055, .0325, .0775, .2125, .4375, .6625, .8875, 1}
  de4u  = dynamic_map(signed=False, E=3, bits=4)
  *nz   the same map with its zero entry removed (one code left unused): a value near
        zero rounds to the smallest magnitude instead of to 0, so a stored v never reads
        back as exactly 0 (lpmm's "nonlinear-nozero" duplicates the smallest entry into
        the zero slot instead; the set of values read back is the same).
  lin4nz = {1/16, 2/16, ..., 16/16}: torchao's and lpmm's 4-bit map for v (no zero,
        because a v stored as 0 makes 1/sqrt(v) explode); lin8nz = {1/256, ..., 1}.
"""
from __future__ import annotations

from functools import lru_cache

import torch


def dynamic_map(signed: bool, max_exponent_bits: int, total_bits: int) -> tuple[float, ...]:
    """The DE code book, sorted ascending, 2**total_bits entries (fp32 values)."""
    values: list[float] = []
    non_sign_bits = total_bits - 1  # the peers reserve one bit either way
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1
    decade = 0
    for decade in range(max_exponent_bits):
        n_items = 2 ** (decade + non_sign_bits - max_exponent_bits + (0 if signed else 1))
        edges = torch.linspace(0.1, 1, n_items + 1)
        mids = (edges[:-1] + edges[1:]) / 2.0
        mags = ((10 ** (-(max_exponent_bits - 1) + decade)) * mids).tolist()
        values += mags
        if signed:
            values += (-(10 ** (-(max_exponent_bits - 1) + decade)) * mids).tolist()
    if extra > 0:
        edges = torch.linspace(0.1, 1, extra + 1)
        mids = (edges[:-1] + edges[1:]) / 2.0
        values += ((10 ** (-(max_exponent_bits - 1) + decade)) * mids).tolist()
        if signed:
            values += (-(10 ** (-(max_exponent_bits - 1) + decade)) * mids).tolist()
    values += [0.0, 1.0]
    if len(values) != 2 ** total_bits:
        raise ValueError(f"dynamic map has {len(values)} entries, expected {2 ** total_bits}")
    return tuple(sorted(values))


def without_zero(table: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(v for v in table if v != 0.0)


def linear_nozero_map(bits: int) -> tuple[float, ...]:
    """{1/2**bits, ..., 1}: torchao's 4-bit map for the second moment."""
    n = 2 ** bits
    return tuple(torch.linspace(0, 1, n + 1)[1:].tolist())


@lru_cache(maxsize=None)
def codebook(name: str) -> tuple[float, ...]:
    """Look up a code book by format name (de8, de8u, de4, de4u, their *nz, lin4nz)."""
    builders = {
        "de8": lambda: dynamic_map(True, 7, 8),
        "de8u": lambda: dynamic_map(False, 7, 8),
        "de4": lambda: dynamic_map(True, 3, 4),
        "de4u": lambda: dynamic_map(False, 3, 4),
        "lin4nz": lambda: linear_nozero_map(4),
        "lin8nz": lambda: linear_nozero_map(8),
    }
    if name.endswith("nz") and name[:-2] in builders:
        return without_zero(builders[name[:-2]]())
    return builders[name]()


@lru_cache(maxsize=None)
def codebook_tensor(name: str, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(codebook(name), dtype=torch.float32, device=device)
