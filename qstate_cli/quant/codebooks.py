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


def check_table(name: str, table, bits: int, signed: bool) -> tuple[float, ...]:
    """`table` as a code book of a `bits`-bit format, or ValueError saying what is wrong
    with it. Every path reads a table the same way, so a wrong table is not caught by the
    kernels' parity tests (they agree on it); what can be checked is its shape:

    - 1 .. 2**bits entries (a code is an index into it);
    - strictly ascending (rounding searches it: an unsorted table rounds to wrong entries);
    - within [-1, 1], and within [0, 1] for an unsigned format (values are table * absmax);
    - holding 1 (the block's absmax reads back as itself: without it every block shrinks).
    """
    table = tuple(float(v) for v in table)
    why = None
    if not 1 <= len(table) <= 2 ** bits:
        why = f"{len(table)} entries; a {bits}-bit code indexes 1 to {2 ** bits}"
    elif any(b <= a for a, b in zip(table, table[1:])):
        why = "not strictly ascending"
    elif table[0] < (-1.0 if signed else 0.0) or table[-1] > 1.0:
        why = f"values outside [{-1 if signed else 0}, 1]: {table[0]} .. {table[-1]}"
    elif table[-1] != 1.0:
        why = f"its largest value is {table[-1]}, not 1 (a block's absmax must read back as itself)"
    if why:
        raise ValueError(f"code book {name!r}: {why}")
    return table


# format name -> its code book's builder (a name ending in "nz" not here: its base's without the zero)
BUILDERS = {
    "de8": lambda: dynamic_map(True, 7, 8),
    "de8u": lambda: dynamic_map(False, 7, 8),
    "de4": lambda: dynamic_map(True, 3, 4),
    "de4u": lambda: dynamic_map(False, 3, 4),
    "lin4nz": lambda: linear_nozero_map(4),
    "lin8nz": lambda: linear_nozero_map(8),
}


@lru_cache(maxsize=None)
def codebook(name: str) -> tuple[float, ...]:
    """Look up a code book by format name (`BUILDERS`: de8, de8u, de4, de4u, their *nz,
    lin4nz, lin8nz)."""
    if name.endswith("nz") and name[:-2] in BUILDERS:
        return without_zero(BUILDERS[name[:-2]]())
    return BUILDERS[name]()


@lru_cache(maxsize=None)
def codebook_tensor(name: str, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(codebook(name), dtype=torch.float32, device=device)
