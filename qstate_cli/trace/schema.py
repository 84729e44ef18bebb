"""Trace format v1 and v2: recorded gradients of a training run, as plain tensors and values.

A trace is one `torch.save` file holding only dicts, lists, strings, numbers and tensors,
so it loads with `torch.load(weights_only=True)` and a trace from a stranger never runs
code::

    {
      "format": "qstate-trace",
      "schema_version": 1 | 2,        # 2 where some tensor has `absent` rows, else 1
      "optimizer": {"name": "adamw", "hparams": {"lr": 0.003, "betas": [0.9, 0.999], ...}},
      "seed": 0,                      # keys the random streams (stochastic rounding, BReD)
      "step_start": 1,                # global optimizer step of gradient row 0 (1-based)
      "n_steps": 1200,                # consecutive steps recorded
      "block_size": 2048,             # recorded unit: whole blocks of BLOCK elements
      "grad_dtype": "fp32" | "bf16",
      "tensors": [{
          "name": "blocks.0.qkv.weight",
          "index": 4,                 # position in the optimizer's parameter list (tensor id)
          "shape": [192, 64],
          "blocks": int64 [k],        # indices of the recorded BLOCK-element blocks, ascending
          "grads": [n_steps, n_rec],  # grad_dtype; the recorded blocks concatenated
          "init": fp32 [n_rec],       # optional: parameter values before the first step
          "elements": int64 [n_part], # only in one rank's shard of a sharded (FSDP2) tensor:
                                      # the recorded elements (flat indices in the whole
                                      # tensor, ascending) this rank held; grads/init are
                                      # [.., n_part]; io.merge_shards joins the pieces
          "absent": int64 [k],        # optional: the rows (0-based, ascending) at which the
                                      # parameter had no gradient (.grad None: an MoE expert
                                      # or branch unused that step, which the optimizer did
                                      # not step); its grads rows there are 0. Absent key:
                                      # a gradient at every step (traces before it existed)
          "sha256": "<64 hex>",       # of the bytes of blocks, grads, init, elements and
                                      # absent (those present), in that order
      }, ...],
      "meta": {...}                   # free-form: source, created, qstate version, rank
    }

Checks at load (from_dict): the structure above; the hyper-parameters are ones a run can
have (optim/registry.py `check_hparams`: betas in [0, 1), lr >= 0, ...); every tensor
dense, with data, and no larger than its storage (plain.py: not sparse, nested, quantized
or meta, no stride tricks); step numbers that fit int64 (the last recorded step, step_start
+ n_steps - 1, at most 2^63-1: the replay's kernels count steps in int64); a tensor shape
of at most MAX_NUMEL (2^48) elements; and each tensor's
sha256, so flipped bytes in the data are refused instead of replayed. Traces written
before the checksum existed (no "sha256") load unverified. Every check costs what the file
holds, never what it declares: shapes are compared first, and a shard's elements are
found in its blocks by binary search (`in_blocks`), not by spelling out the blocks'
elements (65,536 block indices, 527 KB, are 134 million elements: 6.5 GB and 82 s).

Versions: a trace in which some tensor has `absent` rows is written as schema_version 2,
any other as 1, byte for byte as before absent rows existed. So a qstate that reads only
v1 (before absent rows) refuses a trace with absent rows as newer than it reads (it could
not skip those rows, and the sha256 covers them) and still reads every other trace. This
qstate reads both (and v1 files with `absent` rows, which the first qstate writing them
wrote).

Blocks are of the largest block size any format uses (2048), so every smaller
power-of-two block size divides them and a replay quantizes the recorded elements in
exactly the blocks the full tensor would have. A tensor's last block may be short
(numel not a multiple of 2048); n_rec is the sum of the recorded blocks' lengths.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from ..errors import QstateError
from ..optim.registry import OPTIMIZERS
from .plain import tensor_problem

FORMAT_TAG = "qstate-trace"
SCHEMA_VERSION = 2  # the newest this qstate reads and writes (module docstring: v2 = absent rows)
PLAIN_VERSION = 1  # what a trace without absent rows is written as
BLOCK = 2048
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SAMPLING_STATE_ID = 2  # hash stream state id used to sample blocks (0 = m, 1 = v)
MAX_STEP = 2**63 - 1  # step numbers are int64 in the replay (its kernels take the step as one)
MAX_NUMEL = 2**48  # elements of one traced tensor (docs/errors.md: the element-count limit)


@dataclass
class TraceTensor:
    """One recorded parameter: which blocks, and their gradients at every step."""

    name: str
    index: int
    shape: tuple[int, ...]
    blocks: torch.Tensor  # int64 [k], ascending
    grads: torch.Tensor  # [n_steps, n_rec]
    init: torch.Tensor | None = None
    elements: torch.Tensor | None = None  # a rank's piece of a sharded tensor: its element indices
    absent: torch.Tensor | None = None  # int64 rows without a gradient (module docstring); None: none

    @property
    def absent_rows(self) -> list[int]:
        """The rows at which this tensor had no gradient (the optimizer did not step it)."""
        return [] if self.absent is None else [int(r) for r in self.absent.tolist()]

    @property
    def partial(self) -> bool:
        return self.elements is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_blocks(self) -> int:
        return -(-self.numel // BLOCK)

    @property
    def n_recorded(self) -> int:
        return int(self.grads.shape[1])

    @property
    def full(self) -> bool:
        return self.blocks.numel() == self.n_blocks

    def element_index(self) -> torch.Tensor:
        """Flat index in the full tensor of every recorded element (int64 [n_rec])."""
        return recorded_elements(self.blocks, self.numel)


@dataclass
class Trace:
    optimizer: str
    hparams: dict
    seed: int
    step_start: int
    n_steps: int
    grad_dtype: str
    tensors: list[TraceTensor]
    meta: dict = field(default_factory=dict)
    source: str = "<memory>"

    @property
    def recorded_elements(self) -> int:
        return sum(t.n_recorded for t in self.tensors)

    @property
    def total_elements(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def schema_version(self) -> int:
        """What this trace is written as (module docstring): 2 where some tensor has absent rows, else 1."""
        gaps = any(t.absent is not None and t.absent.numel() for t in self.tensors)
        return SCHEMA_VERSION if gaps else PLAIN_VERSION

    def to_dict(self) -> dict:
        return {
            "format": FORMAT_TAG,
            "schema_version": self.schema_version,
            "optimizer": {"name": self.optimizer, "hparams": dict(self.hparams)},
            "seed": int(self.seed),
            "step_start": int(self.step_start),
            "n_steps": int(self.n_steps),
            "block_size": BLOCK,
            "grad_dtype": self.grad_dtype,
            "tensors": [_tensor_dict(t) for t in self.tensors],
            "meta": dict(self.meta),
        }


def _tensor_dict(t: TraceTensor) -> dict:
    out = {"name": t.name, "index": int(t.index), "shape": [int(s) for s in t.shape],
           "blocks": t.blocks.to(torch.int64), "grads": t.grads}
    if t.init is not None:
        out["init"] = t.init
    if t.elements is not None:
        out["elements"] = t.elements.to(torch.int64)
    if t.absent is not None and t.absent.numel():
        out["absent"] = t.absent.to(torch.int64)
    out["sha256"] = checksum(out["blocks"], t.grads, t.init, out.get("elements"), out.get("absent"))
    return out


def checksum(blocks: torch.Tensor, grads: torch.Tensor, init: torch.Tensor | None,
             elements: torch.Tensor | None = None, absent: torch.Tensor | None = None) -> str:
    """sha256 of the raw bytes of blocks, grads, init, elements and absent (those present), in that order."""
    digest = hashlib.sha256()
    for tensor in (blocks, grads, init, elements, absent):
        if tensor is not None:
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


DIGEST_FIELDS = "optimizer name and hparams, seed, step_start, n_steps, grad_dtype; per tensor name, index, " \
                "shape, blocks, grads, absent"


def digest(trace: "Trace") -> str:
    """sha256 of what determines a replay (DIGEST_FIELDS), not of the file: two recordings of
    the same seeded run share it though their meta (created, argv) and paths differ. The
    hyper-parameters as sorted JSON; each tensor's name, index and shape as JSON, then the
    raw bytes of blocks, grads and absent (rows of a shard's pieces in joined order). It reads
    each tensor's gradients once, as the replay does (memory-mapped; not `init` or meta)."""
    import json

    h = hashlib.sha256()
    head = {"optimizer": trace.optimizer, "hparams": trace.hparams, "seed": int(trace.seed),
            "step_start": int(trace.step_start), "n_steps": int(trace.n_steps), "grad_dtype": trace.grad_dtype}
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    for t in trace.tensors:
        h.update(json.dumps({"name": t.name, "index": int(t.index), "shape": [int(s) for s in t.shape]}).encode())
        for tensor in (t.blocks.to(torch.int64), t.grads, t.absent):
            h.update(b"|")
            if tensor is not None and tensor.numel():
                flat = tensor.detach().cpu().contiguous().reshape(-1)
                h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def recorded_elements(blocks: torch.Tensor, numel: int) -> torch.Tensor:
    """Flat element indices covered by `blocks` (BLOCK-element blocks; the last may be short)."""
    idx = (blocks.to(torch.int64)[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1)
    return idx[idx < numel]


def in_blocks(elements: torch.Tensor, blocks: torch.Tensor, numel: int) -> bool:
    """Whether `elements` (int64, non-empty) are ascending, distinct flat indices below
    `numel` that lie in the ascending `blocks`: a binary search per element, never the
    blocks' elements spelled out (recorded_elements), which a small file can make
    gigabytes (65,536 block indices in 527 KB are 134 million elements)."""
    if int(elements[0]) < 0 or int(elements[-1]) >= numel:
        return False
    if elements.numel() > 1 and not bool((elements.diff() > 0).all()):
        return False
    block = elements // BLOCK
    at = torch.searchsorted(blocks, block).clamp_(max=blocks.numel() - 1)
    return bool((blocks[at] == block).all())


def block_lengths(blocks: torch.Tensor, numel: int) -> int:
    """Number of elements in the given blocks."""
    last = -(-numel // BLOCK) - 1
    n = blocks.numel() * BLOCK
    if blocks.numel() and int(blocks[-1]) == last:
        n -= last * BLOCK + BLOCK - numel
    return n


# ---- validation: a dict from torch.load -> Trace, or one clear line naming the problem ----
def from_dict(obj, source: str, verify: bool = True) -> Trace:
    """The Trace in `obj`, every field checked (module docstring); `verify=False` skips the
    checksums (a trace about to be written gets them from its own data)."""
    def bad(what: str):
        return QstateError(f"{source}: {what}")

    if not isinstance(obj, dict) or obj.get("format") != FORMAT_TAG:
        raise bad("not a qstate trace (no 'format': 'qstate-trace' tag)")
    version = obj.get("schema_version")
    if not isinstance(version, int):
        raise bad("trace has no integer schema_version")
    if version > SCHEMA_VERSION:
        raise bad(f"trace schema_version {version} is newer than this qstate reads ({SCHEMA_VERSION}); upgrade qstate")
    if version < PLAIN_VERSION:
        raise bad(f"unsupported trace schema_version {version} (this qstate reads {PLAIN_VERSION} to {SCHEMA_VERSION})")
    opt = _field(obj, "optimizer", dict, bad)
    name = opt.get("name")
    hparams = opt.get("hparams", {})
    if not isinstance(name, str) or not isinstance(hparams, dict):
        raise bad("'optimizer' must hold a string 'name' and a dict 'hparams'")
    if name.lower() in OPTIMIZERS:  # an optimizer the replay does not know is its concern
        try:
            OPTIMIZERS[name.lower()].check_hparams(hparams)
        except QstateError as exc:
            raise bad(f"optimizer {name}: {exc}") from None
    seed = _field(obj, "seed", int, bad)
    step_start = _field(obj, "step_start", int, bad)
    n_steps = _field(obj, "n_steps", int, bad)
    if step_start < 1 or n_steps < 1:
        raise bad(f"step_start ({step_start}) and n_steps ({n_steps}) must be >= 1")
    if step_start + n_steps - 1 > MAX_STEP:
        raise bad(f"step_start {step_start} with n_steps {n_steps} ends past step 2^63-1; steps are int64 "
                  f"(step_start from 1 to 2^63 - n_steps)")
    if obj.get("block_size") != BLOCK:
        raise bad(f"block_size is {obj.get('block_size')!r}; trace format v1 records blocks of {BLOCK}")
    grad_dtype = obj.get("grad_dtype")
    if grad_dtype not in GRAD_DTYPES:
        raise bad(f"grad_dtype {grad_dtype!r} is not one of {', '.join(GRAD_DTYPES)}")
    raw = _field(obj, "tensors", list, bad)
    if not raw:
        raise bad("trace holds no tensors")
    tensors = [_tensor(i, t, n_steps, GRAD_DTYPES[grad_dtype], bad, verify) for i, t in enumerate(raw)]
    names = [t.name for t in tensors]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise bad(f"tensor name {dup[0]!r} appears more than once")
    meta = obj.get("meta", {})
    return Trace(name.lower(), hparams, seed, step_start, n_steps, grad_dtype, tensors,
                 meta if isinstance(meta, dict) else {}, source)


def _shape_text(shape: list) -> str:
    text = "[" + ", ".join(str(s) if s < 2**64 else f"~2^{s.bit_length() - 1}" for s in shape[:8])
    return text + (", ...]" if len(shape) > 8 else "]")


def _field(obj: dict, key: str, kind, bad):
    if key not in obj:
        raise bad(f"missing {key!r}")
    val = obj[key]
    if not isinstance(val, kind) or (kind is int and isinstance(val, bool)):
        raise bad(f"{key!r} must be {kind.__name__}, got {type(val).__name__}")
    return val


def _tensor(i: int, t, n_steps: int, dtype, bad, verify: bool = True) -> TraceTensor:
    if not isinstance(t, dict):
        raise bad(f"tensor {i}: must be a dict, got {type(t).__name__}")
    name = t.get("name")
    where = f"tensor {i} ({name!r})" if isinstance(name, str) else f"tensor {i}"
    if not isinstance(name, str) or not name:
        raise bad(f"{where}: missing a string 'name'")
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise bad(f"{where}: 'shape' must be a list of non-negative ints")
    if len(shape) > 64 or any(s > MAX_NUMEL for s in shape) or math.prod(shape) > MAX_NUMEL:
        raise bad(f"{where}: shape {_shape_text(shape)}: past 2^48 elements (a traced tensor has at most 2^48, "
                  f"in all and in each dimension)")
    index = t.get("index")
    if not isinstance(index, int) or index < 0:
        raise bad(f"{where}: 'index' must be a non-negative int")
    numel = math.prod(shape)
    blocks, grads = t.get("blocks"), t.get("grads")
    for key in ("blocks", "grads", "init", "elements", "absent"):
        value = t.get(key)
        problem = tensor_problem(value) if isinstance(value, torch.Tensor) else ""
        if problem:
            raise bad(f"{where}: '{key}' is {problem}; a trace holds dense tensors")
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.int64 or blocks.ndim != 1 or not blocks.numel():
        raise bad(f"{where}: 'blocks' must be a non-empty 1-D int64 tensor")
    n_blocks = -(-numel // BLOCK)
    if int(blocks.min()) < 0 or int(blocks.max()) >= n_blocks or (blocks.numel() > 1 and not bool((blocks.diff() > 0).all())):
        raise bad(f"{where}: 'blocks' must be ascending, distinct block indices below {n_blocks}")
    n_rec = block_lengths(blocks, numel)
    elements = t.get("elements")
    if elements is not None:  # one rank's piece of a sharded tensor
        if not isinstance(elements, torch.Tensor) or elements.dtype != torch.int64 or elements.ndim != 1:
            raise bad(f"{where}: 'elements' must be a 1-D int64 tensor")
        n_rec = elements.numel()
    if not isinstance(grads, torch.Tensor) or grads.ndim != 2:
        raise bad(f"{where}: 'grads' must be a 2-D tensor [steps, recorded elements]")
    if grads.dtype != dtype:
        raise bad(f"{where}: grads are {grads.dtype}, the trace says {dtype}")
    if tuple(grads.shape) != (n_steps, n_rec):
        raise bad(f"{where}: grads have shape {tuple(grads.shape)}, expected ({n_steps}, {n_rec}) for "
                  f"{blocks.numel()} recorded block(s) of a {numel}-element tensor")
    init = t.get("init")
    if init is not None and (not isinstance(init, torch.Tensor) or tuple(init.shape) != (n_rec,)):
        raise bad(f"{where}: 'init' must be a tensor of {n_rec} values")
    if elements is not None and elements.numel() and not in_blocks(elements, blocks, numel):
        raise bad(f"{where}: 'elements' must be ascending, distinct elements of the recorded blocks")
    absent = t.get("absent")
    if absent is not None:
        if not isinstance(absent, torch.Tensor) or absent.dtype != torch.int64 or absent.ndim != 1:
            raise bad(f"{where}: 'absent' must be a 1-D int64 tensor of rows")
        if absent.numel() and (int(absent.min()) < 0 or int(absent.max()) >= n_steps
                               or (absent.numel() > 1 and not bool((absent.diff() > 0).all()))):
            raise bad(f"{where}: 'absent' must be ascending, distinct rows below n_steps ({n_steps})")
    recorded = t.get("sha256")
    if recorded is not None and verify:
        if not isinstance(recorded, str) or len(recorded) != 64:
            raise bad(f"{where}: 'sha256' must be 64 hex digits")
        if checksum(blocks, grads, init, elements, absent) != recorded.lower():
            raise bad(f"{where}: the data does not match its sha256: the file is corrupt")
    return TraceTensor(name, index, tuple(shape), blocks, grads, init, elements,
                       absent if absent is not None and absent.numel() else None)
