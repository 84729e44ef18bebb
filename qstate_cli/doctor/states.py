"""What a checkpoint's optimizer states hold, read back to fp32 whatever stored them.

    find_optimizers(obj) -> [OptimizerStates]     every optimizer state dict inside a checkpoint

An optimizer state dict is any dict with `state` and `param_groups` (torch's layout; also
inside `{"optimizer": ...}`, Lightning's `optimizer_states` list, a DCP checkpoint's
`optim` entry with parameter names as keys). Per parameter, each stored state becomes a
`StoredState`: its values decoded to fp32 (`values`), what stored them (`storage`), the
bytes it holds and, for quantized states, problems in its codes, scales or code book.
A state laid out in a way no reader here expects is a QstateError naming it (exit 2).

Who stored what (read here without importing any of them; decode.py reads each back):

    torch.optim    exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer: plain tensors
                   (fp32, or whatever dtype a checkpoint cast them to)
    qstate         m, v: {codes, scales, written} of a QuantizedState; the group's `states`
                   names the format (parsed with quant.config), its `seed` the replay stream.
                   A sharded (FSDP2) parameter's states come from DCP in one of the forms of
                   optim/sharded_state.py: rows (codes [rows, row bytes], scales [rows, row
                   blocks]: row-major, read flat) or elements (one code and one scale per
                   element, shaped like the parameter, and `block_starts`; a shard saved on
                   local blocks is decoded from its own first element, counter offset // B)
    torchao        exp_avg, exp_avg_sq: OptimState4bit / OptimState8bit / OptimStateFp8
                   (safeload.LowBitState stand-ins): value = qmap[code] * scale[block]
                   (4-bit: two codes per byte, high nibble first), fp8: code * scale[block]
    bitsandbytes   state1, state2 (+ absmax1/2, qmap1/2; 0.45+ nests them under
                   `__bnb_optimizer_quant_state__`): value = qmap[code] * absmax[block],
                   block = ceil(numel / len(absmax)); tensors under 4096 elements keep fp32

`role` says which moment a state is: "m" (first: exp_avg, momentum, state1, m) or "v"
(second: exp_avg_sq, max_exp_avg_sq, state2, v), which is what the checks need.

A parameter's shape is its states' where they keep it (torch, torchao, the per-element
form); qstate's flat codes do not, so where the file also holds a model's state dict (a
dict of named tensors, e.g. `{"model": ..., "optimizer": ...}`), or a checkpoint folder a
model.safetensors (folders.py), the shape is taken from it:
by the parameter's name, else the one shape the model's tensors of that many elements
have. Otherwise only the element count is known (`shape_known` False).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import QstateError, clip
from ..trace.plain import tensor_kind, tensor_problem
from .decode import StoredState, bnb_state, dtype_name, plain_state, qstate_state, scalar, torchao_state
from .tensors import kind_of, unreadable_state

__all__ = ["OptimizerStates", "ParamStates", "StoredState", "find_optimizers", "scalar"]

BNB_NESTED = "__bnb_optimizer_quant_state__"
BNB_AUX = ("absmax1", "absmax2", "qmap1", "qmap2", "max1", "max2", "new_max1", "new_max2", "unorm_vec",
           "gnorm_vec")
SCALAR_KEYS = ("step", "since_reset", "nonfinite")


@dataclass
class ParamStates:
    key: str  # the parameter's name (DCP, param_names) or its index in the optimizer
    index: int  # position across param_groups
    group: int
    states: dict[str, StoredState]
    step: float | None  # None: no step counter stored
    written: dict[str, int] = field(default_factory=dict)  # qstate: the step each state was written at
    step_problem: str = ""  # a step entry that is not one number: what it is instead
    named: bool = False  # key is the parameter's name (param_names, DCP), not its index
    model_shape: tuple[int, ...] | None = None  # from a model state dict in the same file (module docstring)

    @property
    def shape_known(self) -> bool:
        return any(s.shape_known for s in self.states.values()) or self.model_shape is not None

    @property
    def shape(self) -> tuple[int, ...]:
        shapes = [tuple(s.values.shape) for s in self.states.values() if s.shape_known]
        if shapes:
            return shapes[0]
        if self.model_shape is not None:
            return self.model_shape
        return tuple(next(iter(self.states.values())).values.shape) if self.states else ()

    @property
    def numel(self) -> int:
        return max((s.numel for s in self.states.values()), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes the checkpoint holds for the states."""
        return sum(s.nbytes for s in self.states.values())

    @property
    def memory_nbytes(self) -> int:
        """Bytes the optimizer holds for them in memory (differs from nbytes where the
        checkpoint keeps a state per element: FSDP2's elements form)."""
        return sum(s.held_nbytes for s in self.states.values())


@dataclass
class OptimizerStates:
    path: str  # where in the checkpoint ("optimizer", "optimizer_states.0", "optim")
    kind: str  # "torch", "qstate", "torchao", "bnb" or "mixed"
    groups: list[dict]  # hyper-parameters of each group (without params)
    params: list[ParamStates]
    unstepped: list[str]  # parameters listed in a group that hold no state
    duplicates: dict[str, list[int]] = field(default_factory=dict)  # listed more than once: the groups listing it

    @property
    def keyed_by(self) -> str:
        """"name" (every parameter keyed by its name), "index", "mixed" or "" (no parameters)."""
        named = {p.named for p in self.params}
        return "" if not named else "mixed" if len(named) > 1 else "name" if named.pop() else "index"


