"""QuantizedState: one stored optimizer state (codes + block scales) and how it was written.

The object holds only tensors and small integers, so an optimizer can keep its fields in
`optimizer.state` (plain tensors survive `torch.save(..., weights_only=True)`) and
rebuild the object with `from_tensors`.

    codes    uint8 (packed 4/8-bit), int16 (bf16/fp16 bit patterns) or fp32 (identity)
    scales   fp32 (or bf16) absmax per block, or None
    written  the optimizer step at which the codes were written (0: never, reads as 0);
             BReD and stochastic rounding replay their random bits from it
"""
from __future__ import annotations

import torch

from .config import StateSpec
from .formats import state_bytes
from .packing import num_blocks
from .quantizer import Stream, decode, encode


def spec_nbytes(spec: StateSpec, numel: int) -> int:
    """Bytes a state of `numel` elements holds in `spec`'s layout: packed codes (fp32: 4 per
    element), one scale per block or one for the tensor."""
    block = spec.block if spec.scaled else None
    tensor_scale = spec.scale_bytes if spec.tensor_scale else 0
    return state_bytes(spec.fmt, numel, block, spec.scale_bytes) + tensor_scale


class QuantizedState:
    reduce_absmax = None  # a tensor scale over pieces of one tensor (quantizer.encode; diagnose under torchrun)

    def __init__(self, spec: StateSpec, shape, stream: Stream = Stream(), device=None, reduce_absmax=None):
        self.spec = spec
        self.reduce_absmax = reduce_absmax
        self.shape = torch.Size(shape)
        self.stream = stream
        self.codes, self.scales = empty_storage(spec, self.shape.numel(), device)
        self.written = 0

    # ---- the three operations ------------------------------------------------------
    def encode(self, x: torch.Tensor, step: int) -> None:
        """Store x (fp32 math) as written at optimizer step `step` (>= 1)."""
        if x.shape != self.shape and x.numel() != self.numel:
            raise ValueError(f"state of shape {tuple(self.shape)} cannot store {tuple(x.shape)}")
        self.codes, self.scales = encode(x, self.spec, step, self.stream, self.reduce_absmax)
        self.written = int(step)

    def decode(self) -> torch.Tensor:
        """The stored value as fp32, in the state's shape (zeros if never written)."""
        if self.written == 0:
            return torch.zeros(self.shape, dtype=torch.float32, device=self.codes.device)
        flat = decode(self.codes, self.scales, self.spec, self.numel, self.written, self.stream)
        return flat.view(self.shape)

    def reset(self) -> None:
        """Back to the never-written state (reads as exact zeros)."""
        self.codes, self.scales = empty_storage(self.spec, self.numel, self.codes.device)
        self.written = 0

    # ---- accounting ------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes plus scales (equals formats.state_bytes)."""
        n = self.codes.numel() * self.codes.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def expected_nbytes(self) -> int:
        return spec_nbytes(self.spec, self.numel)

    # ---- plain-tensor round trip -----------------------------------------------------
    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {"codes": self.codes, "written": torch.tensor(self.written, dtype=torch.int64)}
        if self.scales is not None:
            out["scales"] = self.scales
        return out

    @classmethod
    def from_tensors(cls, spec: StateSpec, shape, stream: Stream, tensors: dict) -> "QuantizedState":
        st = cls.__new__(cls)
        st.spec, st.shape, st.stream = spec, torch.Size(shape), stream
        st.codes = tensors["codes"]
        st.scales = tensors.get("scales")
        st.written = int(tensors["written"])
        return st

    def __repr__(self) -> str:
        return (f"QuantizedState({self.spec}, shape={tuple(self.shape)}, written={self.written}, "
                f"nbytes={self.nbytes})")



class ReadBackState(QuantizedState):
    """A QuantizedState whose encode (a fused codec: diagnose/codec.py) also computes the
    value read back, decode(encode(x)), into `_read_back`. decode() hands that tensor over
    the first time after an encode (the caller owns it: the replay clamps and masks it in
    place) and decodes the stored codes, as QuantizedState does, after that."""

    _read_back: torch.Tensor | None = None

    def decode(self) -> torch.Tensor:
        if self.written and self._read_back is not None:
            value, self._read_back = self._read_back, None
            return value.view(self.shape)
        return super().decode()

    def reset(self) -> None:
        super().reset()
        self._read_back = None

def empty_storage(spec: StateSpec, numel: int, device):
    """The codes and scales (None: unscaled) a never-written state of `numel` elements holds."""
    fmt = spec.fmt
    if fmt.kind == "identity":
        return torch.zeros(numel, dtype=torch.float32, device=device), None
    nbytes = -(-numel * fmt.bits // 8)
    if fmt.bits == 16:
        codes = torch.zeros(numel, dtype=torch.int16, device=device)
    else:
        codes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    scales = None
    if spec.has_scales:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.scale_dtype, torch.float32)
        count = num_blocks(numel, spec.block) if spec.scaled else 1
        scales = torch.zeros(count, dtype=dtype, device=device)
    return codes, scales
