"""Training-checkpoint folders, and the files in them that are not an optimizer checkpoint.

A Hugging Face Trainer checkpoint and an accelerate `save_state` folder keep the optimizer
in one file beside the model's weights and the run's other state:

    checkpoint-N/ (Trainer)   optimizer.pt, model.safetensors, scheduler.pt, trainer_state.json, ...
    accelerate save_state     optimizer.bin (a second optimizer: optimizer_1.bin), model.safetensors, ...
                              with FSDP's sharded state dict: optimizer_0/ (a torch.distributed.checkpoint)

`open_folder` picks that optimizer (optimizer.pt, else optimizer.bin, else optimizer_0/),
which doctor reads as if it had been given it and says so in an `info` finding (`source`),
naming any other optimizer file there. The model's weights give shapes: a
`model.safetensors` (or its shards, `model-00001-of-00002.safetensors`) starts with an
8-byte little-endian length and a JSON header `{name: {dtype, shape, data_offsets}}`,
read here without reading the weights (no safetensors package needed), at most
MAX_HEADER_BYTES per file, MAX_HEADERS_BYTES in all, every shape a list of at most 64
non-negative integers; a header that breaks a rule is not used and the finding says why.

Names are not paired with the optimizer's states. The Trainer's optimizer.pt keys its
parameters by index, in the order the optimizer was built: the trainable parameters of
`model.named_parameters()` (module order) split into the weight-decay and no-decay groups.
model.safetensors sorts its tensors by name, also holds buffers and drops tied weights,
and the folder says neither the module order nor which parameters decay, so an index
cannot be mapped to a name exactly: the parameters are listed by index (an optimizer
built from `named_parameters()` keeps `param_names`, and then they are named). The header
gives shapes where they are unambiguous (states.py `_model_shape`): by name for a named
parameter, else the one shape the model's tensors of that many elements have. Only
qstate's flat codes need it: torch, torchao and bitsandbytes states keep their shape.

`what_file` names a file that is not a torch.save archive but is something doctor can
tell (a safetensors file, JSON such as trainer_state.json), for load_checkpoint's error.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QstateError

OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
MAX_HEADER_BYTES = 16 << 20  # ~150,000 tensors' entries; safetensors' own limit is 100 MB
MAX_HEADERS_BYTES = 64 << 20
MAX_DIMS = 64
MAX_DIM = 1 << 48
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


@dataclass
class FolderSource:
    """What doctor reads for a checkpoint folder (module docstring)."""

    folder: Path
    file: Path  # the optimizer checkpoint inside it (a torch.save file or a DCP directory)
    kind: str  # "Hugging Face Trainer checkpoint folder", ...
    others: list[str] = field(default_factory=list)  # more optimizer files, not read
    model_files: list[Path] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    model_problem: str = ""  # why the model's header was not used

    def note(self, optimizers) -> str:
        """The `source` finding's message, once `optimizers` were read."""
        parts = [f"read {self.file.name} of this {self.kind} ({self.folder})"]
        if self.others:
            parts.append(f"not {', '.join(self.others)} (pass it to check that one)")
        params = [p for o in optimizers for p in o.params]
        from_model = sum(p.model_shape is not None for p in params)
        unknown = sum(not p.shape_known for p in params)
        model = self.model_files[0].name if len(self.model_files) == 1 else f"{len(self.model_files)} model shards"
        left = f", {unknown} left unknown" if unknown else ""
        if self.model_problem:
            parts.append(f"{self.model_problem}: not used for shapes")
        elif from_model:
            parts.append(f"shapes from the header of {model} for {from_model} parameter(s) whose states keep none "
                         f"(by name, else by element count where one shape has it){left}")
        elif unknown:
            parts.append(f"{unknown} parameter(s) without a known shape"
                         + ("" if self.model_files else " (no model.safetensors beside it)"))
        if any(not p.named for p in params):
            parts.append(f"parameters by index: {self.file.name} keeps no names, and the model's weights do not list "
                         f"its tensors in the optimizer's order, so names are not paired")
        return "; ".join(parts)


