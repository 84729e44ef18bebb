"""Read an optimizer checkpoint without running code from it.

Two kinds of input (and a training-checkpoint folder, read as the optimizer file in it:
folders.py):

- a `torch.save` file (`optimizer.pt`, a Lightning `.ckpt`, `{"model": ..., "optimizer":
  ...}`): it must be a zip archive (a legacy raw pickle is refused before torch sees it)
  and is read with `torch.load(weights_only=True)`. The only classes added to torch's
  allow-list are *stand-ins* for torchao's low-bit optimizer states
  (`torchao.optim.subclass_{4bit,8bit,fp8}.OptimState*`): the archive's reference to
  torchao's class is resolved to `LowBitState` here, a tensor subclass that only holds
  the fields (codes, scale, qmap, signed, block size, shape) and refuses every tensor
  operation. torchao is neither needed nor imported, and none of its code runs.
- a `torch.distributed.checkpoint` (DCP) directory (`.metadata` plus `*.distcp` files):
  torch's own reader unpickles `.metadata` with plain `pickle` (it can run code), so the
  metadata is read here by an unpickler whose `find_class` allows only the DCP metadata
  dataclasses, torch.Size, dtypes and layouts (and `getattr` only as the member of an
  allowed Enum: how some Pythons, e.g. Debian 12's 3.11.2, pickle `_MEM_FORMAT_ENCODING`'s
  members); every stored item is then one
  `torch.save` blob at (file, offset, length), sliced out and read with
  `weights_only=True`. Sharded tensors are reassembled from their chunks. Items written
  with storage transforms (compression) are refused.

A file saved by one rank of an FSDP2 run (`torch.save(opt.state_dict())` on each rank)
holds DTensors: torch's safe load reads them once `torch.distributed.tensor` is imported
(it allow-lists DTensor, its placements and the device mesh itself), so it is imported
before every load, still `weights_only=True`. Replicated DTensors are whole tensors and
read as such; a file holding sharded ones is one rank's part of each state and is refused
with one line naming the rank and how many of the values it holds (its blocks and
dithers need the shard's place in the whole tensor: the DCP directory or a full state
dict has every rank's).

Size limits: a file, or the sum of a DCP directory's tensors as its metadata declares
them, above `max_bytes` is refused before anything is read; so is DCP metadata that
declares more bytes than its files hold, or that is malformed (dcpmeta.py). A stored
chunk must be a dense tensor of its declared dtype (trace/plain.py).

Every problem is a QstateError naming the path (exit 2).
"""
from __future__ import annotations

import enum
import io
import logging
import pickle
import sys
import zipfile
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from ..errors import QstateError
from ..trace.io import not_zip_reason
from ..trace.plain import tensor_problem
from .dcpmeta import check_metadata, item_file, size_text, unflatten
from .folders import open_folder, pass_instead, what_file

DEFAULT_MAX_BYTES = 32 * 2**30

TORCHAO_CLASSES = ("torchao.optim.subclass_4bit.OptimState4bit", "torchao.optim.subclass_8bit.OptimState8bit",
                   "torchao.optim.subclass_fp8.OptimStateFp8")


class LowBitState(torch.Tensor):
    """Stand-in for a torchao low-bit optimizer state read from a checkpoint: the stored
    fields as attributes (`codes`, `scale`, `qmap` when the format has one, `signed`,
    `block_size`, `_shape` for 4-bit), no behaviour. `source` names torchao's class."""

    source = "torchao"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a {cls.__name__} read by `qstate doctor` holds stored fields only ({func})")


def _stand_in(qualname: str) -> type:
    short = qualname.rsplit(".", 1)[1]
    return type(short, (LowBitState,), {"source": qualname, "__module__": __name__})


STAND_INS = [(_stand_in(name), name) for name in TORCHAO_CLASSES]


def load_checkpoint(path, max_bytes: int = DEFAULT_MAX_BYTES):
    """The checkpoint's contents (nested dicts/lists of tensors and plain values)."""
    path = Path(path)
    if path.is_dir():
        if not (path / ".metadata").is_file():  # a training-checkpoint folder: its optimizer file (folders.py)
            return load_checkpoint(open_folder(path).file, max_bytes)
        return load_dcp(path, max_bytes)
    if not path.exists():
        raise QstateError(f"{path}: no such checkpoint")
    size = path.stat().st_size
    if size == 0:
        raise QstateError(f"{path}: empty file, not a checkpoint")
    if size > max_bytes:
        raise QstateError(f"{path}: {size_text(size)} is over the limit of {size_text(max_bytes)} (--max-gib)")
    if not zipfile.is_zipfile(path):
        with path.open("rb") as fh:
            if fh.read(4) == b"PK\x03\x04":  # starts like a zip, but its directory (at the end) is gone
                raise QstateError(f"{path}: corrupt or truncated checkpoint (a zip archive without its directory)")
        what = what_file(path)  # a file of a checkpoint folder that is not its optimizer (folders.py)
        if what:
            raise QstateError(f"{path}: {what}: {pass_instead(path)}")
        raise QstateError(f"{path}: {not_zip_reason(path)}")
    with path.open("rb") as fh:
        obj = _torch_load(fh, str(path))
    return _whole_tensors(obj, str(path))


