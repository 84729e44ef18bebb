"""Result files: JSON with `schema_version`, an `env` block and flat records.

    {
      "schema_version": 1,
      "kind": "kernels" | "memory" | "diagnose" | "train" | "compare" | ...,
      "env": {device, device_name, cpu_count, cpu_cores, cpu_affinity, cpu_isa, torch, triton, python, qstate,
              git_sha, argv, created, ...},
      "meta": {...free-form settings of the run...},
      "records": [{flat row}, ...]          # pandas.DataFrame(records) just works
    }

Writes are atomic (atomic.py: a temporary file in the same folder, then a rename), so an
interrupted run never leaves a truncated file; `ResultWriter` rewrites the file after
every finished row, which is what makes Ctrl-C keep the rows already measured.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .atomic import atomic_path, check_inside, write_target, writes_in_place
from .errors import QstateError, clip

SCHEMA_VERSION = 1


def device_info(device: str | None = None) -> dict:
    """What ran the numbers: device type and name, and the CUDA build if any."""
    import torch

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)
    info = {"device": dev, "device_name": cpu_name(), "cpu_count": os.cpu_count(), "cpu_cores": cpu_cores(),
            "cpu_affinity": cpu_affinity(),  # the CPUs this process may run on (taskset, cpuset): <= cpu_count
            "torch_threads": torch.get_num_threads(),
            "cpu_isa": capability()}  # torch's CPU kernels' vector ISA: AVX512, AVX2, DEFAULT, ...
    if dev.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(dev))
        info.update(device_name=props.name, cuda=torch.version.cuda,
                    sm_count=props.multi_processor_count,
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
    return info


def cpu_name() -> str:
    """The host CPU's model name (Linux: /proc/cpuinfo's "model name"), else what platform
    says (processor, or the machine type): CPU timings differ by 2x between hosts, so a result
    names the one it ran on."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip() or platform.machine()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores(root: str = "/sys/devices/system/cpu") -> int | None:
    """How many physical cores the host's os.cpu_count() CPUs sit on (Linux: the distinct
    (physical_package_id, core_id) pairs of their sysfs topology), or None where that is not
    readable. Two CPUs that are one core's hyperthreads share its caches and ports: on a
    2-CPU Zen 4 a two-thread replay gained 1.59x on two cores (docs/diagnose.md, "A Zen 4 with
    two cores of its own"), so a two-thread timing names which it had."""
    cores = set()
    for cpu in range(os.cpu_count() or 0):
        ids = []
        for name in ("physical_package_id", "core_id"):
            try:
                with open(f"{root}/cpu{cpu}/topology/{name}", encoding="ascii") as f:
                    ids.append(f.read().strip())
            except OSError:
                return None
        cores.add(tuple(ids))
    return len(cores) or None


def cpu_affinity() -> int | None:
    """How many CPUs this process may run on: len(os.sched_getaffinity(0)) (Linux: taskset,
    a cgroup cpuset), else os.cpu_count() where the platform has no affinity call. Under
    `taskset -c 0` on a 2-CPU host it is 1 where os.cpu_count() still says 2."""
    try:
        return len(os.sched_getaffinity(0)) or None
    except (AttributeError, OSError):
        return os.cpu_count()


def cpus_on_cores(count: int | None, cores: int | None, usable: int | None = None) -> str:
    """"2 CPUs on 2 cores", or "" where either count is unknown (an env block's cpu_count,
    cpu_cores); with `usable` (its cpu_affinity) below count: "1 of 2 CPUs on 2 cores"."""
    if not count or not cores:
        return ""
    of = f"{usable} of " if usable and usable < count else ""
    return f"{of}{count} CPU{'s' * (count != 1)} on {cores} core{'s' * (cores != 1)}"


def env_cpus(env: dict) -> str:
    """The CPUs an env block says the run had, as cpus_on_cores writes them (an older file
    without cpu_affinity: the host's count alone)."""
    return cpus_on_cores(env.get("cpu_count"), env.get("cpu_cores"), env.get("cpu_affinity"))


