"""State formats: what a stored value can be, as a grid of ordinals.

Every format is a monotone, piecewise-linear map between real values and *ordinals*:
integer ordinals are the representable values, and the fractional position between two
neighbours is linear in value. Rounding (rounding.py) only ever chooses between the
floor ordinal k and k + 1 of a normalised value n, given `frac` = the position of n
between them; BReD reads back at a fractional ordinal (q - dither) and interpolates.

Kinds:
- ``identity`` fp32: stored as is.
- ``linear``   integer codes q with value q * delta, delta = absmax(block) / L;
               signed: L = 2**(b-1) - 1, codes -2**(b-1)..L; unsigned: L = 2**b - 1.
- ``table``    index into a sorted code book (codebooks.py), value table[q] * absmax.
- ``float``    sign-magnitude minifloat with M mantissa bits and minimum normal exponent
               emin (no infinities; saturating at the largest finite value `fmax`).
               The magnitude ordinal equals the format's bit pattern. Optionally block
               scaled so that absmax(block) maps to fmax.

Normalisation: n = x / delta with delta = absmax / top, where top = L (linear),
1 (table) or fmax (scaled float); unscaled floats use n = x.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..errors import QstateError
from .codebooks import check_table, codebook, codebook_tensor
from .packing import PACKED_BITS

F32_MANTISSA = 23


@dataclass(frozen=True)
class Format:
    name: str
    kind: str  # identity | linear | table | float
    bits: int
    signed: bool
    purpose: str
    levels: int = 0  # linear: L, the largest positive code
    exp_bits: int = 0  # float
    man_bits: int = 0  # float: M
    emin: int = 0  # float: exponent of the smallest normal
    max_ordinal: int = 0  # float: magnitude bit pattern of fmax
    aliases: tuple[str, ...] = field(default=())

    # ---- derived ----------------------------------------------------------------
    @property
    def blocked(self) -> bool:
        """Needs a block size (linear and table formats always carry block scales)."""
        return self.kind in ("linear", "table")

    @property
    def table(self) -> tuple[float, ...]:
        """The code book (table formats; () otherwise), checked once (codebooks.check_table)."""
        return _checked_table(self.name, self.bits, self.signed) if self.kind == "table" else ()

    @property
    def nozero_linear(self) -> bool:
        """A code book exactly {1/NT, 2/NT, ..., 1} in fp32, NT a power of two (lin4nz, lin8nz)."""
        table = self.table
        nt = len(table)
        return nt >= 2 and nt & (nt - 1) == 0 and all(
            float(torch.tensor(v, dtype=torch.float32)) == (j + 1) / nt for j, v in enumerate(table))

    @property
    def fmax(self) -> float:
        """Largest finite magnitude (float formats)."""
        return float(self.ordinal_value(torch.tensor([self.max_ordinal]))[0])

    @property
    def top(self) -> float:
        """The normalised value that the block absmax maps to."""
        return {"linear": float(self.levels), "table": 1.0, "float": self.fmax}.get(self.kind, 1.0)

    @property
    def code_range(self) -> tuple[int, int]:
        """Smallest and largest integer ordinal a code can hold (floats: magnitude)."""
        if self.kind == "linear":
            return (-(2 ** (self.bits - 1)), self.levels) if self.signed else (0, self.levels)
        if self.kind == "table":
            return 0, len(self.table) - 1
        return 0, self.max_ordinal

    # ---- ordinal maps (pure torch, fp32; kernels reproduce these bit for bit) ---------
    def floor_frac(self, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Floor ordinal k (int32) and position frac in [0, 1] of normalised n.

        linear: k = floor(n), frac = n - k (exact). float: on |n| from the fp32 bits
        (exact). table: k = clamp(#(table <= n) - 1, 0, K-2),
        frac = clamp((n - T[k]) / (T[k+1] - T[k]), 0, 1).
        """
        if self.kind == "linear":
            k = torch.floor(n)
            return k.to(torch.int32), n - k
        if self.kind == "float":
            return _float_floor_frac(n.abs(), self.man_bits, self.emin)
        table = codebook_tensor(self.name, str(n.device))
        k = (torch.searchsorted(table, n, right=True) - 1).clamp_(0, table.numel() - 2)
        lo, hi = table[k], table[k + 1]
        frac = ((n - lo) / (hi - lo)).clamp_(0.0, 1.0)
        return k.to(torch.int32), frac

    def nearest_ordinal(self, n: torch.Tensor) -> torch.Tensor:
        """The grid point nearest to normalised n (a float format: to |n|) as the staleness
        windows round: floor_frac's k + [frac >= 1/2], clamped to the last ordinal (int64;
        table and float formats)."""
        k0, f = self.floor_frac(n)
        last = self.max_ordinal if self.kind == "float" else codebook_tensor(self.name, str(n.device)).numel() - 1
        return (k0.long() + (f >= 0.5).long()).clamp(0, last)

    def ordinal_value(self, t: torch.Tensor) -> torch.Tensor:
        """Value at integer ordinal t (floats: t is a magnitude ordinal)."""
        if self.kind == "linear":
            return t.to(torch.float32)
        return self.code_value(t.to(torch.int32))

    def interp(self, k: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """Value at the fractional ordinal k + f (k integer, f in [0, 1]): linear between
        neighbouring codes, extrapolated beyond the ends. Taking k and f apart (rather than
        t = k + f) keeps f's 24 bits even where ordinals are large (bf16: up to 2**15).
        The no-zero linear maps (lin4nz, lin8nz: entries (j + 1) / NT) are one line, so
        they are read with one rounding and no clamp: rn((k + 1) + f) / NT (the same line
        as the table's extrapolation; k + 1 is an exact integer, / NT exact)."""
        if self.kind == "linear":
            return k.to(torch.float32) + f
        if self.nozero_linear:
            return ((k + 1).to(torch.float32) + f) * (1.0 / len(self.table))
        top = len(self.table) - 2 if self.kind == "table" else self.max_ordinal
        kc = k.clamp(0, top)
        f = f + (k - kc).to(torch.float32)
        lo, hi = self.code_value(kc), self.code_value(kc + 1)
        return lo + f * (hi - lo)

    def code_value(self, k: torch.Tensor) -> torch.Tensor:
        if self.kind == "table":
            return codebook_tensor(self.name, str(k.device))[k.long()]
        return _float_value(k, self.man_bits, self.emin)


def _float_floor_frac(mag: torch.Tensor, man_bits: int, emin: int):
    """Magnitude ordinal floor and exact fraction for a minifloat (fp32 input >= 0).

    In the target's normal range the ordinal is the fp32 bit pattern shifted right by
    23 - M and re-biased, and the dropped bits are the exact fraction. Below it
    (target subnormals) the grid is uniform with spacing 2**(emin - M).
    """
    drop = F32_MANTISSA - man_bits
    bits = mag.view(torch.int32)
    k_norm = (bits >> drop) - ((126 + emin) << man_bits)
    f_norm = (bits & ((1 << drop) - 1)).to(torch.float32) * (2.0 ** -drop)
    if emin <= -126:  # bf16: the bit path also covers fp32 subnormals
        return k_norm.to(torch.int32), f_norm
    y = mag * (2.0 ** (man_bits - emin))
    k_sub = torch.floor(y)
    normal = mag >= 2.0 ** emin
    k = torch.where(normal, k_norm, k_sub.to(torch.int32))
    frac = torch.where(normal, f_norm, y - k_sub)
    return k.to(torch.int32), frac


def _float_value(k: torch.Tensor, man_bits: int, emin: int) -> torch.Tensor:
    """Magnitude of minifloat bit pattern k (k >= 0, may be one past the largest)."""
    drop = F32_MANTISSA - man_bits
    k = k.to(torch.int32)
    normal_bits = (k + ((126 + emin) << man_bits)) << drop
    normal = normal_bits.view(torch.float32)
    sub = k.to(torch.float32) * (2.0 ** (emin - man_bits))
    return torch.where((k >> man_bits) > 0, normal, sub)


def _minifloat(name, bits, exp_bits, man_bits, bias, max_ordinal, signed, purpose, aliases=()):
    return Format(name=name, kind="float", bits=bits, signed=signed, purpose=purpose,
                  exp_bits=exp_bits, man_bits=man_bits, emin=1 - bias,
                  max_ordinal=max_ordinal, aliases=tuple(aliases))


@lru_cache(maxsize=None)
def _checked_table(name: str, bits: int, signed: bool) -> tuple[float, ...]:
    return check_table(name, codebook(name), bits, signed)


FORMATS: dict[str, Format] = {}


def _register(fmt: Format) -> None:
    """Add a format. Its codes are packed by quant/packing.py, which packs 4, 8 and 16 bits
    (fp32 is stored as is); a table format's code book is checked on first use (Format.table)."""
    if fmt.kind != "identity" and fmt.bits not in PACKED_BITS:
        raise ValueError(f"format {fmt.name!r}: {fmt.bits}-bit codes; quant/packing.py packs "
                         f"{', '.join(map(str, PACKED_BITS))}-bit codes")
    FORMATS[fmt.name] = fmt


_register(Format("fp32", "identity", 32, True, "full precision: the reference every other format is measured against"))
_register(_minifloat("bf16", 16, 8, 7, 127, 0x7F7F, True, "bfloat16 states (fp32 range, 8 significant bits); stalls at beta2=0.999"))
_register(_minifloat("fp16", 16, 5, 10, 15, 0x7BFF, True, "IEEE half; needs block scaling for v (range 6e-8..65504)"))
_register(_minifloat("e4m3", 8, 4, 3, 7, 0x7E, True, "fp8 E4M3 (max 448), torchao's fp8 optimizer with block scales", ["fp8"]))
_register(_minifloat("e5m2", 8, 5, 2, 15, 0x7B, True, "fp8 E5M2 (max 57344): more range, less precision"))
_register(_minifloat("e2m1", 4, 2, 1, 1, 0x7, True, "fp4 E2M1 (max 6), as in MXFP4/NVFP4; needs block scales", ["fp4"]))
_register(_minifloat("e2m2", 4, 2, 2, 1, 0xF, False, "unsigned fp4 E2M2 (max 7) for v, as in the staleness paper"))
for _b in (4, 8):
    _register(Format(f"int{_b}", "linear", _b, True, f"signed linear {_b}-bit codes x absmax/{2 ** (_b - 1) - 1}: m under BReD / SR / nearest",
                     levels=2 ** (_b - 1) - 1))
    _register(Format(f"uint{_b}", "linear", _b, False, f"unsigned linear {_b}-bit codes x absmax/{2 ** _b - 1}: v",
                     levels=2 ** _b - 1))
_register(Format("de8", "table", 8, True, "bitsandbytes' signed dynamic-exponent map (m in AdamW8bit)"))
_register(Format("de8u", "table", 8, False, "bitsandbytes' unsigned dynamic map (v in AdamW8bit)"))
_register(Format("de8nz", "table", 8, True, "de8 without its zero code"))
_register(Format("de8unz", "table", 8, False, "de8u without its zero code: v never reads back as 0"))
_register(Format("de4", "table", 4, True, "4-bit signed dynamic map (m in torchao/lpmm 4-bit AdamW)"))
_register(Format("de4nz", "table", 4, True, "de4 without its zero code"))
_register(Format("de4u", "table", 4, False, "4-bit unsigned dynamic map"))
_register(Format("de4unz", "table", 4, False, "de4u without its zero code"))
_register(Format("lin4nz", "table", 4, False, "no-zero linear map {1/16..1} (v in torchao/lpmm 4-bit AdamW)"))
_register(Format("lin8nz", "table", 8, False, "no-zero linear map {1/256..1}: 8-bit v that never reads back as 0"))

ALIASES = {a: f.name for f in FORMATS.values() for a in f.aliases}


def get_format(name: str) -> Format:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise QstateError(f"unknown format {name!r}{suggest(name, list(FORMATS) + list(ALIASES))}")
    return FORMATS[key]


def suggest(word: str, choices) -> str:
    """`; did you mean A, B?` for the choices close to `word`, else `; choose from ...` (all)."""
    choices = sorted(set(choices))  # a name listed twice (a preset and a format) is suggested once
    return close_to(word, choices) or f"; choose from {', '.join(choices)}"


def close_to(word: str, choices) -> str:
    """`; did you mean A, B?` for up to 3 of `choices` close to `word` (lower-cased), else ''."""
    close = difflib.get_close_matches(word.lower(), list(choices), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


def state_bytes(fmt: Format, numel: int, block: int | None, scale_bytes: int = 4) -> int:
    """Exact bytes of one stored state: packed codes plus one scale per block.

    codes: ceil(numel * bits / 8); scales: ceil(numel / block) * scale_bytes.
    """
    code_bytes = -(-numel * fmt.bits // 8)
    blocks = -(-numel // block) if block else 0
    return code_bytes + blocks * scale_bytes


def bytes_per_element(fmt: Format, block: int | None, scale_bytes: int = 4) -> float:
    """bits/8 + scale_bytes/block (the limit of state_bytes / numel)."""
    return fmt.bits / 8 + (scale_bytes / block if block else 0.0)