def _dtensor_class():
    """DTensor, imported (which allow-lists it for weights_only loads), or None where
    torch.distributed is not built in."""
    try:
        if not torch.distributed.is_available():
            return None
        from torch.distributed.tensor import DTensor
    except Exception:  # noqa: BLE001 - any failure: DTensors stay refused by the safe load
        return None
    return DTensor


def _torch_load(fh, what: str):
    _dtensor_class()
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)  # "unpickling of the DeviceMesh occurred before the PGs were created": expected
    try:
        with torch.serialization.safe_globals(STAND_INS):
            return torch.load(fh, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = str(exc).strip().splitlines()
        detail = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0] if lines else "")
        raise QstateError(f"{what}: refused: it holds Python objects a safe load does not allow (they could run "
                          f"code) [{detail.strip()[:160]}]") from None
    except (RuntimeError, EOFError, ValueError, KeyError, OSError, TypeError, zipfile.BadZipFile) as exc:
        msg = " ".join(str(exc).split())[:200]
        raise QstateError(f"{what}: corrupt or truncated checkpoint ({type(exc).__name__}: {msg})") from None
    finally:
        mesh_log.setLevel(level)


def _whole_tensors(obj, what: str):
    """obj with replicated DTensors as their (whole) local tensors; a QstateError where it
    holds sharded ones (one rank's part of an FSDP2 state dict: module docstring)."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return obj
    found: list = []
    _collect(obj, dtensor, found, 0)
    if not found:
        return obj
    sharded = [t for t in found if any(not pl.is_replicate() for pl in t.placements)]
    if not sharded:
        return _replace(obj, dtensor, 0)
    local = sum(t.to_local().numel() for t in sharded)
    whole = sum(t.numel() for t in sharded)
    mesh = sharded[0].device_mesh
    coord = getattr(mesh, "_coordinate_on_dim", None)  # saved with the mesh: the writing rank's place
    try:
        size = mesh.size()
    except Exception:  # noqa: BLE001
        size = None
    who = (f" (rank {coord[0]} of {size})" if isinstance(coord, (list, tuple)) and len(coord) == 1 and size
           else f" (of {size} ranks)" if size else "")
    raise QstateError(f"{what}: one rank's FSDP2 shard{who}: its {len(sharded)} sharded DTensors hold {local:,} of "
                      f"{whole:,} values, and a shard's blocks decode only in their place in the whole tensor; check "
                      f"the torch.distributed.checkpoint directory (dcp.save) or a full state dict "
                      f"(get_optimizer_state_dict with StateDictOptions(full_state_dict=True)) instead")


def _collect(obj, cls, found: list, depth: int) -> None:
    if isinstance(obj, cls):
        found.append(obj)
    elif depth < 8 and isinstance(obj, dict):
        for v in obj.values():
            _collect(v, cls, found, depth + 1)
    elif depth < 8 and isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, cls, found, depth + 1)


def _replace(obj, cls, depth: int):
    if isinstance(obj, cls):
        return obj.to_local()
    if depth < 8 and isinstance(obj, dict):
        return {k: _replace(v, cls, depth + 1) for k, v in obj.items()}
    if depth < 8 and isinstance(obj, list):
        return [_replace(v, cls, depth + 1) for v in obj]
    if depth < 8 and isinstance(obj, tuple):
        return tuple(_replace(v, cls, depth + 1) for v in obj)
    return obj


# -- torch.distributed.checkpoint ----------------------------------------------------------

_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("collections", "OrderedDict"),
      ("torch.serialization", "_get_layout")}


_PATHS = {"PosixPath": PurePosixPath, "PurePosixPath": PurePosixPath, "WindowsPath": PureWindowsPath,
          "PureWindowsPath": PureWindowsPath}


def _refused(module: str, name: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def _enum_member(cls, member):
    """getattr(cls, member), only where cls is an allowed Enum (_DCP_CLASSES) and member one
    of its members' names: the one use of `getattr` in DCP metadata. Python 3.11.2 (Debian 12's
    python3.11) pickles an Enum member by name, as getattr(EnumClass, 'NAME'), whichever torch
    writes it; 3.10.13, 3.11.7, 3.12.1 and 3.13.0 pickle it as EnumClass(value)."""
    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and (cls.__module__, cls.__qualname__) in _DCP_CLASSES
            and getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls
            and type(member) is str and member in cls.__members__):
        return cls[member]
    raise _refused("builtins", "getattr")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: data classes, torch.Size, dtypes and layouts only (and an
    allowed Enum's member by name: _enum_member)."""

    def find_class(self, module, name):
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        if module in ("pathlib", "pathlib._local") and name in _PATHS:  # storage_meta.checkpoint_id: a path,
            # kept as a pure path (Python 3.13 moved the classes to pathlib._local and pickles them from there)
            return _PATHS[name]
        raise _refused(module, name)


