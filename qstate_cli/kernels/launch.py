"""Host side of the fused kernels: which specs they cover, the multi-tensor launch table.

One launch steps many tensors. Each tensor is a row of an int64 table on the device
(`META_COLUMNS`: addresses of parameter, gradient, codes and scales of each state, the
non-finite counter and the optional fp32 output, numel, tensor id, first program). A
second int32 table maps each program to its tensor; program i of tensor t works on
quantization blocks [(i - first_t) * ROWS, ... + ROWS). Both tables depend only on the
tensors' addresses and sizes, so a caller can cache them (`Batch.key`); they travel to
the device with a non-blocking copy from pinned memory (no host sync on CUDA).

What the kernels cover (`kernel_layout`): linear int4/uint4/int8/uint8 and the table
formats (de4, de4u, de8, de8u, lin4nz and the *nz variants), any rounding, `:sqrt`,
fp32 or bf16 scales, block sizes 32..2048. Not covered (the optimizers step those
parameters with the reference): fp32 identity and the minifloats (bf16, fp16, e4m3,
e5m2, e2m1, e2m2). The CPU path (kernels/cpu) covers the block-scaled 4- and 8-bit
minifloats too (e4m3, e5m2, e2m1, e2m2: `minifloats=True`, kind 3).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..quant import hash as qhash
from ..quant.codebooks import codebook_tensor
from ..quant.config import StateSpec

META_COLUMNS = ("param", "grad", "m_codes", "m_scales", "v_codes", "v_scales", "nonfinite", "out",
                "numel", "tensor_id", "first_program", "m_key", "v_key")
COL = {name: i for i, name in enumerate(META_COLUMNS)}
NCOL = len(META_COLUMNS)  # common.py names the same columns for the kernels
VALUE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ROUNDING_CODES = {"nearest": 0, "stochastic": 1, "bred": 2}
DEFAULT_WARPS = 8
MAX_TILES_PER_PROGRAM = 8
PROGRAMS_WANTED = 1024  # ~8 programs per SM on an H100/H200 before tiles per program grow
LAUNCH_OPTIONS = {"enable_fp_fusion": False}  # no FMA contraction: fp32 ops round as torch's


def interpreting() -> bool:
    """Triton's interpreter is on (set before the kernels were imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class StateLayout:
    """A state spec as the kernels' compile-time constants (codes.decode_state/encode_state)."""

    kind: int  # 0 linear, 1 table, 2 the no-zero linear map {(j + 1) / NT} (lin4nz, lin8nz) without loads,
    #            3 a minifloat (the CPU path only)
    bits: int
    signed: bool
    top: float  # normalised value of the block absmax (linear: L; tables: 1)
    table_len: int  # table entries (0 for linear)
    rounding: int
    sqrt: bool
    sbf16: bool
    block: int
    table_name: str = ""
    man_bits: int = 0  # a minifloat's (kind 3): mantissa bits, least normal exponent, largest magnitude ordinal
    emin: int = 0
    max_ordinal: int = 0

    def constexprs(self, prefix: str) -> dict:
        return {f"{prefix}KIND": self.kind, f"{prefix}BITS": self.bits, f"{prefix}SIGNED": int(self.signed),
                f"{prefix}TOP": self.top, f"{prefix}NT": self.table_len, f"{prefix}ROUND": self.rounding,
                f"{prefix}SQRT": int(self.sqrt), f"{prefix}SBF16": int(self.sbf16)}

    def table(self, device) -> torch.Tensor | None:
        return codebook_tensor(self.table_name, str(torch.device(device))) if self.kind == 1 else None


def why_not_covered(spec: StateSpec, minifloats: bool = False) -> str | None:
    """None if the kernels implement this spec, else the reason (the reference steps it).
    minifloats: the CPU path's kernels, which also take 4- and 8-bit minifloats."""
    fmt = spec.fmt
    if fmt.kind not in ("linear", "table") and not (minifloats and fmt.kind == "float"):
        return f"format {fmt.name} ({fmt.kind}) has no kernel; the reference path steps it"
    if fmt.bits not in (4, 8):
        return f"{fmt.name}: {fmt.bits}-bit codes have no kernel"
    if not spec.scaled:
        return "unscaled states have no kernel"
    if spec.per_element_division:
        return "FlashOptim's arithmetic (softsign, fp16 scales) has no kernel; the reference path steps it"
    return None


