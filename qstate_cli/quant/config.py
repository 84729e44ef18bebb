"""Names for state configurations: one small grammar, used by the CLI, YAML and results.

One state (m, v or a momentum buffer)::

    spec    := FORMAT [":" ROUNDING] [":b" BLOCK | ":tensor"] [":sqrt"] [":softsign"]
               [":sbf16" | ":sfp16"]
    FORMAT  := fp32 | bf16 | fp16 | e4m3 (fp8) | e5m2 | e2m1 (fp4) | e2m2
             | int4 | uint4 | int8 | uint8 | de8 | de8u | de4 | de4u | *nz | lin4nz
    ROUNDING:= nearest (nr) | stochastic (sr) | bred

`b128` sets the block size: one absmax scale per block (required by int/uint/de/lin
formats, default 128 at 4 bits and 256 at 8 bits; optional for floats, which are then
block scaled so that the absmax maps to the format's largest value). `sqrt` stores
sqrt(x) and reads back its square (for the non-negative v). `sbf16` keeps the scales in
bf16, rounded up so no value overflows.

Peer recipes (docs/peers.md):
- `tensor`: one fp32 scale for the whole tensor (absmax maps to the format's largest
  value), as Transformer Engine's FusedAdam keeps its FP8 states.
- `sfp16`: FlashOptim's arithmetic: the block absmax (at least 1e-12) divides every
  element (r = x / absmax, one division per element), codes are floor(r * top + 1/2)
  (ties up), the scale is stored as fp16 (rounded to nearest) and reads back
  q / top * fp16(absmax).
- `softsign`: FlashOptim's companding of a signed linear state: r -> 2r / (1 + |r|)
  before the grid, t -> t / (2 - |t|) after it (more codes near zero). Implies `sfp16`'s
  per-element arithmetic.

An optimizer's configuration names each state, or gives one spec for all of them, or
names a preset::

    config  := PRESET | spec | "m=" spec ["," "v=" spec]

(`m=SPEC` alone is for optimizers with one state, Lion / SGD / Muon; an optimizer with a v
refuses it (StateConfig.spec): it used to give v the same spec, which put AdamW's
non-negative v on m's signed grid without a word; one spec for every state is the bare
`spec`.)

e.g. ``bred-4bit`` == ``m=int4:bred:b128,v=lin4nz:bred:b128``.

How BReD treats what is not a uniform grid (design decision, documented in README):
- non-negative states (v): the presets keep v on a grid without a zero level and dither
  there: at 4 bits the no-zero linear grid {1/16, ..., 1} x absmax (``lin4nz``, torchao's
  v map), at 8 bits sqrt(v) on {1/256, ..., 1} x absmax (``lin8nz:sqrt``). A v read back
  is then never negative and never near 0 (4 bits: never below absmax/32, the first level
  minus half a step), which keeps AdamW's m / sqrt(v) bounded. On a grid with a zero
  level (uint4) a rounded or dithered v near 0 reads back as ~0 and the update explodes:
  training with v=uint4 diverges within a few steps. Dithering sqrt(v) reads back s_hat^2
  with E[s_hat^2] = s^2 + step^2/12, a positive bias that is large for small v at 4 bits:
  `qstate diagnose` on the demo trace measured update error 0.81 for v=lin4nz:bred:sqrt
  against 0.47 for v=lin4nz:bred (sr-4bit 0.51, torchao-4bit 0.85); at 8 bits the step is
  16x finer and sqrt wins (0.080 against 0.098). With a signed grid, a v read back below
  zero is clamped to 0 by the optimizers.
- non-uniform grids (DE code books, minifloats): the dither is applied to the *ordinal*
  (the code index, linear in value between neighbouring codes) and subtracted there on
  read, then mapped back by linear interpolation. Error is uniform in ordinal units, so it
  is zero-mean in value only where the spacing is the same on both sides. Where it
  changes (a minifloat's binade boundary, between a DE code book's exponent ranges) the
  mean error in value is not 0: with spacings s_down below and s_up above the code where they change, and x
  at a (|a| < 1/2) codes from it, E[x_hat - x] = (s_up - s_down) * (1/2 - |a|)^2 / 2,
  largest at the code itself: (s_up - s_down) / 8, which at a binade boundary x = 2^e
  of a float with machine epsilon eps is (eps*x - eps*x/2) / 8 = eps*x/16 (1/16 of the
  ulp above, 1/8 of the ulp below; half a code or more away, 0). Measured with
  quantizer.encode/decode, unscaled, 65,536 dithers each (one per block, 16 steps x 4,096
  blocks; tests/test_formats.py checks it): bf16:bred at x = 1.0 +4.94e-4 +- 0.07e-4
  (predicted 2^-11 = 4.88e-4), at 2.0 +9.87e-4 (9.77e-4), at 1 + 2^-9 (a = 1/4)
  +1.23e-4 (1.22e-4), at 1.5 and 0.75 +7e-6 and +4e-6 (0, within one standard error);
  e4m3:bred at x = 1.0 +7.90e-3 +- 0.11e-3 (2^-7 = 7.81e-3), at 1.5 +1.2e-4 (0). A
  block-scaled float puts the boundaries at absmax / top * 2^e instead. Nearest and
  stochastic rounding differ here: stochastic rounding is unbiased on any grid; nearest
  is biased everywhere between codes.
- unscaled floats (no ``b``): dither blocks of DITHER_BLOCK elements.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import QstateError
from .formats import Format, get_format, suggest

ROUNDINGS = {"nearest": "nearest", "nr": "nearest", "rne": "nearest",
             "stochastic": "stochastic", "sr": "stochastic", "bred": "bred", "dither": "bred"}
ROUNDING_HELP = {
    "nearest": "round half to even (tables: ties up, as torchao); deterministic, biased, stalls",
    "stochastic": "round up with probability = position between codes; unbiased, one random number per element",
    "bred": "subtractive dither, one per block per step, replayed from the hash; error uniform, zero mean, "
            "var = step^2/12 (float and DE grids: uniform in code units, so at a binade boundary x = 2^e "
            "the mean is eps*x/16, not 0)",
}
DITHER_BLOCK = 128
MIN_BLOCK, MAX_BLOCK = 32, 2048
MIN_QUANT_NUMEL = 4096  # tensors with fewer elements keep fp32 states by default (as bitsandbytes)
STATE_NAMES = ("m", "v")
STATE_IDS = {name: i for i, name in enumerate(STATE_NAMES)}  # a state's random stream id (quant/hash.py)


def default_block(fmt: Format) -> int:
    return 128 if fmt.bits <= 4 else 256


@dataclass(frozen=True)
class StateSpec:
    """How one optimizer state is stored."""

    fmt: Format
    rounding: str = "nearest"
    block: int | None = None
    sqrt: bool = False
    scale_dtype: str = "fp32"  # fp32 | bf16 (rounded up) | fp16 (FlashOptim: nearest)
    tensor_scale: bool = False  # one scale for the whole tensor (Transformer Engine)
    softsign: bool = False  # FlashOptim's companding of signed linear codes

    def __post_init__(self):
        if self.fmt.kind == "identity":
            return
        if self.tensor_scale and self.block is not None:
            raise QstateError("a state has either block scales (bN) or one tensor scale (tensor), not both")
        if self.tensor_scale and self.fmt.blocked:
            raise QstateError(f"format {self.fmt.name} needs block scales; `tensor` scaling is for float formats")
        if self.per_element_division and (self.fmt.kind != "linear" or self.tensor_scale):
            raise QstateError("softsign / sfp16 (FlashOptim's recipe) need a block-scaled linear format (int8, uint8, ...)")
        if self.softsign and not self.fmt.signed:
            raise QstateError("softsign compands signed states (m); an unsigned format has no sign to compand")
        if self.block is None and self.fmt.blocked:
            object.__setattr__(self, "block", default_block(self.fmt))
        if self.block is not None and not (MIN_BLOCK <= self.block <= MAX_BLOCK and self.block % 2 == 0):
            raise QstateError(f"block size {self.block} out of range: use an even size from {MIN_BLOCK} to {MAX_BLOCK}")

    @property
    def scaled(self) -> bool:
        return self.block is not None and self.fmt.kind != "identity"

    @property
    def has_scales(self) -> bool:
        """Stores scales at all: one per block (`scaled`) or one per tensor."""
        return self.scaled or (self.tensor_scale and self.fmt.kind != "identity")

    @property
    def per_element_division(self) -> bool:
        """FlashOptim's arithmetic (fp16 scales or softsign): see the module docstring."""
        return self.scale_dtype == "fp16" or self.softsign

    @property
    def dither_block(self) -> int:
        return self.block if self.block else DITHER_BLOCK

    @property
    def scale_bytes(self) -> int:
        return 2 if self.scale_dtype in ("bf16", "fp16") else 4

    @property
    def bits(self) -> int:
        return self.fmt.bits

    def bytes_per_element(self) -> float:
        """bits/8 + scale bytes per element (a tensor scale: 4 bytes per tensor, 0 per element)."""
        return self.fmt.bits / 8 + (self.scale_bytes / self.block if self.scaled else 0.0)

    def __str__(self) -> str:
        if self.fmt.kind == "identity":
            return self.fmt.name
        parts = [self.fmt.name, self.rounding]
        if self.block is not None:
            parts.append(f"b{self.block}")
        if self.tensor_scale:
            parts.append("tensor")
        if self.sqrt:
            parts.append("sqrt")
        if self.softsign:
            parts.append("softsign")
        if self.scale_dtype in ("bf16", "fp16"):
            parts.append(f"s{self.scale_dtype}")
        return ":".join(parts)


