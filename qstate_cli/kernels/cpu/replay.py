"""The replay's fused CPU codec: `qstate diagnose`'s quantized states encoded and read back
in one numba pass per block, bit for bit as quant.QuantizedState (the reference).

Per quantization block b of B elements of the flat layout (diagnose/layout.py), on an
L1-resident row (codec.py's helpers, so the spec is the optimizers' fused kernels' own):

    v      = stored_value(x): non-finite -> 0, sqrt(max(x, 0)) / max(x, 0) as the spec says
    absmax = max |v| (bf16 scales: rounded up), n = v * (top / absmax) (0 if absmax < top 2**-126)
    q      = the rounding of n (nearest / stochastic / BReD), clamped, packed into the codes
    x_hat  = decode_block(q): the value the reference's decode reads back

so one encode(x, step) leaves the codes, the scales AND the value read back; decode()
hands that value over (reset / never written: zeros, as the reference). States: the
block-scaled 4- and 8-bit formats (linear, code books, minifloats), and an unscaled 16-bit
minifloat (bf16, fp16: n = v, the 16-bit pattern stored as is, replay_codec16) rounded to
nearest or stochastically, walked in runs of gcd(unit, UNSCALED_BLOCK) positions.

Random bits, as LayoutStream draws them (layout.py): block b holds elements of one tensor t
(plan[b, 0]) at consecutive flat indices o = plan[b, 1], o + 1, ... (its nvalid = plan[b, 2] recorded
elements; the rest is padding), with the stream keys (k1, k2) of tensor t at the step:
    stochastic  element j < nvalid: uniform16(o + j, k1, k2), one hash per pair of elements (o
                even); padding: uniform16((p + j) & 1, k1, k2) (p = b * B, the layout position:
                LayoutStream folds a padding element to counter 0)
    BReD        uniform(o // B, k1, k2)   (o = 0 for a block of padding only)
The factory checks that every block is such a run (else the reference runs, with the reason).

One compiled kernel for every covered spec: the state layout (launch.StateLayout as codec.py's
`lay` ints) is a runtime argument here, not a compile-time constant as in the optimizer
kernels, because one `qstate diagnose` replays ~14 (configuration, state) layouts and a
compilation per layout would cost each of them seconds (30-50 s for an optimizer kernel). numba caches it on disk (cache=True, in numba_cache_dir()), so
only the first use on a machine compiles (docs/diagnose.md states the cost). numba is
imported on first use only.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ...quant.state import ReadBackState
from ...quant import hash as qhash
from ..launch import ROUNDING_CODES, StateLayout, kernel_layout, why_no_codec
from . import unavailable_reason
from .host import MINIFLOAT_KIND, layout_arrays, run_blocks  # no numba there

PATH = "cpu-numba"


def fused_state(spec, layout, stream, reduce_absmax=None):
    """diagnose/codec.FUSED["cpu"]: (a FusedReplayState, None), or (None, why the reference runs).

    reduce_absmax (torchrun's element split) only changes a tensor-scaled state, which the
    codec does not cover; for a block-scaled state each block's scale is its own, so a part
    of the layout encodes as the whole layout does. The spec's reason comes first: a state
    the codec never covers says why, not that numba is missing."""
    why = why_not_fused(spec) or unavailable_reason(layout.device)
    if why is not None:
        return None, why
    plan = _plan(layout, block_of(spec, layout.unit))
    if isinstance(plan, str):
        return None, plan
    if spec.rounding != "nearest" and not hasattr(stream, "base"):
        return None, "the stream has no per-tensor keys (not a diagnose.layout.LayoutStream)"
    if spec.rounding == "stochastic" and (plan[:, 1] & 1).any():  # recorded blocks are 2048-aligned: never so
        return None, "a block starts at an odd element index (stochastic rounding hashes pairs of elements)"
    return FusedReplayState(spec, layout, stream, plan), None


UNSCALED_BLOCK = 256  # the most the kernels walk at once over an unscaled state (no scales: any divisor of the unit)


def unscaled16(spec) -> bool:
    """An unscaled 16-bit minifloat (bf16, fp16: replay_kernel.replay_codec16)."""
    return spec.fmt.kind == "float" and spec.fmt.bits == 16 and not spec.has_scales


def why_not_fused(spec) -> str | None:
    """Why the CPU replay's kernels (this codec, replay_model's staleness model) do not take
    this state, or None: launch.why_no_codec with the block-scaled minifloats, and besides
    an unscaled 16-bit minifloat rounded to nearest or stochastically."""
    if unscaled16(spec) and not spec.per_element_division:
        if spec.rounding == "bred":
            return f"{spec.fmt.name} unscaled under BReD (a dither per {spec.dither_block} elements) has no fused codec"
        return None
    return why_no_codec(spec, minifloats=True)


def block_of(spec, n: int) -> int:
    """The kernels' run length over a layout of n-element units (or n elements): the spec's
    block, or for an unscaled state gcd(n, UNSCALED_BLOCK), which divides every unit."""
    return int(spec.block) if spec.scaled else math.gcd(int(n), UNSCALED_BLOCK)


def _plan(layout, B: int):
    """int64 [blocks, 3]: per block of B layout positions (owner tensor, flat index of its first
    element, recorded elements), or why the blocks are not runs of consecutive elements of one tensor."""
    n = layout.n
    if n % B or layout.unit % B:
        return f"block size {B} does not divide the layout's {layout.unit}-element units"
    nb = n // B
    idx = layout.element_index.view(nb, B)
    valid = (layout.valid.cpu() if layout.valid is not None else torch.ones(n, dtype=torch.bool)).view(nb, B)
    nvalid = valid.sum(1)
    j = torch.arange(B)
    if not torch.equal(valid, j[None, :] < nvalid[:, None]):
        return "padding inside a block (recorded elements are not a prefix of each block)"
    run = idx[:, :1] + j[None, :]
    if not torch.equal(torch.where(valid, idx, run), run):
        return "a block's recorded elements are not consecutive in their tensor"
    owner = layout.unit_tensor.cpu().repeat_interleave(layout.unit // B)
    return torch.stack([owner.to(torch.int64), idx[:, 0], nvalid.to(torch.int64)], 1).contiguous().numpy()


class FusedReplayState(ReadBackState):
    """The whole layout's state, its encode the fused kernel (module docstring); decode()
    hands over the value read back once (quant.state.ReadBackState)."""

    PATH = PATH

    def __init__(self, spec, layout, stream, plan):
        super().__init__(spec, (layout.n,), stream, device="cpu")
        self.block = block_of(spec, layout.unit)
        kl = kernel_layout(spec, minifloats=True) if spec.scaled else _unscaled_layout(spec, self.block)
        self.lay, self.lim, self.table = layout_arrays(kl, kl.table("cpu"))  # a code book: with its buckets
        self.plan = plan
        base = stream.base.numpy() if hasattr(stream, "base") else np.zeros(max(1, layout.n_tensors), np.int64)
        self.base = np.asarray(base & qhash.MASK32, np.uint32)  # nearest: no random bits, any keys
        self._scale_dtype = self.scales.dtype if self.scales is not None else None  # fp32 or bf16 (empty_storage)

    def encode(self, x: torch.Tensor, step: int, clamp_zero: bool = False, zero_padding: bool = False) -> None:
        """Store x; the value read back (decode) is the reference's decode, or as the replay
        keeps it (diagnose/step.store): clamp_zero, a value below 0 read back as 0 (torch's
        clamp(min=0)); zero_padding, the layout's padding 0 (the blocks' positions past their
        recorded elements: plan)."""
        if x.numel() != self.numel:
            raise ValueError(f"state of shape {tuple(self.shape)} cannot store {tuple(x.shape)}")
        x = x.detach().reshape(-1)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        out = torch.empty(self.numel, dtype=torch.float32)
        if self._scale_dtype is None:  # bf16, fp16: 16-bit patterns, no scales
            codes = torch.empty(self.numel, dtype=torch.int16)
            run_blocks(_kernel(16), self.numel, self.block,
                       (x.numpy(), codes.numpy().view(np.uint16), out.numpy(), self.lay, self.block, self.numel,
                        self.plan, self.base, int(step), bool(clamp_zero), bool(zero_padding)))
            self.codes, self.written, self._read_back = codes, int(step), out
            return
        # fresh tensors per step, as the reference (the replay keeps the previous ones); every
        # byte is written (the layout holds whole blocks of an even size)
        codes = torch.empty(self.numel * self.spec.fmt.bits // 8, dtype=torch.uint8)
        scales = torch.empty(self.numel // self.block, dtype=self._scale_dtype)
        run_blocks(_kernel(), self.numel, self.block,
                   (x.numpy(), codes.numpy(), scales.view(torch.int16).numpy().view(np.uint16), out.numpy(),
                    self.lay, self.lim, self.table, self.block, self.numel, self.plan,
                    self.base, int(step), bool(clamp_zero), bool(zero_padding)))
        self.codes, self.scales, self.written, self._read_back = codes, scales, int(step), out


def _unscaled_layout(spec, block: int) -> StateLayout:
    """The kernel layout of an unscaled 16-bit minifloat (launch.kernel_layout covers the
    block-scaled formats only; top and sbf16 are not read without scales)."""
    fmt = spec.fmt
    return StateLayout(kind=MINIFLOAT_KIND, bits=fmt.bits, signed=fmt.signed, top=float(fmt.top), table_len=0,
                       rounding=ROUNDING_CODES[spec.rounding], sqrt=spec.sqrt, sbf16=False, block=block,
                       man_bits=fmt.man_bits, emin=fmt.emin, max_ordinal=fmt.max_ordinal)


_KERNELS: dict = {}


def _kernel(bits: int = 8):
    """The fused encode + read-back kernel: replay_codec, or replay_codec16 for an unscaled
    16-bit state (imports numba; compiled on first use, cached on disk)."""
    if bits not in _KERNELS:
        from .replay_kernel import replay_codec, replay_codec16
        _KERNELS.update({8: replay_codec, 16: replay_codec16})
    return _KERNELS[bits]
