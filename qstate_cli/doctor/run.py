"""`qstate doctor` as a library: options in, a Result (kind "doctor") out.

    execute(DoctorOptions(checkpoint="optimizer.pt", against="resumed.pt"), progress) -> Result

One record per (checkpoint, optimizer, param): its shape ('512x32'; where the file keeps
none, '16,384 elements' and `shape_known` false), what stores its states and how many bytes
(`state_bytes`: in the checkpoint; `memory_bytes`: what the optimizer holds in memory, which
is more only where the checkpoint keeps a state per element, FSDP2's elements form),
its step counter, the counts the checks found (non-finite values; v flushed to zero,
subnormal or negative) and its errors and warnings; with `against`, how many elements
differ from the other checkpoint and by how much at most. `findings` (an extra list of
flat rows) holds every finding with its one-line message; `meta.summary` the totals. The
engine never fails on a finding: the CLI exits 1 when `summary.errors` > 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import QstateError
from ..options import Options, option, positive_number
from ..progress import QUIET, Progress
from ..results import Result
from .against import compare
from .checks import Finding, check_optimizer, v_counts
from .folders import FolderSource, open_folder
from .safeload import load_checkpoint
from .states import OptimizerStates, find_optimizers


@dataclass
class DoctorOptions(Options):
    """`qstate doctor`: the CLI options and a suite point's parameters (options.py)."""

    COMMAND = "doctor"

    checkpoint: str | None = option(None, "Optimizer checkpoint: a torch.save file (optimizer.pt, a Lightning "
                                          ".ckpt, a dict holding an optimizer state dict), a "
                                          "torch.distributed.checkpoint directory, or a training-checkpoint "
                                          "folder (Hugging Face checkpoint-N/: its optimizer.pt; accelerate: "
                                          "optimizer.bin).", argument=True)
    against: str | None = option(None, "A second checkpoint of the same run (e.g. saved before, loaded after a "
                                       "resume): every state compared element-wise.", type=str)
    max_gib: float = option(32.0, "Refuse checkpoints larger than this (GiB), before reading them.",
                            parse=positive_number("--max-gib"), type=float)

    @classmethod
    def from_params(cls, params: dict | None, what: str | None = None) -> "DoctorOptions":
        """A suite point's options, its `checkpoint` required (the CLI's missing argument is
        execute's message)."""
        opts = super().from_params(params, what)
        if not opts.checkpoint:
            raise QstateError(f"{what or cls.COMMAND}: a suite point needs 'checkpoint' (the optimizer "
                              f"checkpoint to check)")
        return opts


def read(path: str, max_gib: float) -> tuple[list[OptimizerStates], FolderSource | None]:
    """The optimizers of a checkpoint; of a training-checkpoint folder (Hugging Face Trainer's
    checkpoint-N/, accelerate's save_state), its optimizer file's, shaped by the model's
    safetensors header beside it, with what was read (folders.py)."""
    p = Path(path)
    if not p.exists():
        raise QstateError(f"{p}: no such checkpoint")
    if p.is_dir() and not (p / ".metadata").is_file():
        src = open_folder(p)
        return find_optimizers(load_checkpoint(src.file, int(max_gib * 2**30)), str(src.file), src.shapes), src
    return find_optimizers(load_checkpoint(p, int(max_gib * 2**30)), str(p)), None


def execute(opts: DoctorOptions, progress: Progress | None = None) -> Result:
    progress = progress or QUIET
    if not opts.checkpoint:
        raise QstateError("doctor needs a CHECKPOINT")
    if opts.max_gib <= 0:
        raise QstateError(f"--max-gib {opts.max_gib}: must be > 0")
    optimizers, src = read(opts.checkpoint, opts.max_gib)
    others, other_src = read(opts.against, opts.max_gib) if opts.against else (None, None)
    meta = {"checkpoint": opts.checkpoint, "against": opts.against}
    sources = source_findings(optimizers, src, "") + source_findings(optimizers, other_src, opts.against, others)
    for key, s in (("checkpoint_file", src), ("against_file", other_src)):
        if s is not None:
            meta[key] = str(s.file)
    result = Result("doctor", meta=meta, extras={"findings": []})
    progress.begin(sum(len(o.params) for o in optimizers), result)
    findings: list[Finding] = []
    partners = pair_optimizers(optimizers, others, opts.checkpoint, opts.against) if others is not None else {}
    if any(a != b for a, b in partners.items()):
        result.meta["paired"] = dict(partners)
    for opt in optimizers:
        found = [f for f in sources if f.optimizer == opt.path] + check_optimizer(opt) + tensor_findings(opt)
        stats: dict[str, dict] = {}
        if others is not None:
            other = next(o for o in others if o.path == partners[opt.path])
            if other.path != opt.path:
                found.append(Finding("info", "paired", opt.path, "all", -1, None,
                                     f"compared with the optimizer at {other.path!r} in {opts.against}: each "
                                     f"checkpoint holds one optimizer, here at {opt.path!r}"))
            more, stats = compare(opt, other, opts.against)
            found += more + against_tensor_findings(opt, other, opts.against)
        findings += found
        for p in opt.params:
            progress.start(f"{opt.path} {p.key}", len(result.records))
            mine = [f for f in found if f.param == p.key]
            record = _record(opts.checkpoint, opt, p, mine, stats.get(p.key))
            result.records.append(record)
            progress.row(record)
    result.extras["findings"] = [f.record() for f in findings]
    result.meta.update(optimizers=[{"optimizer": o.path, "kind": o.kind, "params": len(o.params),
                                    "groups": len(o.groups), "unstepped": len(o.unstepped)} for o in optimizers],
                       summary=summary(result.records, findings))
    return result