def why_no_codec(spec: StateSpec, minifloats: bool = False) -> str | None:
    """Why no fused replay codec (diagnose/codec.py) stores this state on any device (None:
    one may; each device's factory adds its own checks). Given before a missing Triton or
    numba, which would not help. minifloats: the CPU codec's, which also takes them."""
    if spec.tensor_scale:
        return (f"{spec.fmt.name} with a tensor scale (one absmax per tensor; under torchrun all-reduced) "
                f"has no fused codec")
    return why_not_covered(spec, minifloats)


@lru_cache(maxsize=256)
def kernel_layout(spec: StateSpec, minifloats: bool = False) -> StateLayout | None:
    """The spec's compile-time constants, or None where no kernel covers it (minifloats: as
    why_not_covered). Cached (a StateSpec is frozen and hashable): the optimizers ask for it
    at every step, and the no-zero check and a float format's top are torch ops (~0.2 ms per
    state and step)."""
    if why_not_covered(spec, minifloats) is not None:
        return None
    fmt = spec.fmt
    table, minifloat = fmt.kind == "table", fmt.kind == "float"
    kind = 3 if minifloat else (2 if _is_nozero_linear(fmt.table) else 1) if table else 0
    floats = dict(man_bits=fmt.man_bits, emin=fmt.emin, max_ordinal=fmt.max_ordinal) if minifloat else {}
    return StateLayout(kind=kind, bits=fmt.bits, signed=fmt.signed, top=float(fmt.top),
                       table_len=len(fmt.table) if table else 0, rounding=ROUNDING_CODES[spec.rounding],
                       sqrt=spec.sqrt, sbf16=spec.scale_dtype == "bf16", block=int(spec.block),
                       table_name=fmt.name if table else "", **floats)


def _is_nozero_linear(table: tuple[float, ...]) -> bool:
    """The table is exactly {1/NT, 2/NT, ..., 1} in fp32 with NT a power of two: the kernels
    compute its entries instead of loading them (common.py, NOZERO), bit for bit."""
    nt = len(table)
    return nt >= 2 and nt & (nt - 1) == 0 and all(
        float(torch.tensor(v, dtype=torch.float32)) == (j + 1) / nt for j, v in enumerate(table))


def tile_parts(block: int, value_bytes: int = 4) -> int:
    """16-byte vectors of one block row each thread holds (1 or 2): 2 where a block row has
    room for two per thread, so a thread's per-row work (block scale loads, BReD hashes,
    the divisions of the scale) serves twice the elements (every kernel splits its tile into
    parts: adamw.py, lion.py, sgd.py, muon.py)."""
    bp = 1 << (int(block) - 1).bit_length()
    return 2 if bp // 2 >= 16 // int(value_bytes) else 1