def load_dcp(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """A DCP directory as one nested state dict (see module docstring)."""
    try:
        import torch.distributed.checkpoint.metadata as dcp_md  # noqa: F401 - the classes the unpickler allows
    except ImportError as exc:
        raise QstateError(f"{path}: reading a torch.distributed.checkpoint needs torch.distributed ({exc})") from None
    try:
        with (path / ".metadata").open("rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except pickle.UnpicklingError as exc:
        raise QstateError(f"{path}/.metadata: refused: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any other failure is a corrupt file
        raise QstateError(f"{path}/.metadata: corrupt DCP metadata ({type(exc).__name__}: {exc})") from None
    if not hasattr(md, "state_dict_metadata") or not hasattr(md, "storage_data"):
        raise QstateError(f"{path}/.metadata: not DCP metadata")
    check_metadata(path, md, max_bytes)  # sizes, dtypes, chunks, files: before anything is allocated
    by_fqn: dict[str, list] = {}
    for index, info in md.storage_data.items():
        by_fqn.setdefault(index.fqn, []).append((index, info))
    flat = {}
    handles: dict[str, object] = {}
    try:
        for fqn, entry in md.state_dict_metadata.items():
            items = by_fqn.get(fqn, [])
            if not items:
                raise QstateError(f"{path}: no stored data for {fqn!r}")
            if hasattr(entry, "chunks"):
                flat[fqn] = _assemble(path, fqn, entry, items, handles)
            else:
                flat[fqn] = _read_item(path, items[0][1], handles)
    except (AttributeError, TypeError, ValueError, IndexError, KeyError, RuntimeError, OverflowError) as exc:
        msg = " ".join(str(exc).split())[:160]  # a metadata shape no check above foresaw: still one line
        raise QstateError(f"{path}: malformed DCP checkpoint ({type(exc).__name__}: {msg})") from None
    finally:
        for fh in handles.values():
            fh.close()
    return unflatten(flat, getattr(md, "planner_data", None) or {}, path)


def _assemble(path: Path, fqn: str, entry, items: list, handles: dict) -> torch.Tensor:
    """One tensor from its stored chunks (sizes checked by check_metadata): each a dense
    tensor of the declared dtype, within the whole."""
    full = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
    for index, info in items:
        chunk = _read_item(path, info, handles)
        if not isinstance(chunk, torch.Tensor):
            raise QstateError(f"{path}: item {fqn!r} is not a tensor")
        problem = tensor_problem(chunk)
        if problem:
            raise QstateError(f"{path}: item {fqn!r} is {problem}")
        if chunk.dtype != full.dtype:
            raise QstateError(f"{path}: a chunk of {fqn!r} is {chunk.dtype}, but its metadata declares {full.dtype}")
        offsets = tuple(index.offset or (0,) * full.dim())
        if len(offsets) != full.dim() or not all(isinstance(o, int) and o >= 0 for o in offsets):
            raise QstateError(f"{path}: a chunk of {fqn!r} at {offsets} does not index a {full.dim()}-d tensor")
        region = full[tuple(slice(o, o + s) for o, s in zip(offsets, chunk.shape))]
        if region.shape != chunk.shape:
            raise QstateError(f"{path}: chunk of {fqn!r} at {offsets} falls outside {tuple(full.shape)}")
        region.copy_(chunk)
    return full


def _read_item(root: Path, info, handles: dict):
    if getattr(info, "transform_descriptors", None):
        raise QstateError(f"{root}: items stored with transforms {list(info.transform_descriptors)} are not "
                          f"supported")
    file = item_file(root, info)
    size = file.stat().st_size
    if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
        raise QstateError(f"{root}: item at {file.name}:{info.offset}+{info.length} runs past the file's {size} bytes")
    fh = handles.get(str(file))
    if fh is None:
        fh = handles[str(file)] = file.open("rb")
    fh.seek(info.offset)
    return _torch_load(io.BytesIO(fh.read(info.length)), f"{file} @ {info.offset}")