def parse_spec(text: str) -> StateSpec:
    tokens = [t.strip() for t in text.strip().split(":") if t.strip()]
    if not tokens:
        raise QstateError("empty state spec: expected FORMAT[:ROUNDING][:bBLOCK][:sqrt]")
    fmt = get_format(tokens[0])
    rounding, block, sqrt, scale_dtype = "nearest", None, False, "fp32"
    tensor_scale = softsign = False
    for tok in tokens[1:]:
        low = tok.lower()
        if low in ROUNDINGS:
            rounding = ROUNDINGS[low]
        elif low.startswith("b") and low[1:].isdigit():
            block = int(low[1:])
        elif low == "sqrt":
            sqrt = True
        elif low == "tensor":
            tensor_scale = True
        elif low == "softsign":
            softsign = True
        elif low in ("sbf16", "s16"):
            scale_dtype = "bf16"
        elif low == "sfp16":
            scale_dtype = "fp16"
        elif low in ("sfp32", "s32"):
            scale_dtype = "fp32"
        else:
            raise QstateError(f"unknown option {tok!r} in state spec {text!r}"
                              f"{suggest(low, list(ROUNDINGS) + ['b128', 'tensor', 'sqrt', 'softsign', 'sbf16', 'sfp16'])}")
    return StateSpec(fmt, rounding, block, sqrt, scale_dtype, tensor_scale, softsign)