def find_optimizers(obj, source: str, model_shapes: dict | None = None) -> list[OptimizerStates]:
    """Every optimizer state dict in a loaded checkpoint (see module docstring); `model_shapes`
    ({name: shape}, e.g. a model.safetensors header beside it: folders.py) adds to the model
    state dicts found in the file."""
    found, models = [], []
    _walk(obj, (), found, models, depth=0)
    if not found:
        raise QstateError(f"{source}: holds no optimizer state dict (a dict with 'state' and 'param_groups')")
    optimizers = [read_optimizer(sd, path, source) for path, sd in found]
    shapes = {**(model_shapes or {}),
              **{name: tuple(t.shape) for m in models for name, t in m.items() if not t.is_nested}}  # no shape
    if shapes:
        for o in optimizers:
            for p in o.params:
                if not p.shape_known:
                    p.model_shape = _model_shape(p, shapes)
    return optimizers


def _model_shape(p: ParamStates, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """p's shape from a model's state dict: by name (exact, or one key ending in '.name'),
    else the one shape of the model's tensors with p's number of elements; None when
    neither tells it."""
    numel = p.numel
    if p.named:
        hits = [shapes[p.key]] if p.key in shapes else [s for k, s in shapes.items() if k.endswith("." + p.key)]
        if len(hits) == 1 and (not numel or math.prod(hits[0]) == numel):
            return hits[0]
    if not numel:
        return None
    same = {s for s in shapes.values() if math.prod(s) == numel}
    return same.pop() if len(same) == 1 else None


def _walk(obj, path: tuple, found: list, models: list, depth: int) -> None:
    if depth > 5:
        return
    if isinstance(obj, dict):
        if "state" in obj and "param_groups" in obj and isinstance(obj["param_groups"], (list, tuple)):
            found.append((".".join(map(str, path)) or "optimizer", obj))
            return
        if obj and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
            models.append(obj)  # a model's state dict (or any dict of named tensors): parameter shapes
            return
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return
    for key, value in items:
        _walk(value, path + (key,), found, models, depth + 1)


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
        group = groups[gi] if gi >= 0 else _shared_settings(groups)
        where = f"{source}: {path} {name}"
        p = _read_param(entry, group, name, index if not isinstance(key, int) else key, gi, where)
        p.named = _k(key) in names or (isinstance(key, str) and not key.isdigit())
        params.append(p)
    kinds = {_kind_of(p) for p in params} - {"torch"} or {"torch"}
    hparams = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in groups]
    duplicates = {names.get(k, k): gs for k, gs in listed.items() if len(gs) > 1}
    return OptimizerStates(path, kinds.pop() if len(kinds) == 1 else "mixed", hparams, params, unstepped, duplicates)


def _k(key):
    return str(key)


QSTATE_SETTINGS = ("states", "seed", "min_quant_numel")


def _shared_settings(groups: list[dict]) -> dict:
    """For a state no group lists (an orphan): the qstate settings every group shares (its
    codes decode with them), else none (its codes stay undecoded)."""
    settings = {repr([g.get(k) for k in QSTATE_SETTINGS]) for g in groups}
    if len(settings) != 1:
        return {}
    return {k: groups[0][k] for k in QSTATE_SETTINGS if k in groups[0]}


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
        try:
            _read_state(key, value, entry, group, index, where, states, written)
        except QstateError:
            raise
        except Exception as exc:  # noqa: BLE001 - a layout no reader expects: one line (exit 2), no traceback
            msg = " ".join(str(exc).split())[:160]
            raise QstateError(f"{where}: {key}: a layout qstate doctor cannot read ({type(exc).__name__}: "
                              f"{msg})") from None
    return ParamStates(name, index, gi, states, step, written, step_problem)


def _read_state(key, value, entry: dict, group: dict, index: int, where: str, states: dict, written: dict) -> None:
    """One state of a parameter into `states` (and `written` for qstate's); a state whose
    tensors hold no readable values (meta, sparse, ...) undecoded, saying so (tensors.py)."""
    kind = kind_of(key, value)
    odd = unreadable_state(kind, key, value, entry) if kind else None
    if odd is not None:
        states[key] = odd
    elif kind == "qstate":
        states[key], written[key] = qstate_state(key, value, group, index, where)
    elif kind == "torchao":
        states[key] = torchao_state(key, value, where)
    elif kind == "bnb":
        states[key] = bnb_state(key, value, entry, where)
    elif kind == "plain":
        states[key] = plain_state(key, value)  # a known state of any dtype or shape (a scalar param's: 0-dim)


def _what(value) -> str:
    """A value that is not one number, for a message."""
    if isinstance(value, torch.Tensor) and tensor_kind(value):
        return tensor_problem(value)
    if isinstance(value, torch.Tensor):
        return f"a {dtype_name(value.dtype)} tensor of shape {tuple(value.shape)}"
    return f"{clip(repr(value))} ({type(value).__name__})"
