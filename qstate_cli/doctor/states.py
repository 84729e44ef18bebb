"""What a checkpoint's optimizer states hold, read back to fp32 whatever stored them.

    find_optimizers(obj) -> [OptimizerStates]     every optimizer state dict inside a checkpoint

An optimizer state dict is any dict with `state` and `param_groups` (torch's layout; also
inside `{"optimizer": ...}`, Lightning's `optimizer_states` list, a DCP checkpoint's
`optim` entry with parameter names as keys). Per parameter, each stored state becomes a
`StoredState`: its values decoded to fp32 (`values`), what stored them (`storage`), the
bytes it holds and, for quantized states, problems in its codes, scales or code book.

Who stored what (read here without importing any of them):

    torch.optim    exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer: plain tensors
                   (fp32, or whatever dtype a checkpoint cast them to)
    qstate         m, v: {codes, scales, written} of a QuantizedState; the group's `states`
                   names the format (parsed with quant.config), its `seed` the replay stream
    torchao        exp_avg, exp_avg_sq: OptimState4bit / OptimState8bit / OptimStateFp8
                   (safeload.LowBitState stand-ins): value = qmap[code] * scale[block]
                   (4-bit: two codes per byte, high nibble first), fp8: code * scale[block]
    bitsandbytes   state1, state2 (+ absmax1/2, qmap1/2; 0.45+ nests them under
                   `__bnb_optimizer_quant_state__`): value = qmap[code] * absmax[block],
                   block = ceil(numel / len(absmax)); tensors under 4096 elements keep fp32

`role` says which moment a state is: "m" (first: exp_avg, momentum, state1, m) or "v"
(second: exp_avg_sq, max_exp_avg_sq, state2, v), which is what the checks need.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import QstateError
from ..quant.config import STATE_IDS, parse_config, parse_spec
from ..quant.quantizer import Stream, decode
from .safeload import LowBitState

ROLES = {"exp_avg": "m", "momentum_buffer": "m", "state1": "m", "m": "m",
         "exp_avg_sq": "v", "max_exp_avg_sq": "v", "state2": "v", "v": "v"}
BNB_NESTED = "__bnb_optimizer_quant_state__"
BNB_AUX = ("absmax1", "absmax2", "qmap1", "qmap2", "max1", "max2", "new_max1", "new_max2", "unorm_vec",
           "gnorm_vec")
SCALAR_KEYS = ("step", "since_reset", "nonfinite")
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

    @property
    def numel(self) -> int:
        return self.values.numel()


@dataclass
class ParamStates:
    key: str  # the parameter's name (DCP, param_names) or its index in the optimizer
    index: int  # position across param_groups
    group: int
    states: dict[str, StoredState]
    step: float | None  # None: no step counter stored
    written: dict[str, int] = field(default_factory=dict)  # qstate: the step each state was written at
    step_problem: str = ""  # a step entry that is not one number: what it is instead

    @property
    def shape(self) -> tuple[int, ...]:
        shapes = [tuple(s.values.shape) for s in self.states.values() if s.shape_known]
        return shapes[0] if shapes else tuple(next(iter(self.states.values())).values.shape) if self.states else ()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.states.values())


@dataclass
class OptimizerStates:
    path: str  # where in the checkpoint ("optimizer", "optimizer_states.0", "optim")
    kind: str  # "torch", "qstate", "torchao", "bnb" or "mixed"
    groups: list[dict]  # hyper-parameters of each group (without params)
    params: list[ParamStates]
    unstepped: list[str]  # parameters listed in a group that hold no state
    duplicates: dict[str, list[int]] = field(default_factory=dict)  # listed more than once: the groups listing it


def find_optimizers(obj, source: str) -> list[OptimizerStates]:
    """Every optimizer state dict in a loaded checkpoint (see module docstring)."""
    found = []
    _walk(obj, (), found, depth=0)
    if not found:
        raise QstateError(f"{source}: holds no optimizer state dict (a dict with 'state' and 'param_groups')")
    return [read_optimizer(sd, path, source) for path, sd in found]


def _walk(obj, path: tuple, found: list, depth: int) -> None:
    if depth > 5:
        return
    if isinstance(obj, dict):
        if "state" in obj and "param_groups" in obj and isinstance(obj["param_groups"], (list, tuple)):
            found.append((".".join(map(str, path)) or "optimizer", obj))
            return
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return
    for key, value in items:
        _walk(value, path + (key,), found, depth + 1)


def read_optimizer(sd: dict, path: str, source: str) -> OptimizerStates:
    groups = [g for g in sd["param_groups"] if isinstance(g, dict)]
    state = sd["state"]
    if isinstance(state, (list, tuple)):  # DCP unflattens integer keys into a list
        state = {i: s for i, s in enumerate(state) if s is not None}
    if not isinstance(state, dict):
        raise QstateError(f"{source}: {path}.state is {type(state).__name__}, not a dict")
    order, names, group_of, listed = [], {}, {}, {}
    for gi, group in enumerate(groups):
        params = list(group.get("params", []))
        for j, key in enumerate(params):
            listed.setdefault(_k(key), []).append(gi)
            if len(listed[_k(key)]) > 1:
                continue  # a duplicate: read once, reported by the checks
            order.append(key)
            group_of[_k(key)] = gi
            pnames = group.get("param_names")
            if isinstance(pnames, (list, tuple)) and j < len(pnames):
                names[_k(key)] = str(pnames[j])
    for key in state:  # states of parameters no group lists (kept, in group -1)
        if _k(key) not in group_of:
            order.append(key)
            group_of[_k(key)] = -1
    params, unstepped = [], []
    for index, key in enumerate(order):
        entry = state.get(key, state.get(_k(key))) if isinstance(key, (int, str)) else None
        name = names.get(_k(key), str(key))
        if not entry:
            unstepped.append(name)
            continue
        gi = group_of[_k(key)]
        group = groups[gi] if gi >= 0 else {}
        where = f"{source}: {path} {name}"
        params.append(_read_param(entry, group, name, index if not isinstance(key, int) else key, gi, where))
    kinds = {_kind_of(p) for p in params} - {"torch"} or {"torch"}
    hparams = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in groups]
    duplicates = {names.get(k, k): gs for k, gs in listed.items() if len(gs) > 1}
    return OptimizerStates(path, kinds.pop() if len(kinds) == 1 else "mixed", hparams, params, unstepped, duplicates)


def _k(key):
    return str(key)


def _kind_of(p: ParamStates) -> str:
    if p.written:
        return "qstate"
    for s in p.states.values():
        head = s.storage.split()[0]
        if head in ("torchao", "bnb"):
            return head
        if s.name in ("state1", "state2"):
            return "bnb"
    return "torch"


def _read_param(entry: dict, group: dict, name: str, index: int, gi: int, where: str) -> ParamStates:
    if not isinstance(entry, dict):
        raise QstateError(f"{where}: state is {type(entry).__name__}, not a dict")
    entry = dict(entry)
    nested = entry.pop(BNB_NESTED, None)
    if isinstance(nested, dict):
        entry.update(nested)
    step = scalar(entry.get("step"))
    step_problem = "" if step is not None or entry.get("step") is None else _what(entry["step"])
    states, written = {}, {}
    for key, value in entry.items():
        if key in SCALAR_KEYS or key in BNB_AUX:
            continue
        if isinstance(value, dict) and "codes" in value:
            states[key], written[key] = _qstate(key, value, group, index, where)
        elif _is_torchao(value):
            states[key] = _torchao(key, value, where)
        elif isinstance(value, torch.Tensor) and key in ("state1", "state2") and value.dtype == torch.uint8:
            states[key] = _bnb(key, value, entry, where)
        elif isinstance(value, torch.Tensor) and (key in ROLES or (value.dim() > 0 and _float(value))):
            states[key] = _plain(key, value)  # a known state of any dtype or shape (a scalar param's: 0-dim)
    return ParamStates(name, index, gi, states, step, written, step_problem)


def scalar(value) -> float | None:
    """One real number (a Python number or a one-element tensor), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _what(value) -> str:
    """A value that is not one number, for a message."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({type(value).__name__})"


def _float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _plain(key: str, t: torch.Tensor) -> StoredState:
    name = FLOAT_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))
    vals = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()  # complex params' states
    return StoredState(key, ROLES.get(key, "other"), name, False, vals.to(torch.float32), t.numel() * t.element_size(),
                       float_dtype=vals.dtype if _float(t) else None, non_float=not _float(t))


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


def _is_torchao(value) -> bool:
    """A torchao low-bit state: our stand-in, or torchao's own class where a process that
    imported torchao let torch load it (torchao allow-lists its classes itself)."""
    return isinstance(value, LowBitState) or (isinstance(value, torch.Tensor)
                                              and type(value).__module__.startswith("torchao.optim"))


def _torchao(key: str, t: torch.Tensor, where: str) -> StoredState:
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


def _bnb(key: str, codes: torch.Tensor, entry: dict, where: str) -> StoredState:
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


def _qstate(key: str, value: dict, group: dict, index: int, where: str):
    codes, scales = value.get("codes"), value.get("scales")
    written = int(scalar(value.get("written")) or 0)
    if not isinstance(codes, torch.Tensor):
        raise QstateError(f"{where}: {key}.codes is not a tensor")
    problems: list[str] = []
    if codes.dtype == torch.float32:
        spec = parse_spec("fp32")
    else:
        try:
            spec = parse_config(str(group.get("states"))).spec(key)
        except QstateError as exc:
            raise QstateError(f"{where}: {key}: the group's states {group.get('states')!r}: {exc}") from None
    bits = spec.fmt.bits
    numel = codes.numel() * 8 // bits if codes.dtype == torch.uint8 else codes.numel()
    if scales is not None:
        scales = _check_scales(scales, "scales", problems)
        expected = -(-numel // spec.block) if spec.scaled else (1 if spec.has_scales else None)
        if expected is not None and scales.numel() != expected:
            problems.append(f"{scales.numel()} scales for {numel} elements in blocks of {spec.block or numel}")
            scales = None
    elif spec.has_scales:
        problems.append("no scales stored for a block-scaled format")
    if written == 0:
        vals = torch.zeros(numel)
    elif spec.has_scales and scales is None:
        vals = torch.full((numel,), float("nan"))
    else:
        stream = Stream(int(group.get("seed", 0)), int(index), STATE_IDS.get(key, 0))
        vals = decode(codes, scales, spec, numel, written, stream)
    storage = "fp32" if spec.fmt.kind == "identity" else f"qstate {spec}"
    state = StoredState(key, ROLES.get(key, "other"), storage, spec.fmt.kind != "identity", vals.to(torch.float32),
                        _bytes(codes, scales), float_dtype=torch.float32 if storage == "fp32" else None,
                        shape_known=False, problems=problems)
    return state, written