@dataclass(frozen=True)
class StateConfig:
    """Per-state storage for one optimizer: m (first moment / momentum) and v."""

    m: StateSpec
    v: StateSpec
    name: str = ""
    v_given: bool = field(default=True, compare=False)  # False: `m=SPEC` alone (momentum optimizers)

    def spec(self, state: str) -> StateSpec:
        if state != "m" and not self.v_given:  # an optimizer with a v asked for it
            raise QstateError(f"in {self.canonical_m()!r}: the v state needs a spec too, on a grid without a zero "
                              f"level (e.g. {self.canonical_m()},v=lin4nz:{self.m.rounding}:b{self.m.block or 128}, as "
                              f"the 4-bit presets keep it)")
        return self.m if state == "m" else self.v

    def canonical_m(self) -> str:
        return f"m={self.m}"

    def canonical(self) -> str:
        return f"m={self.m},v={self.v}"

    def __str__(self) -> str:
        return self.name or self.canonical()

    def with_name(self, name: str) -> "StateConfig":
        return replace(self, name=name)

    def __repr__(self) -> str:
        return f"StateConfig({str(self)!r})"


PRESETS: dict[str, tuple[str, str]] = {
    # name: (canonical config, what it is)
    "fp32": ("m=fp32,v=fp32", "full-precision states (torch.optim.AdamW)"),
    "bf16": ("m=bf16:nearest,v=bf16:nearest", "bf16 states, round to nearest"),
    "bf16-sr": ("m=bf16:stochastic,v=bf16:stochastic", "bf16 states, stochastic rounding"),
    "fp8": ("m=e4m3:nearest:b256,v=e4m3:nearest:b256", "fp8 E4M3 with block-256 scales (torchao AdamWFp8)"),
    "fp8-sr": ("m=e4m3:stochastic:b256,v=e4m3:stochastic:b256", "fp8 E4M3, stochastic rounding"),
    # fp4 / fp4-sr are kept to reproduce the staleness paper's storage, not to train with. tiny-lm, AdamW
    # (2026-12-07): `qstate bench train -c fp4 -c fp4-sr --steps 60` stopped both as diverged (loss past twice
    # the first, steps 4 and 7); at a constant lr 1e-3 the loss went 5.7 -> 3.0e4 (fp4) and 6.3e6 (fp4-sr) in
    # 40 steps while nearest-4bit reached 3.5 (tests/test_cli_formats.py checks that the text says so)
    "fp4": ("m=e2m1:nearest:b128,v=e2m2:nearest:b128", "the staleness paper's fp4, to reproduce it: E2M1 m, "
            "unsigned E2M2 v, block 128. AdamW diverges with it here (E2M2 has a zero level: a small v reads "
            "back as 0 and m / sqrt(v) blows up); to train in 4 bits use bred-4bit, bred-sr-4bit or "
            "nearest-4bit (v on a grid without 0)"),
    "fp4-sr": ("m=e2m1:stochastic:b128,v=e2m2:stochastic:b128", "as fp4 (the staleness paper's format), "
               "stochastic rounding; AdamW diverges with it too (v read back as 0): train with bred-4bit, "
               "bred-sr-4bit or nearest-4bit"),
    "bnb-8bit": ("m=de8:nearest:b256,v=de8u:nearest:b256", "bitsandbytes AdamW8bit: DE maps, block 256, nearest"),
    "torchao-8bit": ("m=de8:nearest:b256,v=de8u:nearest:b256", "torchao AdamW8bit: DE maps, block 256, nearest"),
    "torchao-4bit": ("m=de4:nearest:b128,v=lin4nz:nearest:b128", "torchao AdamW4bit: 4-bit DE m, no-zero linear v, block 128"),
    "nearest-4bit": ("m=int4:nearest:b128,v=lin4nz:nearest:b128", "linear 4-bit m, v on the no-zero grid {1/16..1}; round to nearest"),
    "sr-4bit": ("m=int4:stochastic:b128,v=lin4nz:stochastic:b128", "as nearest-4bit, stochastic rounding"),
    "bred-4bit": ("m=int4:bred:b128,v=lin4nz:bred:b128", "as nearest-4bit, BReD subtractive dithering"),
    "bred-sr-4bit": ("m=int4:bred:b128,v=lin4nz:stochastic:b128", "BReD m, stochastic v on the no-zero grid: "
                     "lowest median update error of the 4-bit configurations over the trace corpus (docs/corpus.md)"),
    "nearest-8bit": ("m=int8:nearest:b256,v=lin8nz:nearest:b256:sqrt", "linear 8-bit m; v on a no-zero linear grid in sqrt(v); round to nearest"),
    "sr-8bit": ("m=int8:stochastic:b256,v=lin8nz:stochastic:b256:sqrt", "as nearest-8bit, stochastic rounding"),
    "bred-8bit": ("m=int8:bred:b256,v=lin8nz:bred:b256:sqrt", "as nearest-8bit, BReD subtractive dithering"),
    "bred-linv-8bit": ("m=int8:bred:b256,v=lin8nz:bred:b256", "BReD m; v itself (no sqrt) dithered on the no-zero "
                       "grid {1/256..1}: lowest median update error of BReD's 8-bit v encodings over the trace corpus "
                       "(docs/corpus.md; nearest-8bit is lower still)"),
    "te-fp8": ("m=e4m3:nearest:tensor,v=e4m3:nearest:tensor", "Transformer Engine FusedAdam with FP8 states: "
               "E4M3, one fp32 scale per tensor (absmax -> 448), round to nearest"),
    "flashoptim-8bit": ("m=int8:nearest:b32:softsign:sfp16,v=uint8:nearest:b32:sqrt:sfp16",
                        "FlashOptim AdamW: int8 m companded 2x/(1+|x|), uint8 sqrt(v), one fp16 scale per 32, nearest"),
}


