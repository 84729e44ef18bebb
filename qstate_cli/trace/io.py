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

A streamed recording (Recorder(flush_steps=N)) is a directory of files that each hold a
range of steps, and `manifest.json` (one `manifest-rank<r>.json` per rank when sharded)
listing them; the manifests are written after the files, so only complete files are
listed. With manifests, exactly the listed files load: each manifest's files (one rank's)
must be consecutive step ranges and are joined along the steps, then the ranks are merged
as above.

Step ranges that differ between shards (a rank that crashed or was stopped before the
others wrote their last file): the steps every shard covers load, and a warning on stderr
names the steps dropped and whose they were; when no step is common to all shards the
error names each shard's range. A sharded (FSDP2) recording whose meta names more ranks
than wrote files here is refused naming the missing ranks (one rank's file alone: load
the directory). `meta.zero_tensors` of a joined or merged trace is recomputed from the
joined gradients (a rank's own list covers only the elements it held).
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import sys
import zipfile
from pathlib import Path

import torch

from ..errors import QstateError
from ..results import atomic_path
from .schema import Trace, TraceTensor, from_dict

MANIFEST_TAG = "qstate-trace-manifest"


MAX_INFLATION = 4  # uncompressed bytes per byte on disk (torch.save writes ~1.0)
MAX_PICKLE_BYTES = 64 << 20  # the pickled structure (names, shapes, hparams): a few KiB in practice
MAX_RECORDS = 100_000  # archive members: one per tensor, plus a few


def save_trace(trace: Trace, path, picked_in=None) -> Path:
    """Write `trace` to `path` atomically (temporary file in the same folder, then rename).
    A write that fails (a full disk, /dev/full) is a QstateError naming the path; nothing
    is left behind (a device is written in place; with `picked_in`, a name qstate picked in
    that folder, always a regular file there: atomic.atomic_path). torch.save is handed an
    open file, so a failed write surfaces as the OSError it is (given a file name, torch's
    own writer reports it as an opaque RuntimeError)."""
    obj = trace.to_dict()
    from_dict(obj, str(path), verify=False)  # never write what we would refuse to read
    try:
        with atomic_path(path, picked_in) as tmp, open(tmp, "wb") as fh:
            try:
                torch.save(obj, fh)
            except RuntimeError as exc:  # torch's writer, whatever else it reports: a short write on a full
                # disk reads "[enforce fail at inline_container.cc:...] . unexpected pos 9152 vs 9048"; asked
                # while the partial file still holds the space (atomic_path removes it next)
                said = _no_space(tmp) or " ".join(str(exc).split())[:160]
                raise QstateError(f"{path}: cannot write ({said})") from None
    except OSError as exc:
        raise QstateError(f"{path}: cannot write ({exc.strerror or exc})") from None
    return Path(path)


def _no_space(path) -> str | None:
    """"No space left on device" where the folder `path` goes into has (almost) none left,
    else None: what torch's writer meant by a short write it reports as an opaque error."""
    try:
        free = shutil.disk_usage(Path(path).resolve().parent).free
    except OSError:
        return None
    return os.strerror(errno.ENOSPC) if free < (1 << 20) else None


def load_trace(path) -> Trace:
    """Load a trace file or a directory of shards (see module docstring)."""
    path = Path(path)
    if path.is_dir():
        writers = _listed(path)
        if not writers:
            raise QstateError(f"{path}: directory holds no *.pt trace shards")
        parts = []
        for label, files in writers:
            traces = sorted((_load_file(f) for f in files), key=lambda t: t.step_start)
            parts.append(traces[0] if len(traces) == 1 else join_steps(traces, str(path / label)))
        return merge_shards(common_steps(parts, str(path)), str(path))
    if not path.exists():
        raise QstateError(f"{path}: no such trace file")
    trace = _load_file(path)
    if any(t.partial for t in trace.tensors):  # one rank's pieces: complete only with the other ranks'
        return merge_shards([trace], str(path))
    return trace


def _steps(t: Trace) -> str:
    return f"step {t.step_start}" if t.n_steps == 1 else f"steps {t.step_start}..{t.step_start + t.n_steps - 1}"


def _who(t: Trace) -> str:
    rank = t.meta.get("rank")
    name = Path(t.source).name
    return f"rank {rank} ({name})" if isinstance(rank, int) and not isinstance(rank, bool) else name


def common_steps(parts: list[Trace], source: str) -> list[Trace]:
    """The shards cut to the steps every one of them covers (module docstring): a warning on
    stderr names what was dropped; a QstateError when no step is common to all."""
    if len(parts) < 2:
        return parts
    lo = max(p.step_start for p in parts)
    hi = min(p.step_start + p.n_steps for p in parts)
    if all((p.step_start, p.n_steps) == (lo, hi - lo) for p in parts):
        return parts
    ranges = "; ".join(f"{_who(p)}: {_steps(p)}" for p in parts)
    if lo >= hi:
        raise QstateError(f"{source}: no step is recorded by every shard ({ranges}); shards must come from one run")
    dropped = []
    out = []
    for p in parts:
        end = p.step_start + p.n_steps
        cut = [f"{a}..{b - 1}" if b - a > 1 else f"{a}" for a, b in ((p.step_start, lo), (hi, end)) if b > a]
        if cut:
            n = max(lo - p.step_start, 0) + max(end - hi, 0)
            dropped.append(f"{'step' if n == 1 else 'steps'} {' and '.join(cut)} of {_who(p)}")
        out.append(_cut(p, lo, hi))
    print(f"qstate: warning: {source}: loading steps {lo}..{hi - 1}, the steps every shard recorded ({ranges}); "
          f"dropped {', '.join(dropped)}: a rank stopped early (an interrupted or crashed run?)", file=sys.stderr)
    return out


def _cut(t: Trace, lo: int, hi: int) -> Trace:
    """Trace t restricted to steps lo..hi-1 (within its range). Where the head is cut, the
    recorded initial values (before t's first step) no longer fit and are dropped."""
    if (t.step_start, t.n_steps) == (lo, hi - lo):
        return t
    a, b = lo - t.step_start, hi - t.step_start
    tensors = [TraceTensor(x.name, x.index, x.shape, x.blocks, x.grads[a:b], x.init if a == 0 else None, x.elements,
                           _rows(x.absent, a, b)) for x in t.tensors]
    return Trace(t.optimizer, t.hparams, t.seed, lo, hi - lo, t.grad_dtype, tensors, dict(t.meta), t.source)


def not_zip_reason(path: Path) -> str:
    """Why a file that is not a zip archive is not read: a raw pickle (protocol 2+ starts with
    0x80) is refused because loading it can run code; anything else is not a torch.save file."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(1)
    except OSError:
        head = b""
    if head == b"\x80":
        return "a raw pickle, refused because loading one can run code; torch.save writes a zip archive"
    return "not a torch.save zip archive"


def _load_file(path: Path) -> Trace:
    if path.stat().st_size == 0:
        raise QstateError(f"{path}: empty file, not a trace")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as fh:
            if fh.read(4) == b"PK\x03\x04":
                raise QstateError(f"{path}: corrupt or truncated trace (a zip archive without its directory)")
        raise QstateError(f"{path}: not a qstate trace ({not_zip_reason(path)})")
    check_archive(path)
    if not _utf8(str(path)):  # torch opens it by its name, encoded as UTF-8: a ValueError read as "corrupt"
        raise QstateError(f"{path}: torch cannot open a file by this name (it is not valid UTF-8): rename it or "
                          f"its folder")
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


def _utf8(name: str) -> bool:
    """Whether a file name is valid UTF-8 (one that is not holds surrogates: os.fsdecode)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    if any(t.partial for s in shards for t in s.tensors):
        _check_ranks(shards, source)
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
    meta = _with_zero_tensors(dict(first.meta, shards=[s.source for s in shards]), tensors)
    return Trace(first.optimizer, first.hparams, first.seed, first.step_start, first.n_steps, first.grad_dtype,
                 tensors, meta, source)


def _with_zero_tensors(meta: dict, tensors: list) -> dict:
    """meta with `zero_tensors` recomputed from the gradients (a NaN counts as non-zero)."""
    zero = [t.name for t in tensors if not bool(t.grads.ne(0).any())]
    meta.pop("zero_tensors", None)
    if zero:
        meta["zero_tensors"] = zero
    return meta


def _check_ranks(shards: list[Trace], source: str) -> None:
    """A sharded recording is whole only with every rank's pieces: name the ranks missing
    where the files say how many there were (meta rank, world_size)."""
    world = {s.meta.get("world_size") for s in shards}
    ranks = {s.meta.get("rank") for s in shards}
    if len(world) != 1 or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return  # not written by the Recorder under torchrun: the pieces' own check says what is wrong
    (n,) = world
    if not isinstance(n, int) or ranks >= set(range(n)):
        return
    have = ", ".join(map(str, sorted(ranks)))
    missing = ", ".join(map(str, sorted(set(range(n)) - ranks)))
    if len(shards) == 1 and not Path(source).is_dir():
        raise QstateError(f"{source}: one rank's file of a sharded (FSDP2) recording on {n} ranks (rank {have}): "
                          f"it holds that rank's pieces of the tensors only; load the directory that holds every "
                          f"rank's file")
    raise QstateError(f"{source}: a sharded (FSDP2) recording on {n} ranks, but only rank(s) {have} wrote files here "
                      f"(none from rank(s) {missing}: stopped before writing a file?); every rank's pieces are "
                      f"needed")


def _join(name: str, parts: list, source: str):
    """One tensor from ranks' pieces (schema.py `elements`): same identity, ascending
    element order, every recorded element exactly once. Each piece's elements lie in the
    recorded blocks (checked at load), so as many distinct elements as the blocks hold are
    each of them once: counted and compared, never spelled out (schema.py module docstring)."""
    from .schema import TraceTensor, block_lengths

    first = parts[0][1]
    for where, t in parts[1:]:
        if (t.index, t.shape) != (first.index, first.shape) or not torch.equal(t.blocks, first.blocks):
            raise QstateError(f"{source}: pieces of tensor {name!r} in {parts[0][0]} and {where} disagree on "
                              f"index, shape or blocks")
    held, want = sum(t.elements.numel() for _, t in parts), block_lengths(first.blocks, first.numel)
    once = held == want  # the count first: a small file may declare blocks of billions of elements
    if once:
        elements = torch.cat([t.elements for _, t in parts])
        order = torch.argsort(elements)
        once = bool((elements[order].diff() > 0).all())
    if not once:
        raise QstateError(f"{source}: the pieces of tensor {name!r} hold {held} elements, not each of "
                          f"its {want} recorded elements once (a rank's shard missing or repeated?)")
    grads = torch.cat([t.grads for _, t in parts], dim=1)[:, order]
    inits = [t.init for _, t in parts]
    init = torch.cat(inits)[order] if all(i is not None for i in inits) else None
    absent = [t.absent for _, t in parts if t.absent is not None]  # .grad None: the same on every rank
    absent = torch.unique(torch.cat(absent)) if absent else None
    return TraceTensor(name, first.index, first.shape, first.blocks, grads, init, absent=absent)


def _rows(absent, a: int, b: int):
    """The absent rows (schema.py) among rows a..b-1, renumbered from a (None: none)."""
    if absent is None:
        return None
    kept = absent[(absent >= a) & (absent < b)] - a
    return kept if kept.numel() else None


def _listed(path: Path) -> list[tuple[str, list[Path]]]:
    """The files of a trace directory, by writer: each manifest's listed files (one rank's
    stream), else every *.pt file on its own."""
    manifests = sorted(path.glob("manifest*.json"))
    if not manifests:
        return [(p.name, [p]) for p in sorted(p for p in path.glob("*.pt") if p.is_file())]
    writers = []
    for m in manifests:
        try:
            obj = json.loads(m.read_text())
        except (OSError, ValueError) as exc:
            raise QstateError(f"{m}: unreadable manifest ({exc})") from None
        if not isinstance(obj, dict) or obj.get("format") != MANIFEST_TAG or not isinstance(obj.get("files"), list):
            raise QstateError(f"{m}: not a qstate trace manifest")
        files = []
        for name in obj["files"]:
            f = path / str(name)
            if Path(str(name)).name != str(name) or not f.is_file():
                raise QstateError(f"{m}: lists {name!r}, which is not a file in {path}")
            files.append(f)
        if files:
            writers.append((m.name, files))
    return writers


def join_steps(parts: list[Trace], source: str) -> Trace:
    """One trace from traces of consecutive step ranges of the same tensors (streaming; a
    rank's pieces of sharded tensors keep their element indices)."""
    first = parts[0]
    step = first.step_start
    for p in parts:
        if p.step_start != step:
            if p.step_start < step:
                raise QstateError(f"{source}: two files record step {p.step_start}")
            raise QstateError(f"{source}: steps {step}..{p.step_start - 1} are missing between the recorded files")
        if [(t.name, t.index, t.shape) for t in p.tensors] != [(t.name, t.index, t.shape) for t in first.tensors] or \
                any(not torch.equal(a.blocks, b.blocks) or (a.elements is None) != (b.elements is None)
                    or (a.elements is not None and not torch.equal(a.elements, b.elements))
                    for a, b in zip(p.tensors, first.tensors)):
            raise QstateError(f"{source}: the files of steps {p.step_start}.. record other tensors or blocks")
        step += p.n_steps
    tensors = []
    for j, t in enumerate(first.tensors):
        grads = torch.cat([p.tensors[j].grads for p in parts])
        rows = [p.tensors[j].absent + (p.step_start - first.step_start) for p in parts
                if p.tensors[j].absent is not None]
        tensors.append(TraceTensor(t.name, t.index, t.shape, t.blocks, grads, t.init, t.elements,
                                   torch.cat(rows) if rows else None))
    meta = _with_zero_tensors(dict(first.meta, files=[p.source for p in parts]), tensors)
    return Trace(first.optimizer, first.hparams, first.seed, first.step_start, step - first.step_start,
                 first.grad_dtype, tensors, meta, source)
