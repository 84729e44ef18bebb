"""A torch.distributed.checkpoint directory's metadata checked before anything is allocated
or read (safeload.load_dcp), and its flat items nested again (`unflatten`).

`.metadata` is a few KB that declares everything: each tensor's size and dtype, its chunks
and where each stored item lies (file, offset, length), and the path each flat key takes
in the nested state dict (`planner_data`). A crafted one can declare a tensor of 8 GiB
in a 43 KB folder, a negative size, a dtype that is text, or a list index of 10^9 in a
path (torch's own unflatten builds that list). So, each a QstateError naming the folder:

- `state_dict_metadata` and `storage_data` are dicts; each tensor's size and its chunks'
  offsets and sizes are whole numbers >= 0 (a chunk within the tensor), its dtype a
  torch dtype;
- the declared tensors take at most `max_bytes` (--max-gib) and at most the bytes its data
  files hold (an item stores its chunk's bytes and more: a tensor declared larger than
  the files is forged or truncated, and is refused before its zeros are allocated);
- each item names a file inside the folder, with an offset and length within it;
- a `planner_data` path is a non-empty tuple of names and list indices, and a list index
  is below the number of items stored (a list DCP saved holds at most one element per
  item), so no path builds a list longer than the checkpoint can fill; paths that
  collide (a name under a list, an index under a value) are refused.

The checks cost what the file holds, not what it declares. Pickle shares one object
wherever it recurs, so a 35 KB .metadata gave 3,000 keys one list of 3,000 chunks (as it
could give them one size of 10,000 dimensions, or one path of 10,000 keys): checked key by
key, 9 million chunk checks (36 s), growing with the square of the file. So, before any
key is checked, each a QstateError naming the folder:

- the chunks listed, summed over the keys, are at most the items stored (`storage_data`
  has distinct keys, so their number grows only with the file): DCP reads each chunk
  from its own stored item, so a loadable checkpoint never lists more;
- a size has at most MAX_DIMS (64) dimensions, a planner_data path at most MAX_PATH (64)
  keys (a state dict is a few levels deep).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import QstateError, clip

MAX_DIMS = 64  # dimensions of a declared tensor size (module docstring)
MAX_PATH = 64  # keys in a planner_data path


def size_text(n: int) -> str:
    """A byte count for a message, with enough digits for any limit (--max-gib 1e-9 is 1 byte)."""
    if n < 2**30:
        return f"{n:,} byte" + ("" if n == 1 else "s")
    gib = n / 2**30
    return f"{gib:,.2f} GiB" if gib < 1e9 else f"{gib:.3g} GiB"


def _show(value) -> str:
    """A size or offsets for a message: torch.Size([2, 3]) as (2, 3), clipped."""
    return clip(repr(tuple(value)) if isinstance(value, (tuple, list)) else repr(value), 60)


def _dims(value) -> bool:
    return isinstance(value, (tuple, list)) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)


def item_file(root: Path, info) -> Path:
    """The file a stored item names, inside the checkpoint folder and present."""
    rel_text = getattr(info, "relative_path", None)
    if not isinstance(rel_text, str):
        raise QstateError(f"{root}/.metadata: an item's file is {clip(repr(rel_text))}, not a file name")
    rel = Path(rel_text)
    if rel.is_absolute() or ".." in rel.parts:
        raise QstateError(f"{root}: metadata names a file outside the checkpoint ({rel})")
    file = root / rel
    if not file.is_file():
        raise QstateError(f"{root}: metadata names {rel}, which is missing")
    return file


def check_metadata(root: Path, md, max_bytes: int) -> None:
    """Refuse metadata that is malformed, or declares more than the limit or the files hold
    (module docstring); nothing is allocated."""
    where = f"{root}/.metadata"
    sdm, stored = md.state_dict_metadata, md.storage_data
    if not isinstance(sdm, dict) or not isinstance(stored, dict):
        raise QstateError(f"{where}: not DCP metadata (state_dict_metadata is {type(sdm).__name__} and "
                          f"storage_data {type(stored).__name__}; both are dicts)")
    _check_counts(where, sdm, stored)
    declared = 0
    for fqn, entry in sdm.items():
        if not isinstance(fqn, str):
            raise QstateError(f"{where}: a key {clip(repr(fqn))} that is not text")
        if not hasattr(entry, "chunks"):
            continue  # bytes: a pickled-by-torch.save value, read with weights_only
        size, dtype = getattr(entry, "size", None), getattr(getattr(entry, "properties", None), "dtype", None)
        if not _dims(size):
            raise QstateError(f"{where}: {clip(fqn)!r} declares size {_show(size)}: each dimension must be a "
                              f"whole number >= 0")
        if not isinstance(dtype, torch.dtype):
            raise QstateError(f"{where}: {clip(fqn)!r} declares dtype {clip(repr(dtype))}, not a torch dtype")
        chunks = entry.chunks if isinstance(entry.chunks, (list, tuple)) else None
        for chunk in chunks or ():
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not (isinstance(offsets, (tuple, list)) and isinstance(sizes, (tuple, list))
                    and len(offsets) == len(sizes) == len(size)  # before reading them: at most MAX_DIMS
                    and _dims(offsets) and _dims(sizes) and all(o + s <= d for o, s, d in zip(offsets, sizes, size))):
                raise QstateError(f"{where}: {clip(fqn)!r}: a chunk at {_show(offsets)} of size {_show(sizes)} "
                                  f"does not lie within its size {_show(size)}")
        if chunks is None:
            raise QstateError(f"{where}: {clip(fqn)!r}: its chunks are {type(entry.chunks).__name__}, not a list")
        declared += math.prod(size) * dtype.itemsize
    if declared > max_bytes:
        raise QstateError(f"{root}: its tensors take {size_text(declared)}, over the limit of {size_text(max_bytes)} "
                          f"(--max-gib)")
    files: dict[Path, int] = {}
    for index, info in stored.items():
        if not isinstance(getattr(index, "fqn", None), str):
            raise QstateError(f"{where}: a stored item's key {clip(repr(index))} names no key of the checkpoint")
        file = item_file(root, info)
        size = files.setdefault(file, file.stat().st_size)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not _dims((offset, length)) or offset + length > size:
            raise QstateError(f"{root}: item at {file.name}:{clip(repr(offset))}+{clip(repr(length))} runs past "
                              f"the file's {size} bytes")
    on_disk = sum(files.values())
    if declared > on_disk:
        raise QstateError(f"{root}: its metadata declares tensors of {size_text(declared)}, but its data files hold "
                          f"{size_text(on_disk)}: a truncated or forged checkpoint (refused before allocating them)")


def _check_counts(where: str, sdm: dict, stored: dict) -> None:
    """The totals that bound the per-key checks, summed without looking inside a shared
    object more than its length (module docstring)."""
    listed, dims = 0, 0
    for entry in sdm.values():
        chunks, size = getattr(entry, "chunks", None), getattr(entry, "size", None)
        listed += len(chunks) if isinstance(chunks, (list, tuple)) else 0
        dims = max(dims, len(size) if isinstance(size, (list, tuple)) else 0)
    if listed > len(stored):
        raise QstateError(f"{where}: its tensors list {listed:,} chunks, but it stores {len(stored):,} items (each "
                          f"chunk is read from an item of its own): a forged checkpoint")
    if dims > MAX_DIMS:
        raise QstateError(f"{where}: a tensor declares {dims:,} dimensions (at most {MAX_DIMS})")


def unflatten(flat: dict, mapping, root: Path) -> dict:
    """Nested dicts/lists from DCP's flat keys and its planner_data paths (an int path
    element indexes a list, as torch's own unflatten does), bounded (module docstring)."""
    where = f"{root}/.metadata"
    if not isinstance(mapping, dict):
        raise QstateError(f"{where}: planner_data is {type(mapping).__name__}, not a dict of paths")
    limit = len(flat)
    out: dict = {}
    for fqn, value in flat.items():
        path = mapping.get(fqn, (fqn,))
        if isinstance(path, (tuple, list)) and len(path) > MAX_PATH:
            raise QstateError(f"{where}: the planner_data path of {clip(fqn)!r} is {len(path):,} keys long (at most "
                              f"{MAX_PATH})")
        if not isinstance(path, (tuple, list)) or not path or not all(
                isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)) for k in path):
            raise QstateError(f"{where}: the planner_data path of {clip(fqn)!r} is {clip(repr(path))}, not a "
                              f"non-empty tuple of names and list indices")
        big = next((k for k in path if isinstance(k, int) and not 0 <= k < limit), None)
        if big is not None:
            raise QstateError(f"{where}: the planner_data path of {clip(fqn)!r} holds list index {clip(str(big))}, "
                              f"but the checkpoint stores {limit} item(s) (a list it saved has at most one element "
                              f"per item)")
        node = out
        for key, nxt in zip(path[:-1], path[1:]):
            child = _get(node, key, fqn, where)
            if child is None:
                child = [] if isinstance(nxt, int) else {}
                _set(node, key, child, fqn, where)
            node = child
        _set(node, path[-1], value, fqn, where)
    return out


def _collide(fqn: str, where: str) -> QstateError:
    return QstateError(f"{where}: the planner_data path of {clip(fqn)!r} runs into another item's (a name under "
                       f"a list, or a key under a value)")


def _get(node, key, fqn: str, where: str):
    if isinstance(node, list) and isinstance(key, int):
        return node[key] if key < len(node) else None
    if isinstance(node, dict):
        return node.get(key)
    raise _collide(fqn, where)


def _set(node, key, value, fqn: str, where: str) -> None:
    if isinstance(node, list) and isinstance(key, int):
        node.extend([None] * (key + 1 - len(node)))  # key < the number of items: bounded
        node[key] = value
    elif isinstance(node, dict):
        node[key] = value
    else:
        raise _collide(fqn, where)