def parse_config(text: str | StateConfig) -> StateConfig:
    """Parse a preset name or an explicit configuration (see module docstring); a
    StateConfig is already parsed and comes back as it is."""
    if isinstance(text, StateConfig):
        return text
    raw = text.strip()
    if not raw:
        raise QstateError("empty state configuration")
    if raw.lower() in PRESETS:
        return _parse_explicit(PRESETS[raw.lower()][0]).with_name(raw.lower())
    if "=" not in raw and ":" not in raw and raw.lower() not in _format_names():
        raise QstateError(f"unknown configuration {raw!r}{suggest(raw, list(PRESETS) + list(_format_names()))}")
    cfg = _parse_explicit(raw)
    return cfg.with_name(_preset_name(cfg) or cfg.canonical())


def config_of(m: StateSpec, v: StateSpec) -> StateConfig:
    """The configuration of these specs, named like a parsed one (its preset's name, else
    its canonical text)."""
    cfg = StateConfig(m, v)
    return cfg.with_name(_preset_name(cfg) or cfg.canonical())


def _format_names():
    from .formats import ALIASES, FORMATS
    return set(FORMATS) | set(ALIASES)


def _parse_explicit(raw: str) -> StateConfig:
    if "=" not in raw:
        spec = parse_spec(raw)
        return StateConfig(spec, spec)
    specs: dict[str, StateSpec] = {}
    for part in raw.split(","):
        if "=" not in part:
            raise QstateError(f"in {raw!r}: expected STATE=SPEC for every state, got {part!r}")
        key, _, val = part.partition("=")
        key = key.strip().lower()
        if key not in STATE_NAMES:
            raise QstateError(f"unknown state {key!r} in {raw!r}: states are m and v")
        if key in specs:  # the last one silently won
            raise QstateError(f"configuration {raw!r}: {key} is given twice")
        specs[key] = parse_spec(val)
    if "m" not in specs:
        raise QstateError(f"in {raw!r}: the m state needs a spec")
    # `m=SPEC` alone names the momentum of Lion / SGD / Muon; an optimizer with a v refuses it
    # (spec("v")) instead of putting AdamW's non-negative v on m's signed grid without a word
    return StateConfig(specs["m"], specs.get("v", specs["m"]), v_given="v" in specs)


def _preset_name(cfg: StateConfig) -> str | None:
    for name, (canon, _) in PRESETS.items():
        if _parse_explicit(canon).canonical() == cfg.canonical():
            return name
    return None