def open_folder(folder: Path) -> FolderSource:
    """The optimizer checkpoint of a training-checkpoint folder and its model's shapes; a
    QstateError where the folder holds none (module docstring)."""
    found = [folder / n for n in OPTIMIZER_FILES if (folder / n).is_file()]
    found += [d for d in sorted(folder.glob("optimizer_*")) if d.is_dir() and (d / ".metadata").is_file()]
    found += sorted(f for f in folder.glob("optimizer_*.bin") if f.is_file())
    hf = (folder / "trainer_state.json").is_file()
    if not found:
        hint = (" (a Hugging Face Trainer checkpoint saved without its optimizer: save_only_model=True?)" if hf
                else "")
        raise QstateError(f"{folder}: a folder, but neither a torch.distributed.checkpoint directory (no .metadata) "
                          f"nor a training checkpoint folder (no optimizer.pt, optimizer.bin or optimizer_0/){hint}")
    kind = ("Hugging Face Trainer checkpoint folder" if hf else
            "accelerate save_state folder" if found[0].name != "optimizer.pt" else "checkpoint folder")
    source = FolderSource(folder, found[0], kind, [f.name + ("/" if f.is_dir() else "") for f in found[1:]])
    single = folder / "model.safetensors"
    source.model_files = [single] if single.is_file() else sorted(
        f for f in folder.glob("model-*.safetensors") if _SHARD.fullmatch(f.name) and f.is_file())
    budget = MAX_HEADERS_BYTES
    try:
        for f in source.model_files:
            shapes, used = safetensors_shapes(f, min(MAX_HEADER_BYTES, budget))
            budget -= used
            source.shapes.update(shapes)
    except QstateError as exc:
        source.model_problem, source.shapes = str(exc), {}
    return source


def safetensors_shapes(path: Path, limit: int = MAX_HEADER_BYTES) -> tuple[dict[str, tuple[int, ...]], int]:
    """{tensor name: shape} from a safetensors file's header, and the header's size; a
    QstateError naming what is wrong (module docstring: the limits)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise QstateError(f"{path}: not a safetensors file (its header length {n} does not fit its "
                                  f"{size:,} bytes)")
            if n > limit:
                raise QstateError(f"{path}: a safetensors header of {n:,} bytes, over the {limit:,} read")
            raw = fh.read(n)
    except OSError as exc:
        raise QstateError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise QstateError(f"{path}: not a safetensors file (its header is not JSON: {str(exc)[:80]})") from None
    if not isinstance(header, dict):
        raise QstateError(f"{path}: not a safetensors file (its header is not a JSON object)")
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)):
            raise QstateError(f"{path}: a malformed safetensors header (tensor {name[:60]!r} has no shape of at most "
                              f"{MAX_DIMS} non-negative integers)")
        shapes[name] = tuple(shape)
    return shapes, n


def what_file(path: Path) -> str:
    """For a file that is not a zip archive: what it is, where doctor can tell ('' otherwise)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(64)
    except OSError:
        return ""
    if path.suffix == ".safetensors" or (len(head) > 8 and head[8:9] == b"{"):
        try:
            shapes, _ = safetensors_shapes(path)
        except QstateError:
            if path.suffix != ".safetensors":
                return ""
            return "a .safetensors file with an unreadable header (safetensors files hold no optimizer state)"
        return f"a safetensors file of {len(shapes)} tensors (model weights; no optimizer state)"
    text = head.lstrip()
    if path.suffix == ".json" or text[:1] in (b"{", b"["):
        what = {"trainer_state.json": "the Hugging Face Trainer's step count and logs",
                "config.json": "a model configuration"}.get(path.name, "text")
        return f"a JSON file ({what}; no optimizer state)"
    return ""


def pass_instead(path: Path) -> str:
    """What to pass instead of a file of a checkpoint folder: its optimizer file, or the folder."""
    there = [path.parent / n for n in OPTIMIZER_FILES if (path.parent / n).is_file()]
    if there:
        return f"pass {there[0]} or the folder {path.parent}"
    return "pass the optimizer checkpoint (optimizer.pt, optimizer.bin) or the checkpoint folder"