def tile_shape(block: int, value_bytes: int = 4, parts: int | None = None) -> tuple[int, int, int]:
    """(BP, ROWS, num_warps) of a program's tile: the block padded to a power of two,
    blocks per program, warps.

    Every thread holds tile_parts() 16-byte vectors of the widest value it loads
    (value_bytes = the larger of parameter and gradient element size: 4 elements of fp32,
    8 of bf16/fp16 per vector), so parameter, gradient and code accesses all get the same
    register layout and Triton inserts no shared-memory layout conversions (checked on the
    sm_90 PTX: only the block-absmax and counter reductions touch shared memory).
    """
    bp = 1 << (int(block) - 1).bit_length()
    per_thread = 16 // int(value_bytes) * (tile_parts(block, value_bytes) if parts is None else parts)
    warps = DEFAULT_WARPS
    rows = max(1, per_thread * 32 * warps // bp)
    if rows * bp > per_thread * 32 * warps:  # one block is bigger than the tile: more warps
        warps = min(32, bp // (per_thread * 32))
    return bp, rows, warps


def tiles_per_program(total_tiles: int) -> int:
    """Consecutive tiles one program steps (1, 2, 4 or 8): enough programs to fill the GPU
    (PROGRAMS_WANTED), as few as that allows, so that per-program work (the address
    table, the hash keys of the step) is spread over up to 8 tiles."""
    tiles = 1
    while tiles < MAX_TILES_PER_PROGRAM and total_tiles >= 2 * tiles * PROGRAMS_WANTED:
        tiles *= 2
    return tiles


def stream_key(seed: int, tensor_id: int, state_id: int) -> int:
    """k = hash32(hash32(hash32(seed) ^ tensor_id) ^ state_id) (quant/hash.stream_keys)."""
    k = qhash.hash32(int(seed) & qhash.MASK32)
    k = qhash.hash32(k ^ (int(tensor_id) & qhash.MASK32))
    return qhash.hash32(k ^ state_id)


def as_int32(value: int) -> int:
    """A uint32 value as the signed int32 with the same bits (kernel scalar arguments stay i32)."""
    value = int(value) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


@dataclass
class Member:
    """One tensor of a launch: the parameter, its gradient and where its states live."""

    param: torch.Tensor
    grad: torch.Tensor
    states: dict  # name -> (codes, scales)
    nonfinite: torch.Tensor  # int64, 0-dim, on the parameter's device
    tensor_id: int
    out: torch.Tensor | None = None  # fp32, param's shape (Muon's update)

    def addresses(self) -> tuple:
        m = self.states.get("m", (None, None))
        v = self.states.get("v", (None, None))
        return tuple(0 if t is None else t.data_ptr() for t in
                     (self.param, self.grad, m[0], m[1], v[0], v[1], self.nonfinite, self.out))


@dataclass
class Batch:
    """The device tables of one multi-tensor launch (see module docstring). They hold raw
    addresses, not references: the caller keeps the members' tensors alive while it
    launches with the batch (the optimizers do: the tensors are parameters, gradients
    and states; a cached batch whose tensors died is never used, its key no longer matches)."""

    meta: torch.Tensor  # int64 [T, NCOL]
    programs: torch.Tensor  # int32 [grid]
    grid: int
    aligned: bool  # every address 16-byte aligned: kernels may use 16-byte vector accesses
    value_bytes: int  # widest parameter/gradient element: sets the tile (tile_shape)
    tiles: int  # tiles per program (tiles_per_program)
    key: tuple
    keep: list = field(default_factory=list)


def batch_key(members: list[Member], block: int, seed: int, tiles: int | None = None) -> tuple:
    return ((int(block), value_bytes(members), int(seed), tiles)
            + tuple((m.addresses(), m.param.numel(), m.tensor_id) for m in members))


def build_batch(members: list[Member], block: int, seed: int = 0, tiles: int | None = None) -> Batch:
    """Address and program tables for `members` (all on one device): tiles of ROWS blocks
    of `block` elements, `tiles` per program (default: tiles_per_program), the stream keys
    of random stream `seed` (state 0 = m, 1 = v; tensor id = Member.tensor_id)."""
    device = members[0].param.device
    _, rows, _ = tile_shape(block, value_bytes(members))
    counts = []
    for m in members:
        if m.grad.numel() != m.param.numel() or not (m.param.is_contiguous() and m.grad.is_contiguous()):
            raise ValueError("kernel launch needs contiguous parameter and gradient of equal size")
        counts.append(-(-m.param.numel() // (rows * block)))
    per_program = tiles or tiles_per_program(sum(counts))
    table, programs, first = [], [], 0
    for i, (m, ntiles) in enumerate(zip(members, counts)):
        nprog = -(-ntiles // per_program)
        keys = [stream_key(seed, m.tensor_id, s) for s in (0, 1)]
        table.append(list(m.addresses()) + [m.param.numel(), m.tensor_id, first] + keys)
        programs.append(torch.full((nprog,), i, dtype=torch.int32))
        first += nprog
    meta = torch.tensor(table, dtype=torch.int64)
    prog = torch.cat(programs)
    addresses = [a for row in table for a in row[:8] if a]
    aligned = all(a % 16 == 0 for a in addresses)
    return Batch(meta=_to_device(meta, device), programs=_to_device(prog, device), grid=first,
                 aligned=aligned, value_bytes=value_bytes(members), tiles=per_program,
                 key=batch_key(members, block, seed, tiles), keep=[meta, prog])


def value_bytes(members: list[Member]) -> int:
    """Largest element size among the parameters, gradients and outputs of a launch."""
    return max(max(m.param.element_size(), m.grad.element_size(), 0 if m.out is None else m.out.element_size())
               for m in members)


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
