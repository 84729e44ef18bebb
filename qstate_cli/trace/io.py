"""Reading and writing traces: safe loads, atomic writes, sharded directories.

Loading never runs code: a file must be a torch.save zip archive (checked before torch
sees it, so a legacy raw pickle is refused outright) and is read with
`torch.load(weights_only=True, mmap=True)`: tensors are memory-mapped, so a trace larger
than memory can be replayed. Anything else (a pickled object, a truncated archive, a
wrong schema) is refused with one line naming the file and the problem.

Before torch sees an archive, its table of contents is checked, so a small file cannot
make the load inflate gigabytes (a "zip bomb"): torch.save stores its records
uncompressed, so a trace may inflate at most MAX_INFLATION times its size on disk
(a compressed record at most MAX_INFLATION times its compressed size), its pickle (the
structure, not the tensor data) may be at most MAX_PICKLE_BYTES, and it may hold at most
MAX_RECORDS records. After the load, each tensor's sha256 is verified (schema.py).

A directory is a sharded trace (e.g. one file per rank, `rank0.pt`, `rank1.pt`, ...):
every `*.pt` file in it must come from the same run (optimizer, hyper-parameters, seed,
step range) and hold different tensors, or pieces of the same tensor (FSDP2: each rank
records the elements of the sampled blocks it holds, with their indices: schema.py
`elements`); pieces are joined in element order and must cover the recorded blocks
exactly once. They load as one trace.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from ..errors import QstateError
from ..results import atomic_path
from .schema import Trace, from_dict


MAX_INFLATION = 4  # uncompressed bytes per byte on disk (torch.save writes ~1.0)
MAX_PICKLE_BYTES = 64 << 20  # the pickled structure (names, shapes, hparams): a few KiB in practice
MAX_RECORDS = 100_000  # archive members: one per tensor, plus a few


def save_trace(trace: Trace, path) -> Path:
    """Write `trace` to `path` atomically (temporary file in the same folder, then rename)."""
    obj = trace.to_dict()
    from_dict(obj, str(path), verify=False)  # never write what we would refuse to read
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return Path(path)


def load_trace(path) -> Trace:
    """Load a trace file or a directory of shards (see module docstring)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.pt") if p.is_file())
        if not files:
            raise QstateError(f"{path}: directory holds no *.pt trace shards")
        return merge_shards([_load_file(f) for f in files], str(path))
    if not path.exists():
        raise QstateError(f"{path}: no such trace file")
    trace = _load_file(path)
    if any(t.partial for t in trace.tensors):  # one rank's pieces: complete only with the other ranks'
        return merge_shards([trace], str(path))
    return trace