def source_findings(optimizers: list[OptimizerStates], src: FolderSource | None, against: str | None,
                    read_there: list[OptimizerStates] | None = None) -> list[Finding]:
    """One `info` finding per optimizer where a checkpoint (or the --against one) was a
    folder: which file in it was read, and what shaped and named its parameters."""
    if src is None:
        return []
    note = src.note(read_there if read_there is not None else optimizers)
    check, where = ("against-source", f"--against {against}: ") if against else ("source", "")
    return [Finding("info", check, o.path, "all", -1, None, where + note) for o in optimizers]


def pair_optimizers(mine: list[OptimizerStates], others: list[OptimizerStates], name: str,
                    other_name: str) -> dict[str, str]:
    """Which optimizer of `other_name` each optimizer of `name` is compared with: the one at
    the same path in the checkpoint (`optimizer`, `optim` (DCP), `optimizer_states.0`, ...);
    where each file holds exactly one optimizer, those two whatever their paths. Otherwise
    one line naming both files' optimizer paths (QstateError)."""
    there = {o.path for o in others}
    if all(o.path in there for o in mine):
        return {o.path: o.path for o in mine}
    if len(mine) == 1 and len(others) == 1:
        return {mine[0].path: others[0].path}
    missing = [o.path for o in mine if o.path not in there]
    raise QstateError(f"{other_name}: holds no optimizer at {', '.join(repr(m) for m in missing)}: {name} holds "
                      f"optimizers at {', '.join(repr(o.path) for o in mine)}, {other_name} at "
                      f"{', '.join(repr(o.path) for o in others)}; --against pairs them by path (or the two "
                      f"when each file holds one)")


def _record(checkpoint: str, opt: OptimizerStates, p, findings: list[Finding], diff: dict | None) -> dict:
    numel = p.numel
    nonfinite = sum(f.count for f in findings if f.check == "nonfinite")
    row = {"checkpoint": checkpoint, "optimizer": opt.path, "kind": opt.kind, "param": p.key, "group": p.group,
           "shape": shape_text(p), "shape_known": p.shape_known, "numel": numel,
           "states": ", ".join(f"{k}={s.storage}" for k, s in p.states.items()),
           "state_bytes": p.nbytes, "bytes_per_param": p.nbytes / numel if numel else None,
           "memory_bytes": p.memory_nbytes, "memory_bytes_per_param": p.memory_nbytes / numel if numel else None,
           "step": p.step,
           "nonfinite": nonfinite, **v_counts(p),
           "errors": sum(f.severity == "error" for f in findings),
           "warnings": sum(f.severity == "warn" for f in findings)}
    if diff is not None:
        row.update(against_differing=diff["differing"], against_max_abs_diff=diff["max_abs_diff"])
    first = next((f for f in findings if f.severity == "error"), None) or next(iter(findings), None)
    row["finding"] = first.message if first else ""
    return row


def shape_text(p) -> str:
    """'512x32' where the shape is known ('' for a 0-dim parameter); else the element count,
    labelled ('16,384 elements': qstate's flat codes without a model state dict in the file)."""
    if p.shape_known:
        return "x".join(map(str, p.shape))
    if not p.numel:
        return "unknown" if p.states else ""  # codes of a format the group does not name
    return f"{p.numel:,} element" + ("" if p.numel == 1 else "s")


def summary(records: list[dict], findings: list[Finding]) -> dict:
    nbytes = sum(r["state_bytes"] for r in records)
    numel = sum(r["numel"] for r in records)
    counted = sum(r["state_bytes"] for r in records if r["numel"])  # not the bytes of states of unknown size
    held = sum(r["memory_bytes"] for r in records if r["numel"])
    return {"params": len(records), "elements": numel, "state_bytes": nbytes,
            "bytes_per_param": counted / numel if numel else None,
            "memory_bytes": sum(r["memory_bytes"] for r in records),
            "memory_bytes_per_param": held / numel if numel else None,
            "errors": sum(f.severity == "error" for f in findings),
            "warnings": sum(f.severity == "warn" for f in findings),
            "v_flushed": sum(r["v_flushed"] for r in records), "nonfinite": sum(r["nonfinite"] for r in records)}


def tensor_findings(opt: OptimizerStates) -> list[Finding]:
    """One `tensor` error per state of `opt` that holds no readable values."""
    return [Finding("error", "tensor", opt.path, p.key, p.group, s.name,
                    f"{s.name} of param {p.key} is {s.unreadable}: its values cannot be checked, and a resume "
                    f"cannot step it (an optimizer keeps dense tensors)", s.numel)
            for p in opt.params for s in p.states.values() if s.unreadable]


def against_tensor_findings(a: OptimizerStates, b: OptimizerStates, name_b: str) -> list[Finding]:
    """One `tensor` error per state of `b` (the --against checkpoint) that holds no
    readable values, for the parameters `a` has too: it is not compared."""
    mine = {p.key: p for p in a.params}
    return [Finding("error", "tensor", a.path, q.key, mine[q.key].group, s.name,
                    f"{s.name} of param {q.key} in {name_b} is {s.unreadable}: not compared", s.numel)
            for q in b.params if q.key in mine for s in q.states.values() if s.unreadable]