def host_cpus() -> str:
    """This process's CPUs for a benchmark's header: "2 CPUs on 2 cores", "1 of 2 CPUs on 2
    cores" under taskset, or "2 CPUs" where sysfs does not say which cores they sit on."""
    count, usable = os.cpu_count(), cpu_affinity()
    return cpus_on_cores(count, cpu_cores(), usable) or (f"{usable} of {count} CPUs" if usable and count and
                                                          usable < count else f"{count} CPUs")


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str | None = None) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional on CPU
        triton_version = None
    try:  # installed, from its metadata: importing numba takes seconds (a kernels row's `path` says what ran)
        numba = version("numba")
    except PackageNotFoundError:
        numba = None
    return {
        **device_info(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numba": numba,
        "qstate": __version__,
        "git_sha": git_sha(),
        "argv": list(sys.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def document(kind: str, records: list[dict], meta: dict | None = None, env: dict | None = None) -> dict:
    return {"schema_version": SCHEMA_VERSION, "kind": kind, "env": env or environment(),
            "meta": meta or {}, "records": records}


@dataclass
class Result:
    """What an engine returns: flat records, free-form meta, and the document's other
    top-level entries (`series`, `histograms`, ... : lists of flat rows; `headline`: a
    summary), plus the device that produced them (the env block's device). `document()`
    is the results file (above); the engine neither writes nor prints it."""

    kind: str
    records: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)
    device: str | None = None
    env: dict = field(default_factory=dict)  # what the env block must say beyond environment()

    def document(self, env: dict | None = None) -> dict:
        """The results document (its lists are copies: a writer may append to them)."""
        doc = document(self.kind, list(self.records), self.meta, {**(env or environment(self.device)), **self.env})
        doc.update({k: list(v) if isinstance(v, list) else v for k, v in self.extras.items()})
        return doc

    def parts(self) -> dict:
        """records, the extras and meta: what a suite runner merges point by point (lists)."""
        return {"records": self.records, **self.extras, "meta": self.meta}


def check_writable(path, what: str | None = None, picked_in=None) -> Path:
    """Refuse, before any work, a file path that cannot be written (QstateError, exit 2):
    a folder, a path under a file, or a folder this process cannot create files in (tried
    for real with a temporary file, so it also holds for root and read-only mounts).
    Missing folders on the way are fine: the write creates them. `picked_in`: a name qstate
    picked in that folder, written there as a regular file whatever is at the name
    (atomic.py), so its folder is checked, and must lie inside `picked_in`."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    if picked_in is not None:
        check_inside(path.parent, picked_in)
        if path.is_dir() and not path.is_symlink():
            raise QstateError(f"{label}: is a folder; name a file")
        _check_folder(path.parent, label)
        return path
    if str(path) == "-":  # only a --json that says so prints to stdout (output.Destinations); here it named a file
        raise QstateError(f"{label}: this output is a file, not stdout; name a file")
    if path.is_dir():
        raise QstateError(f"{label}: is a folder; name a file")
    if writes_in_place(path):  # a device or a FIFO: written where it is (atomic_path)
        if not os.access(path, os.W_OK):
            raise QstateError(f"{label}: cannot write (Permission denied)")
        return path
    _check_folder(write_target(path).parent, label)
    return path


def check_folder(path, what: str | None = None) -> Path:
    """Like check_writable, for a folder that files will be written into."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    if path.exists() and not path.is_dir():
        raise QstateError(f"{label}: is a file, not a folder")
    _check_folder(path, label)
    return path


def _check_folder(folder: Path, label: str) -> Path:
    parent = folder
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise QstateError(f"{label}: {parent} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".qstate-probe.", dir=parent)
    except OSError as exc:
        raise QstateError(f"{label}: cannot write in {parent} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    return folder


def write_json_atomic(path, obj, picked_in=None) -> Path:
    """Write JSON to `path` atomically (temp file + rename); `picked_in`: atomic.atomic_path."""
    with atomic_path(path, picked_in) as tmp, open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, default=json_default, allow_nan=True)
        fh.write("\n")
    return Path(path)


def write_text_atomic(path, text: str, picked_in=None) -> Path:
    with atomic_path(path, picked_in) as tmp, open(tmp, "w") as fh:
        fh.write(text)
    return Path(path)


def json_default(obj):
    """What json.dump writes for a value it cannot: a tensor or numpy scalar's number, an
    array's list, anything else (a Path, a dtype) as text."""
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def _unique_keys(path: Path):
    """json's object_pairs_hook for `path`: a key twice in one object is refused (json keeps
    the last of two "records"; a reviewer reads the first)."""
    def hook(pairs: list[tuple]) -> dict:
        out = dict(pairs)
        if len(out) != len(pairs):  # one pass to find the first key seen twice (a count per key was quadratic)
            seen = set()
            key = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise QstateError(f"{path}: not a results file: key {clip(repr(key))} appears twice in one object")
        return out
    return hook


def load(path) -> dict:
    """Load and validate a results file; bad input raises QstateError (exit 2) naming the file:
    not JSON, a key twice in one object, JSON nested too deep or with a number too long to
    read, or a document whose structure or fields (`document_problem`) report and compare
    cannot rely on."""
    path = Path(path)
    if not path.is_file():
        raise QstateError(f"{path}: no such results file")
    try:
        doc = json.loads(path.read_text(), object_pairs_hook=_unique_keys(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QstateError(f"{path}: not a JSON results file ({exc})") from None
    except ValueError:  # an integer past Python's digit limit (int_max_str_digits)
        raise QstateError(f"{path}: not a results file (a number with more digits than JSON readers take)") from None
    except RecursionError:
        raise QstateError(f"{path}: not a results file (JSON nested too deep to read)") from None
    if not isinstance(doc, dict) or "schema_version" not in doc or "records" not in doc:
        raise QstateError(f"{path}: not a qstate results file (no schema_version/records)")
    problem = document_problem(doc)
    if problem:
        raise QstateError(f"{path}: {problem}")
    return doc


def _show(value) -> str:
    """A value for a one-line message: its repr, cut at 40 characters."""
    return clip(repr(value) if not isinstance(value, int) or abs(value) < 10**40
                else f"a {len(str(abs(value)))}-digit number")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_finite_number(v) -> bool:
    """A value a table or plot can show as a number: an int or float (not a bool), finite."""
    return _is_number(v) and math.isfinite(v)


# The fields report and compare read from rows (records and the extra row tables), by what
# each must hold when present (null is always allowed). A malformed one is refused here, as a
# one-line error, rather than crashing a report or passing a gate.
TEXT_FIELDS = ("name", "config", "state", "status", "reason", "model", "optimizer", "path", "device", "device_name",
               "param_dtype", "grad_dtype", "role", "metric", "format", "rounding", "point", "severity", "trace")
NUMBER_FIELDS = ("numel", "n_tensors", "steps", "step", "time_rel_copy", "cpu_share", "gbps", "copy_gbps",
                 "pct_of_copy", "bytes_moved", "ref_copy_ms", "reduction_vs_fp32", "stall_rate_predicted",
                 "code_stall_rate", "stall_rate_predicted_empirical", "gap_to_fp32", "train_loss", "val_loss")
METRIC_FIELDS = ("time_ms", "bytes_per_param", "drift_max_abs", "rel_rms_error", "stall_rate", "update_cosine",
                 "update_rel_error", "final_val_loss", "errors")  # kinds.py's compare metrics: numbers in every row
LIST_FIELDS = ("samples_ms", "round_ms", "rel_copy_rounds", "counts", "edges")  # lists of numbers
FLAG_FIELDS = ("diverged",)  # bool (a count in train's summary)
ROW_TABLES = ("records", "series", "histograms", "per_code", "theory", "summary", "per_tensor", "dim_scaling",
              "findings")


def _point_value(v) -> bool:
    """What a suite point's parameter may be in a row that did not run: text, a number, or
    a list of them (a failed point's sizes; older qstate stored its configurations so)."""
    items = v if isinstance(v, list) else [v]
    return all(isinstance(x, str) or _is_number(x) for x in items)


def field_problem(row: dict, metrics: tuple[str, ...] = METRIC_FIELDS) -> str | None:
    """Why one row's known fields do not have their types (None: they do). A row that did not
    run (status other than ok) may hold its suite point's parameters as they were given."""
    ran = isinstance(row.get("status", "ok"), str) and row.get("status", "ok") == "ok"
    for name in TEXT_FIELDS:
        v = row.get(name)
        if not (v is None or isinstance(v, str) or (not ran and name != "status" and _point_value(v))):
            return f"{name} {_show(v)} is not text"
    for name in NUMBER_FIELDS + metrics:
        v = row.get(name)
        if not (v is None or _is_number(v) or (not ran and name not in metrics and _point_value(v))):
            return f"{name} {_show(v)} is not a number"
    for name in LIST_FIELDS:
        v = row.get(name)
        if not (v is None or (isinstance(v, list) and all(_is_number(x) for x in v))):
            return f"{name} {_show(v)} is not a list of numbers"
    for name in FLAG_FIELDS:
        if not (row.get(name) is None or isinstance(row[name], (bool, int, float))):
            return f"{name} {_show(row[name])} is not true or false"
    return None


def document_problem(doc: dict) -> str | None:
    """What makes `doc` not a results document this qstate reads (None: nothing): the
    structure and the fields every reader relies on (report, compare, `run --resume`) have
    their types: records and the other row tables are lists of mappings, and each row's
    known fields (TEXT_FIELDS, NUMBER_FIELDS, METRIC_FIELDS, LIST_FIELDS, FLAG_FIELDS)
    hold what they must."""
    version = doc.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return f"schema_version {_show(version)}: must be a whole number >= 1"
    if version > SCHEMA_VERSION:
        return (f"schema_version {_show(version)} is newer than this qstate understands ({SCHEMA_VERSION}); "
                "upgrade qstate")
    if not isinstance(doc.get("kind"), str) or not doc["kind"]:
        return f"'kind' {_show(doc.get('kind'))}: must be a name (kernels, memory, diagnose, ...)"
    if not isinstance(doc.get("env"), dict):
        return "no 'env' block (device, versions, argv): not written by qstate, or edited"
    if not isinstance(doc["env"].get("argv", []), (list, type(None))):
        return "env.argv must be a list of arguments"
    if not isinstance(doc.get("meta", {}), dict):
        return "'meta' must be a mapping"
    for key, rows in doc.items():
        if key in ROW_TABLES or (isinstance(rows, list) and key not in ("env", "meta")):
            if key != "records" and rows is None:
                continue
            if not isinstance(rows, list):
                return f"'{key}' must be a list of rows"
            for i, row in enumerate(rows):
                if not isinstance(row, dict):
                    return f"{key}[{i}] is {str(row)[:40]!r}, not a row (a mapping of fields)"
                problem = field_problem(row)
                if problem:
                    label = row.get("name") or row.get("config")
                    return f"{key}[{i}]" + (f" ({label})" if isinstance(label, str) else "") + f": {problem}"
    suite = doc.get("meta", {}).get("suite")
    if suite is not None:
        if not isinstance(suite, dict):
            return "meta.suite must be a mapping"
        points = suite.get("points", {})
        if not isinstance(points, dict) or not all(isinstance(p, dict) and isinstance(p.get("params", {}), dict)
                                                   for p in points.values()):
            return "meta.suite.points must be a mapping of point keys to their label and params"
        for key in ("done", "failed"):
            value = suite.get(key, [])
            if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
                return f"meta.suite.{key} must be a list of point keys, got {str(value)[:40]}"
    return None


def frame(doc: dict):
    """Records as a pandas DataFrame."""
    import pandas as pd

    return pd.DataFrame(doc["records"])


class ResultWriter:
    """Collects rows and rewrites the JSON file atomically after each one; `picked_in`: the
    folder whose file this is, when qstate picked its name (atomic.atomic_path)."""

    def __init__(self, path, kind: str, meta: dict | None = None, env: dict | None = None,
                 records: list[dict] | None = None, picked_in=None):
        self.path = Path(path) if path else None
        self.picked_in = picked_in
        self.doc = document(kind, list(records or []), meta, env)

    @property
    def records(self) -> list[dict]:
        return self.doc["records"]

    def add(self, record: dict) -> None:
        self.records.append(record)
        self.flush()

    def flush(self) -> None:
        if self.path is not None:
            write_json_atomic(self.path, self.doc, self.picked_in)
