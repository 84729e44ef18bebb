"""Each library's stored optimizer states read back to fp32 (qstate doctor's decoders).

    plain tensors (torch.optim)       _plain: cast to fp32 (a non-float dtype marked, not read)
    torchao OptimState4bit/8bit/Fp8   _torchao: qmap[code] * scale[block], fp8: code * scale
    bitsandbytes state1/state2        _bnb: qmap[code] * absmax[block]
    qstate m, v                       _qstate: QuantizedState's decode, in any of the layouts the
                                      optimizer saves (flat, rows, elements: states.py's docstring)

Each returns a StoredState: the values, what stored them, the bytes held, and problems found
in codes, scales or code books. states.py walks a checkpoint and calls these.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import QstateError
from ..quant.config import MIN_QUANT_NUMEL, STATE_IDS, parse_config, parse_spec
from ..quant.state import spec_nbytes
from ..quant.packing import pack
from ..quant.quantizer import Stream, decode
from ..trace.plain import tensor_kind
from .safeload import LowBitState

ROLES = {"exp_avg": "m", "momentum_buffer": "m", "state1": "m", "m": "m",
         "exp_avg_sq": "v", "max_exp_avg_sq": "v", "state2": "v", "v": "v"}
FLOAT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


@dataclass
class StoredState:
    name: str
    role: str  # "m" | "v" | "other"
    storage: str  # "fp32", "fp16", "torchao 4-bit", "bnb 8-bit", "qstate int4:bred:b128", ...
    low_bit: bool  # codes + scales (a quantized format), not a float tensor
    values: torch.Tensor  # fp32, in the state's shape (flat where the checkpoint does not keep it)
    nbytes: int  # bytes the checkpoint holds for it (codes, scales, code book)
    float_dtype: torch.dtype | None = None  # the stored float dtype (plain tensors; complex: its real dtype)
    non_float: bool = False  # a plain tensor of an integer or bool dtype (values cast, not to be checked)
    shape_known: bool = True
    problems: list[str] = field(default_factory=list)  # codes, scales or code book out of range
    decoded: bool = True  # False: stored values not read back (a qstate state whose group names no format or
    #                       no integer seed); `values` is then empty and no check reads it
    stored_numel: int | None = None  # an undecoded state's number of elements, where its format tells it
    memory_nbytes: int | None = None  # where the checkpoint stores it in another layout than the optimizer holds
    #                                   it (qstate's per-element form from FSDP2): the format's own bytes
    layout: str = ""  # qstate: "elements" (the per-element checkpoint form), else ""
    unreadable: str = ""  # a tensor of it is not dense with data (tensors.py): what it is; `decoded` False

    @property
    def held_nbytes(self) -> int:
        """Bytes the optimizer holds for this state in memory (its format's; else nbytes)."""
        return self.nbytes if self.memory_nbytes is None else self.memory_nbytes

    @property
    def numel(self) -> int:
        if not self.decoded:
            return self.stored_numel or 0
        return self.values.numel()


def scalar(value) -> float | None:
    """One real number (a Python number or a one-element tensor), else None (also for a
    tensor without readable data: meta, sparse, nested; trace/plain.py)."""
    if isinstance(value, torch.Tensor) and not tensor_kind(value) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def plain_state(key: str, t: torch.Tensor) -> StoredState:
    name = FLOAT_NAMES.get(t.dtype, dtype_name(t.dtype))
    vals = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()  # complex params' states
    return StoredState(key, ROLES.get(key, "other"), name, False, vals.to(torch.float32), t.numel() * t.element_size(),
                       float_dtype=vals.dtype if is_float(t) else None, non_float=not is_float(t))


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _check_scales(scales: torch.Tensor, what: str, problems: list[str]) -> torch.Tensor:
    s = scales.to(torch.float32)
    bad = int((~torch.isfinite(s)).sum())
    neg = int((s < 0).sum())
    if bad:
        problems.append(f"{bad} non-finite {what}")
    if neg:
        problems.append(f"{neg} negative {what}")
    return s


def _check_qmap(qmap: torch.Tensor, size: int, what: str, problems: list[str]) -> torch.Tensor:
    q = qmap.to(torch.float32).reshape(-1)
    if q.numel() != size:
        problems.append(f"{what} has {q.numel()} entries, not {size}")
    elif not bool(torch.isfinite(q).all()) or float(q.abs().max()) > 1.0 + 1e-6:
        problems.append(f"{what} holds values outside [-1, 1]")
    elif bool((q[1:] < q[:-1]).any()):
        problems.append(f"{what} is not sorted")
    return q


def _blockwise(codes: torch.Tensor, qmap: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """qmap[code] * scale of the code's block (block = ceil(numel / len(scales)))."""
    idx = codes.reshape(-1)[:numel].long().clamp(max=qmap.numel() - 1)
    vals = qmap[idx]
    block = max(1, -(-numel // max(1, scales.numel())))
    which = (torch.arange(numel) // block).clamp(max=max(0, scales.numel() - 1))
    return vals * scales.reshape(-1)[which] if scales.numel() else vals


def is_torchao(value) -> bool:
    """A torchao low-bit state: our stand-in, or torchao's own class where a process that
    imported torchao let torch load it (torchao allow-lists its classes itself)."""
    return isinstance(value, LowBitState) or (isinstance(value, torch.Tensor)
                                              and type(value).__module__.startswith("torchao.optim"))


def torchao_state(key: str, t: torch.Tensor, where: str) -> StoredState:
    problems: list[str] = []
    cls = type(t).__name__
    codes, scale = t.__dict__.get("codes"), t.__dict__.get("scale")
    if not isinstance(codes, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise QstateError(f"{where}: {key} ({cls}) lacks its codes or scale")
    shape = tuple(t.shape)
    numel = math.prod(shape)
    s = _check_scales(scale, "scales", problems)
    if cls == "OptimStateFp8":
        storage = "torchao fp8"
        vals = codes.reshape(-1).to(torch.float32)
        block = max(1, numel // max(1, s.numel()))
        vals = vals * s.repeat_interleave(block)[:numel] if vals.numel() == numel else vals
        nbytes = _bytes(codes, scale)
    else:
        bits = 4 if cls == "OptimState4bit" else 8
        storage = f"torchao {bits}-bit"
        qmap = _check_qmap(t.__dict__.get("qmap", torch.empty(0)), 2**bits, "code book", problems)
        flat = torch.stack([codes >> 4, codes & 0xF], dim=-1).reshape(-1) if bits == 4 else codes.reshape(-1)
        if flat.numel() != numel:
            problems.append(f"{flat.numel()} codes for a state of {numel} elements")
        block = int(t.__dict__.get("block_size", 0) or 0)
        if block and s.numel() * block != flat.numel():
            problems.append(f"{s.numel()} scales x block {block} != {flat.numel()} codes")
        vals = _blockwise(flat, qmap, s, min(numel, flat.numel())) if qmap.numel() else flat.float()
        nbytes = _bytes(codes, scale, t.__dict__.get("qmap"))
    if vals.numel() == numel:
        vals = vals.view(shape)
    return StoredState(key, ROLES.get(key, "other"), storage, True, vals, nbytes, problems=problems)


def bnb_state(key: str, codes: torch.Tensor, entry: dict, where: str) -> StoredState:
    n = key[-1]
    problems: list[str] = []
    qmap = entry.get(f"qmap{n}")
    absmax = entry.get(f"absmax{n}")
    if absmax is None:
        absmax = entry.get(f"max{n}")
    if not isinstance(qmap, torch.Tensor) or not isinstance(absmax, torch.Tensor):
        raise QstateError(f"{where}: {key} is uint8 but its qmap{n}/absmax{n} are missing")
    q = _check_qmap(qmap, 256, f"qmap{n}", problems)
    s = _check_scales(absmax, f"absmax{n}", problems)
    vals = _blockwise(codes, q, s, codes.numel()).view(codes.shape)
    return StoredState(key, ROLES.get(key, "other"), "bnb 8-bit", True, vals, _bytes(codes, absmax, qmap),
                       problems=problems)


def group_seed(group: dict) -> int | None:
    """A qstate group's `seed` (its replay streams'; 0 when absent) as an int, None when it
    is not an integer (a bool, a float, text, a tensor of several elements or a float one)."""
    seed = group.get("seed", 0)
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    if (isinstance(seed, torch.Tensor) and not tensor_kind(seed) and seed.numel() == 1 and seed.dtype != torch.bool
            and not is_float(seed)):
        return int(seed.item())
    return None


def min_quant_numel(group: dict) -> int:
    """A qstate group's `min_quant_numel` (tensors with fewer elements keep fp32 states;
    optim/base.py spec_for), 4096 where the group does not hold one number."""
    n = scalar(group.get("min_quant_numel"))
    return int(n) if n is not None and math.isfinite(n) else MIN_QUANT_NUMEL


def qstate_state(key: str, value: dict, group: dict, index: int, where: str):
    """One qstate state in any of the layouts the optimizer saves (module docstring):
    flat, rows (codes [rows, row bytes], scales [rows, row blocks]) or elements
    (`block_starts`). A layout that cannot be read is a QstateError naming the state.
    Codes that need the group's format where the group names none (no `states`), or its
    replay stream where the group's `seed` is not an integer, come back undecoded
    (`decoded` False): the group's finding says why (checks.py)."""
    codes, scales = value.get("codes"), value.get("scales")
    written = int(scalar(value.get("written")) or 0)
    if not isinstance(codes, torch.Tensor):
        raise QstateError(f"{where}: {key}.codes is not a tensor")
    if scales is not None and not isinstance(scales, torch.Tensor):
        raise QstateError(f"{where}: {key}.scales is {type(scales).__name__}, not a tensor")
    problems: list[str] = []
    starts = value.get("block_starts")
    small = min_quant_numel(group)
    if codes.dtype == torch.float32:
        spec = parse_spec("fp32")
    elif is_float(codes) and starts is None and codes.numel() < small:  # one value per element, under the limit
        raise QstateError(f"{where}: {key}.codes are {dtype_name(codes.dtype)}, not the float32 values of fp32: a "
                          f"tensor of {codes.numel():,} elements (under its group's min_quant_numel {small:,}) "
                          f"keeps fp32 states")
    elif group.get("states") is None:  # no format to decode with: the group's finding (checks.py)
        return _undecoded(key, codes, scales, starts), written
    else:
        try:
            spec = parse_config(str(group.get("states"))).spec(key)
        except QstateError as exc:
            raise QstateError(f"{where}: {key}: the group's states {group.get('states')!r}: {exc}") from None
    bits = spec.fmt.bits
    want = _CODE_DTYPES.get(bits, ()) if spec.fmt.kind != "identity" else (torch.float32,)
    if codes.dtype not in want:
        raise QstateError(f"{where}: {key}.codes are {dtype_name(codes.dtype)}, not the "
                          f"{' or '.join(dtype_name(d) for d in want) or '?'} codes of {spec}")
    nbytes = _bytes(codes, scales, starts)
    shape = None
    memory = None
    if starts is not None:  # elements form: one code (and scale) per element, shaped like the parameter
        shape = tuple(codes.shape)
        codes, scales, segments = _elements_form(key, codes, scales, starts, spec, where)
        numel = sum(n for _, n, _ in segments)
        memory = spec_nbytes(spec, numel)
    else:  # flat, or rows form: row-major, so flattening gives the whole tensor's flat order
        codes = codes.reshape(-1)
        numel = codes.numel() * 8 // bits if bits < 8 else codes.numel()
        segments = [(0, numel, None)]
        if scales is not None:
            scales = scales.reshape(-1)
    if scales is not None:
        scales = _check_scales(scales, "scales", problems)
        expected = -(-numel // spec.block) if spec.scaled else (1 if spec.has_scales else None)
        if starts is None and expected is not None and scales.numel() != expected:
            problems.append(f"{scales.numel()} scales for {numel} elements in blocks of {spec.block or numel}")
            scales = None
    elif spec.has_scales:
        problems.append("no scales stored for a block-scaled format")
    seed = group_seed(group)
    storage = "fp32" if spec.fmt.kind == "identity" else f"qstate {spec}"
    if seed is None and written and spec.fmt.kind != "identity":  # its replay stream is unknown
        return StoredState(key, ROLES.get(key, "other"), storage, True, torch.zeros(0), nbytes, shape_known=False,
                           problems=problems, decoded=False, stored_numel=numel), written
    if written == 0:
        vals = torch.zeros(numel)
    elif spec.has_scales and scales is None:
        vals = torch.full((numel,), float("nan"))
    else:
        sid = STATE_IDS.get(key, 0)
        try:
            vals = torch.cat([decode(c if c is not None else codes, _seg_scales(scales, spec, start, n, segments),
                                     spec, n, written, Stream(seed or 0, int(index), sid, start))
                              for start, n, c in segments]) if numel else torch.zeros(0)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            msg = " ".join(str(exc).split())[:160]
            raise QstateError(f"{where}: {key}: codes {tuple(value['codes'].shape)} and scales "
                              f"{tuple(value['scales'].shape) if isinstance(value.get('scales'), torch.Tensor) else None}"
                              f" do not decode as {spec} ({type(exc).__name__}: {msg})") from None
    vals = vals.to(torch.float32)
    if shape is not None and vals.numel() == math.prod(shape):
        vals = vals.view(shape)
    state = StoredState(key, ROLES.get(key, "other"), storage, spec.fmt.kind != "identity", vals, nbytes,
                        float_dtype=torch.float32 if storage == "fp32" else None,
                        shape_known=shape is not None and vals.dim() == len(shape), problems=problems,
                        memory_nbytes=memory, layout="elements" if starts is not None else "")
    return state, written


_CODE_DTYPES = {4: (torch.uint8,), 8: (torch.uint8,), 16: (torch.int16,)}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32"."""
    return str(dtype).replace("torch.", "")


def _undecoded(key: str, codes, scales, starts) -> StoredState:
    """A qstate state whose format is unknown: its bytes counted, its values not read."""
    return StoredState(key, ROLES.get(key, "other"), "qstate (format unknown)", True, torch.zeros(0),
                       _bytes(codes, scales, starts), shape_known=False, decoded=False)


def _seg_scales(scales, spec, start: int, n: int, segments: list):
    """The scales of one segment: all of them (one segment, or per-tensor scales), else
    the segment's blocks (elements form: `scales` holds one per block, in order)."""
    if scales is None or len(segments) == 1 or not spec.scaled:
        return scales
    first = sum(-(-m // spec.block) for s, m, _ in segments if s < start)
    return scales[first:first + -(-n // spec.block)]


def _elements_form(key: str, codes, scales, starts, spec, where: str):
    """A sharded state saved per element (optim/sharded_state.py: a row is not whole
    blocks): codes one per element (unpacked), scales one per element (its block's),
    `block_starts` 1 on each block's first element. A shard quantized on local blocks
    starts a block inside a whole-tensor block, after a short one: each such run
    ("segment") is decoded with its own counter offset, as the optimizer encoded it.
    Returns (flat codes, one scale per block or None, [(start, numel, packed codes)])."""
    if not isinstance(starts, torch.Tensor):
        raise QstateError(f"{where}: {key}.block_starts is {type(starts).__name__}, not a tensor")
    numel = codes.numel()
    flat = codes.reshape(-1)
    marks = starts.reshape(-1)
    if marks.numel() != numel or (spec.scaled and scales is not None and scales.numel() != numel):
        raise QstateError(f"{where}: {key}: saved per element, but codes {tuple(codes.shape)}, block_starts "
                          f"{tuple(starts.shape)} and scales {None if scales is None else tuple(scales.shape)} "
                          f"differ in size")
    bits = spec.fmt.bits
    if numel and bits < 16 and int(flat.max()) >= 2**bits:
        raise QstateError(f"{where}: {key}: saved per element, but holds a code {int(flat.max())} that does not fit "
                          f"{bits} bits")
    block = spec.dither_block if spec.scaled or spec.rounding == "bred" else None
    idx = torch.nonzero(marks != 0).reshape(-1)
    if block is None or numel == 0:
        bounds = [0]
    else:
        gaps = torch.diff(idx, append=torch.tensor([numel]))
        if idx.numel() == 0 or int(idx[0]) != 0 or int(gaps.max()) > block:
            raise QstateError(f"{where}: {key}: its block_starts do not lay {numel:,} elements in blocks of at most "
                              f"{block} starting at element 0")
        bounds = [0] + [int(i) for i in idx[1:][gaps[:-1] < block]]  # a short block ends a shard's local blocks
    ends = bounds[1:] + [numel]
    segs = []
    for a, b in zip(bounds, ends):
        c = flat[a:b].to(torch.int32)
        segs.append((a, b - a, pack(c, bits) if bits < 16 else c.to(torch.int16)))
    if scales is not None:
        scales = scales.reshape(-1)[idx] if spec.scaled else scales.reshape(-1)  # per tensor: as stored
    return flat, scales, segs
