"""The replay's quantized states on the fused Triton codec (kernels/codec.py).

TritonReplayState is a quant.QuantizedState over the replay's flat layout (layout.py)
whose encode(x, step) is one kernel launch: it writes the codes and block scales that
quant.encode writes and keeps the value read back, which the next decode() returns
(quant.decode of those codes, bit for bit: tests/test_replay_codec_triton.py). The
random bits are the layout stream's: per quantization block b of the layout, the stream
key of its tensor (LayoutStream.base) and the counter of its first element in that tensor,

    BReD        ctr[b] = element_index[b B] // B       (LayoutStream "block": idx[::B] // B)
    stochastic  ctr[b] = element_index[b B] >> 1       (element j of the block: hash counter
                                                        ctr[b] + (j >> 1), half j & 1)

which is exact where each block's recorded elements are consecutive in their tensor (trace
blocks of 2048 hold whole quantization blocks; checked here) and padding holds 0, except
stochastic rounding of a code book without a code for 0 (de4nz, de8nz: 0 rounds by the
random bits; padding draws other bits than LayoutStream's), which keeps the reference on a
padded layout (zero_takes_bits).

Covered: what the fused optimizer kernels cover (launch.why_not_covered: linear int4/uint4/
int8/uint8 and the code books, any rounding, :sqrt, fp32 or bf16 block scales); tensor
scales (te-fp8, all-reduced under torchrun) and FlashOptim's arithmetic are not, and the
replay keeps the reference for them. On CUDA the factory (diagnose/codec.FUSED["cuda"])
picks it; on CPU tensors it runs in Triton's interpreter (TRITON_INTERPRET=1) for tests.
"""
from __future__ import annotations

import torch

from ..kernels import codec as kcodec
from ..kernels import unavailable_reason
from ..kernels.launch import interpreting, kernel_layout, why_no_codec
from ..quant import StateSpec
from ..quant.state import ReadBackState
from ..quant import hash as qhash

PATH = "triton"


def why_not(spec: StateSpec, layout, stream) -> str | None:
    """None where the codec kernel stores this state on this layout, else the reason."""
    why = why_no_codec(spec)
    if why is not None:
        return why
    if layout.unit % spec.block:
        return f"block {spec.block} does not divide the layout's unit {layout.unit}"
    if spec.rounding != "nearest" and getattr(stream, "layout", None) is not layout:
        return "the random stream is not this layout's (diagnose/layout.LayoutStream)"
    why = unavailable_reason(layout.device)
    if why is None and spec.rounding != "nearest":
        why = _block_counters(spec, layout)[1]
    if why is None and spec.rounding == "stochastic" and layout.valid is not None and zero_takes_bits(spec):
        why = (f"stochastic {spec.fmt.name} has no code for 0: the layout's padding rounds by the reference's "
               f"random bits, which this codec does not draw")
    return why


def zero_takes_bits(spec: StateSpec) -> bool:
    """Whether a stored 0 (the layout's padding) is rounded by the random bits: a code book
    whose entries straddle 0 without holding it (de4nz, de8nz), so 0 sits between two codes
    at frac 1/2. The kernel hashes padding elements as the block's next elements, where
    LayoutStream folds them to counter 0 of the tensor: their codes would differ."""
    table = spec.fmt.table if spec.fmt.kind == "table" else ()
    return bool(table) and min(table) < 0.0 < max(table) and 0.0 not in table


def triton_state(spec: StateSpec, layout, stream, reduce_absmax=None):
    """The factory of diagnose/codec.FUSED: (state, None) or (None, why not). reduce_absmax
    only acts on tensor scales, which this codec leaves to the reference."""
    why = why_not(spec, layout, stream)
    if why is not None:
        return None, why
    return TritonReplayState(spec, layout, stream, reduce_absmax), None


def _block_counters(spec: StateSpec, layout) -> tuple[torch.Tensor, str | None]:
    """int64 counter base per quantization block (module docstring), and a reason where
    some block's recorded elements are not consecutive in their tensor (none: None)."""
    B = spec.block
    idx = layout.element_index  # host, int64 [n]
    first = idx[::B]
    pos = torch.arange(layout.n, dtype=torch.int64)
    expect = first.repeat_interleave(B) + pos % B
    held = layout.valid.cpu() if layout.valid is not None else torch.ones(layout.n, dtype=torch.bool)
    if not torch.equal(expect[held], idx[held]):
        return first, f"some {B}-element blocks of the layout are not consecutive elements of one tensor"
    if spec.rounding == "stochastic":
        return first >> 1, None
    return first // B, None


def _int32_bits(values: torch.Tensor) -> torch.Tensor:
    """uint32 values (in int64) as the int32 with the same bits."""
    v = values & qhash.MASK32
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


class TritonReplayState(ReadBackState):
    PATH = PATH

    def __init__(self, spec: StateSpec, layout, stream, reduce_absmax=None):
        super().__init__(spec, (layout.n,), stream, device=layout.device, reduce_absmax=reduce_absmax)
        self.kernel = kernel_layout(spec)
        self.device = layout.device
        self.table = self.kernel.table(layout.device)
        nblocks = layout.n // spec.block
        if spec.rounding == "nearest":  # no random bits: the kernel reads neither
            keys = counters = torch.zeros(nblocks, dtype=torch.int64)
        else:
            counters, why = _block_counters(spec, layout)
            if why is not None:
                raise ValueError(why)
            owner = layout.unit_tensor.cpu().repeat_interleave(layout.unit // spec.block)
            keys = stream.base[owner]
        self.block_keys = _int32_bits(keys).to(layout.device)
        self.block_counters = _int32_bits(counters).to(layout.device)

    def encode(self, x: torch.Tensor, step: int) -> None:
        """Store x as written at optimizer step `step` (>= 1), keeping the value read back."""
        if x.numel() != self.numel:
            raise ValueError(f"state of shape {tuple(self.shape)} cannot store {tuple(x.shape)}")
        x = x.detach().reshape(-1).to(device=self.device, dtype=torch.float32).contiguous()
        n, spec = self.numel, self.spec
        codes = torch.empty(n * spec.fmt.bits // 8, dtype=torch.uint8, device=self.device)
        scales = torch.empty(n // spec.block, dtype=torch.bfloat16 if self.kernel.sbf16 else torch.float32,
                             device=self.device)
        out = torch.empty(n, dtype=torch.float32, device=self.device)
        kcodec.encode_decode(x, out, codes, scales.view(torch.int16) if self.kernel.sbf16 else scales,
                             self.block_keys, self.block_counters, self.kernel, int(step),
                             interpret=interpreting(), table=self.table)
        self.codes, self.scales, self.written, self._read_back = codes, scales, int(step), out