def _load_file(path: Path) -> Trace:
    if path.stat().st_size == 0:
        raise QstateError(f"{path}: empty file, not a trace")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as fh:
            if fh.read(4) == b"PK\x03\x04":
                raise QstateError(f"{path}: corrupt or truncated trace (a zip archive without its directory)")
        raise QstateError(f"{path}: not a qstate trace (not a torch.save zip archive; "
                          f"raw pickles are refused because loading them can run code)")
    check_archive(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        detail = next((ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else "")
        raise QstateError(f"{path}: refused: the file holds Python objects that a safe load does not allow "
                          f"(they could run code); a trace holds only tensors and plain values "
                          f"[{detail.strip()[:160]}]") from None
    except (RuntimeError, EOFError, ValueError, KeyError, OSError, zipfile.BadZipFile) as exc:
        msg = " ".join(str(exc).split())[:200]
        raise QstateError(f"{path}: corrupt or truncated trace ({type(exc).__name__}: {msg})") from None
    return from_dict(obj, str(path))


def check_archive(path: Path) -> None:
    """Refuse an archive that would inflate past the limits above (QstateError)."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise QstateError(f"{path}: corrupt or truncated trace (zip: {' '.join(str(exc).split())[:160]})") from None
    if len(members) > MAX_RECORDS:
        raise QstateError(f"{path}: refused: {len(members):,} archive records (a trace holds at most "
                          f"{MAX_RECORDS:,})")
    total = sum(m.file_size for m in members)
    if total > MAX_INFLATION * size + (1 << 20):
        raise QstateError(f"{path}: refused: inflates to {total:,} bytes from {size:,} on disk (more than "
                          f"{MAX_INFLATION}x; a zip bomb?)")
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED and m.file_size > MAX_INFLATION * max(m.compress_size, 1) + 4096:
            raise QstateError(f"{path}: refused: record {m.filename} inflates {m.file_size / max(m.compress_size, 1):.0f}x "
                              f"(at most {MAX_INFLATION}x; a zip bomb?)")
        if m.filename.endswith("data.pkl") and m.file_size > MAX_PICKLE_BYTES:
            raise QstateError(f"{path}: refused: its pickle is {m.file_size:,} bytes (at most {MAX_PICKLE_BYTES:,}; "
                              f"a trace's structure takes a few KiB)")


def merge_shards(shards: list[Trace], source: str) -> Trace:
    """One trace from shards of the same run holding different tensors."""
    first = shards[0]
    if len(shards) == 1 and not any(t.partial for t in first.tensors):
        return first
    for s in shards[1:]:
        for what in ("optimizer", "hparams", "seed", "step_start", "n_steps", "grad_dtype"):
            if getattr(s, what) != getattr(first, what):
                raise QstateError(f"{source}: shard {s.source} has {what} {getattr(s, what)!r}, "
                                  f"but {first.source} has {getattr(first, what)!r}; shards must come from one run")
    owner: dict[str, str] = {}
    tensors = []
    used_ids: set[int] = set()
    next_id = max(t.index for s in shards for t in s.tensors) + 1
    pieces: dict[str, list] = {}
    for s in shards:
        for t in s.tensors:
            if t.partial:
                pieces.setdefault(t.name, []).append((s.source, t))
    joined = {name: _join(name, parts, source) for name, parts in pieces.items()}
    for s in shards:
        for t in s.tensors:
            if t.partial:
                t = joined.pop(t.name, None)
                if t is None:  # already placed from an earlier shard
                    continue
            if t.name in owner:
                raise QstateError(f"{source}: tensor {t.name!r} is in both {owner[t.name]} and {s.source}")
            owner[t.name] = s.source
            if t.index in used_ids:  # ranks numbering their parameters alike: keep streams distinct
                t.index, next_id = next_id, next_id + 1
            used_ids.add(t.index)
            tensors.append(t)
    meta = dict(first.meta, shards=[s.source for s in shards])
    return Trace(first.optimizer, first.hparams, first.seed, first.step_start, first.n_steps, first.grad_dtype,
                 tensors, meta, source)


def _join(name: str, parts: list, source: str):
    """One tensor from ranks' pieces (schema.py `elements`): same identity, ascending
    element order, every recorded element exactly once."""
    from .schema import TraceTensor, recorded_elements

    first = parts[0][1]
    for where, t in parts[1:]:
        if (t.index, t.shape) != (first.index, first.shape) or not torch.equal(t.blocks, first.blocks):
            raise QstateError(f"{source}: pieces of tensor {name!r} in {parts[0][0]} and {where} disagree on "
                              f"index, shape or blocks")
    elements = torch.cat([t.elements for _, t in parts])
    order = torch.argsort(elements)
    want = recorded_elements(first.blocks, first.numel)
    if not torch.equal(elements[order], want):
        raise QstateError(f"{source}: the pieces of tensor {name!r} hold {elements.numel()} elements, not each of "
                          f"its {want.numel()} recorded elements once (a rank's shard missing or repeated?)")
    grads = torch.cat([t.grads for _, t in parts], dim=1)[:, order]
    inits = [t.init for _, t in parts]
    init = torch.cat(inits)[order] if all(i is not None for i in inits) else None
    return TraceTensor(name, first.index, first.shape, first.blocks, grads, init)
