"""Read a suite: YAML with line marks, `--set` overrides, validation, normalized runs.

Every problem is reported as `FILE:LINE: KEY: message`: the YAML is composed into
nodes (yaml.SafeLoader, which keeps marks), and the location of a schema error (a path
of keys and indices) is walked down the node tree to the line of the deepest key that
exists (so a missing key points at the mapping that lacks it). A value given with
`--set` is reported as `--set KEY` instead of a line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import QstateError
from ..kinds import KINDS, runnable_kinds
from ..options import option_fields
from . import bounded_yaml
from .kinds import CONFIG_AXES, check_point, is_overridden, options_class
from .expand import Point, check_points, expand_run

RUN_KEYS = ("kind", "axes", "excludes", "baselines")


class SuiteError(QstateError):
    """A suite that does not validate; `issues` holds every `FILE:LINE: KEY: message`."""

    def __init__(self, issues: list[str]):
        self.issues = issues
        more = f" (and {len(issues) - 1} more; see `qstate suite validate`)" if len(issues) > 1 else ""
        super().__init__(issues[0] + more)


@dataclass
class LoadedSuite:
    name: str
    file: str
    description: str
    runs: list[dict]  # {name, kind, description, defaults, axes, excludes, baselines}
    sets: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. parameters not checked

    def points(self) -> list[tuple[dict, list[Point]]]:
        return [(run, expand_run(run)) for run in self.runs]


# -- YAML with marks ------------------------------------------------------------------

def read_yaml(path: Path):
    """(data, root node) of a YAML file; syntax errors and duplicate keys name the line."""
    try:
        if path.stat().st_size > bounded_yaml.MAX_BYTES:
            raise SuiteError([f"{path}: invalid YAML: larger than {bounded_yaml.MAX_BYTES >> 20} MiB; "
                              "a suite is a few KiB"])
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise QstateError(f"{path}: cannot read the suite ({exc})") from None
    loader = None
    try:
        node, loader = bounded_yaml.compose(text)  # limits: bounded_yaml.py
        if node is None:
            raise SuiteError([f"{path}:1: the suite is empty"])
        _check_duplicates(path, node, set())
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise SuiteError([f"{_where(exc, str(path), lambda m: f'{path}:{m.line + 1}')}: invalid YAML: "
                          f"{_problem(exc)}"]) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, node


def _where(exc, default: str, at) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return at(mark) if mark else default


def _problem(exc) -> str:
    return " ".join(str(getattr(exc, "problem", None) or exc).split())


def _check_duplicates(path, node, seen_nodes: set) -> None:
    """Duplicate keys, each node checked once (aliases share nodes; bounded_yaml refused cycles)."""
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise SuiteError([f"{path}:{key.start_mark.line + 1}: {key.value}: duplicate key "
                                      f"(first on line {seen[key.value]})"])
                seen[key.value] = key.start_mark.line + 1
            _check_duplicates(path, value, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicates(path, item, seen_nodes)


def line_of(node, loc: tuple) -> int:
    """1-based line of the deepest node on `loc` (parts that are not keys are skipped)."""
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            hit = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None)
            if hit is None:
                continue
            line, node = hit[0].start_mark.line + 1, hit[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
    return line


def key_name(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("values", "range", "[key]") or "[" in str(part):
            continue  # pydantic's union tags, not keys of the file
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


# -- --set overrides -------------------------------------------------------------------

def apply_sets(data: dict, sets: list[str]) -> dict[tuple, str]:
    """Apply `KEY=VALUE` overrides in place (VALUE is YAML). A dotted KEY is a path in the
    document (`runs.kernels.axes.numel=[4096]`, a run by index or name); a bare KEY sets
    that parameter in the runs that have it (as an axis, which becomes [VALUE], or as a
    default), or in every run when none has it.
    Returns {loc: the --set text} for error reports."""
    where: dict[tuple, str] = {}
    for text in sets:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise QstateError(f"--set {text!r}: use KEY=VALUE (e.g. --set device=cpu)")
        try:
            value = bounded_yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            at = _where(exc, "", lambda m: f" at column {m.column + 1}")
            raise QstateError(f"--set {text!r}: the value is not valid YAML: {_problem(exc)}{at}") from None
        key = key.strip()
        if "." in key:
            where[_set_path(data, key.split("."), value, text)] = text
            continue
        targets = [(("runs", i), r) for i, r in enumerate(data.get("runs") or []) if isinstance(r, dict)]
        targets = targets or [((), data)]
        having = [(p, t) for p, t in targets if key in (t.get("axes") or {}) or key in (t.get("defaults") or {})
                  or key in (data.get("defaults") or {})]
        for prefix, target in having or targets:  # the runs that have KEY, else all of them
            axes = target.get("axes")
            if isinstance(axes, dict) and key in axes:
                axes[key] = value if isinstance(value, list) else [value]
                where[prefix + ("axes", key)] = text
            else:
                target.setdefault("defaults", {})
                if not isinstance(target["defaults"], dict):
                    raise QstateError(f"--set {text!r}: defaults is not a mapping")
                target["defaults"][key] = value
                where[prefix + ("defaults", key)] = text
    return where


def _set_path(data, parts: list[str], value, text: str) -> tuple:
    node, loc = data, []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            index = int(part) if part.isdigit() else next(
                (j for j, r in enumerate(node) if isinstance(r, dict) and r.get("name", r.get("kind")) == part), None)
            if index is None or index >= len(node):
                raise QstateError(f"--set {text!r}: no item {part!r} in {'.'.join(parts[:i]) or 'the suite'}")
            loc.append(index)
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            loc.append(part)
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise QstateError(f"--set {text!r}: {'.'.join(parts[:i])} is not a mapping or list")
    return tuple(loc)


# -- validation and normalization ------------------------------------------------------

def _schema_errors(data) -> tuple[list[tuple[tuple, str]], str | None]:
    """Errors from the pydantic schema, or a basic check where pydantic is not installed."""
    try:
        from . import schema
    except ImportError:
        return _basic_errors(data), "pydantic is not installed: the suite had a basic check only"
    return schema.validate(data), None


def _basic_errors(data) -> list[tuple[tuple, str]]:
    if not isinstance(data, dict):
        return [((), "a suite is a mapping")]
    allowed = {"name", "description", "defaults", "runs", *RUN_KEYS}
    errs = [((k,), "unknown key") for k in data if k not in allowed]
    for i, run in enumerate(data.get("runs") or []):
        if not isinstance(run, dict):
            errs.append((("runs", i), "a run is a mapping"))
            continue
        errs += [(("runs", i, k), "unknown key") for k in run if k not in {"name", "description", "defaults", *RUN_KEYS}]
        if run.get("kind") not in runnable_kinds():
            errs.append((("runs", i, "kind"), f"use one of {', '.join(runnable_kinds())}"))
    if "runs" not in data and data.get("kind") not in runnable_kinds():
        errs.append((("kind",), f"use one of {', '.join(runnable_kinds())}"))
    return errs


def _semantic_errors(data: dict) -> list[tuple[tuple, str]]:
    """What the schema cannot say: a kind or runs, unique run names, exclude keys."""
    errs = []
    if data.get("runs") is None:
        if data.get("kind") is None:
            return [(("kind",), "required key is missing: name the suite's kind "
                               f"({', '.join(runnable_kinds())}) or list its runs")]
        runs = [((), data)]
    else:
        errs += [((key,), f"with `runs:` put {key} inside each run") for key in RUN_KEYS if key in data]
        runs = [(("runs", i), run) for i, run in enumerate(data["runs"])]
    names: dict[str, int] = {}
    for prefix, run in runs:
        name = run.get("name") or run.get("kind")
        if name in names:
            errs.append((prefix + ("name",), f"two runs are named {name!r}; give each run a unique name"))
        names[name] = 1
        axes = run.get("axes") or {}
        for where in ("defaults", "axes"):
            if "baseline" in (run.get(where) or {}):
                errs.append((prefix + (where, "baseline"), "list baselines under `baselines:`"))
        for i, ex in enumerate(run.get("excludes") or []):
            for key in ex:
                if key not in axes and not (key == "baseline" and run.get("baselines")):
                    errs.append((prefix + ("excludes", i, key), f"{key!r} is not an axis of this run "
                                 f"(axes: {', '.join(axes) or 'none'})"))
    return errs


def _param_errors(data: dict, runs: list[tuple[tuple, dict]], notes: list[str]) -> list[tuple[tuple, str]]:
    """Parameters that the kind's options (the command's flags) do not have."""
    errs, top_defaults = [], data.get("defaults") or {}
    for prefix, run in runs:
        kind = run["kind"]
        if is_overridden(kind):
            continue
        try:
            known = {f.name for f in option_fields(options_class(kind))}
        except QstateError:  # an engine this build does not have: say so, check the rest
            notes.append(f"{kind}: parameters not checked (`qstate {KINDS[kind].command}` is not in this build)")
            continue
        known |= set(CONFIG_AXES) | {"baseline"}
        for where, params in ((("defaults",), top_defaults), (prefix + ("defaults",), run.get("defaults") or {}),
                              (prefix + ("axes",), run.get("axes") or {})):
            for key in params:
                if key not in known:
                    errs.append((where + (key,), f"{kind} has no parameter {key!r} "
                                 f"(`qstate {KINDS[kind].command}` options: {', '.join(sorted(known))})"))
    return errs


def _size_errors(data: dict) -> list[tuple[tuple, str]]:
    """Runs with more points than expand.MAX_POINTS (counted before anything is built)."""
    errs = []
    for i, run in enumerate(_normalize(data)):
        try:
            check_points(run)
        except QstateError as exc:
            errs.append(((("runs", i) if data.get("runs") is not None else ()) + ("axes",), str(exc)))
    return errs


def _normalize(data: dict) -> list[dict]:
    top_defaults = {k: v for k, v in (data.get("defaults") or {}).items() if v is not None}
    raw_runs = data["runs"] if data.get("runs") is not None else [data]
    runs = []
    for raw in raw_runs:
        defaults = {**top_defaults, **{k: v for k, v in (raw.get("defaults") or {}).items() if v is not None}}
        name = raw.get("name") if data.get("runs") is not None else None
        runs.append({"name": name or raw["kind"], "kind": raw["kind"],
                     "description": raw.get("description", ""), "defaults": defaults,
                     "axes": dict(raw.get("axes") or {}), "excludes": list(raw.get("excludes") or []),
                     "baselines": list(raw.get("baselines") or [])})
    return runs


def load_suite(path, sets: list[str] | None = None, check_params: bool = True) -> LoadedSuite:
    """Read, override, validate and normalize a suite; SuiteError lists every problem."""
    path = Path(path)
    if not path.is_file():
        raise QstateError(f"{path}: no such suite file")
    data, node = read_yaml(path)
    sets = list(sets or [])
    where = apply_sets(data, sets) if isinstance(data, dict) else {}
    errs, note = _schema_errors(data)
    notes = [note] if note else []
    if not errs:
        errs = _semantic_errors(data)
    if not errs and check_params:
        runs = [(("runs", i), r) for i, r in enumerate(data["runs"])] if data.get("runs") else [((), data)]
        errs = _param_errors(data, runs, notes)
    if not errs:
        errs = _size_errors(data)
    runs = [_resolve_paths(run, path.parent) for run in _normalize(data)] if not errs else []
    if not errs and check_params:
        errs = _point_errors(data, runs)
    if errs:
        raise SuiteError([_issue(path, node, loc, msg, where) for loc, msg in errs])
    return LoadedSuite(name=data.get("name") or path.stem, file=str(path), description=data.get("description", ""),
                       runs=runs, sets=sets, notes=list(dict.fromkeys(notes)))


PATH_PARAMS = ("trace",)  # parameters that name a file: relative to the suite's folder
SPECIAL_PATHS = ("demo",)  # values of those that are names, not paths
CORPUS_PREFIX = "corpus:"  # corpus:NAME names a corpus trace (trace/corpus.py), recorded on first use


def _is_name(value: str) -> bool:
    return value in SPECIAL_PATHS or value.startswith(CORPUS_PREFIX)


def _missing_file(value) -> str | None:
    """Why a trace value names nothing: an unknown corpus name, or a file that does not exist."""
    if not isinstance(value, str) or value in SPECIAL_PATHS:
        return None
    if value.startswith(CORPUS_PREFIX):
        from ..trace import corpus

        try:
            corpus.entry(value[len(CORPUS_PREFIX):])
        except QstateError as exc:
            return str(exc)
        return None
    if not Path(value).expanduser().exists():
        return f"{value}: no such file (a relative path is read from the suite's folder)"
    return None


def _resolve_paths(run: dict, folder: Path) -> dict:
    """Relative file parameters read from the suite file's folder, not the working directory."""
    def resolve(value):
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, str) and not _is_name(value) and not Path(value).expanduser().is_absolute():
            return str(folder / value)
        return value

    for key in PATH_PARAMS:
        if key in run["defaults"]:
            run["defaults"][key] = resolve(run["defaults"][key])
        if isinstance(run["axes"].get(key), list):
            run["axes"][key] = resolve(run["axes"][key])
    return run


def _point_errors(data: dict, runs: list[dict]) -> list[tuple[tuple, str]]:
    """What `run` would refuse at a point, found now: every point's options are checked as
    the run checks them (kinds.check_point: a name, type or range), and a file it names
    must exist. The first problem of each run is reported."""
    errs = []
    for i, run in enumerate(runs):
        prefix = ("runs", i) if data.get("runs") is not None else ()
        if is_overridden(run["kind"]):
            continue
        try:
            options_class(run["kind"])
        except QstateError:
            continue  # said in a note by _param_errors
        for point in expand_run(run):
            where = prefix + (("axes",) if point.assignment else ("defaults",))
            missing = [why for key in PATH_PARAMS for why in [_missing_file(point.params.get(key))] if why]
            if missing:
                errs.append((prefix + ("defaults", PATH_PARAMS[0]) if not point.assignment else where, missing[0]))
                break
            try:
                check_point(run["kind"], point.params, here=False)  # what run checks, the device by name
            except QstateError as exc:
                errs.append((where, f"point {point.label}: {exc}"))
                break
    return errs


def _issue(path, node, loc: tuple, msg: str, where: dict[tuple, str]) -> str:
    for set_loc, text in where.items():
        if tuple(map(str, loc[:len(set_loc)])) == tuple(map(str, set_loc)):
            return f"--set {text}: {key_name(loc)}: {msg}"
    return f"{path}:{line_of(node, loc)}: {key_name(loc)}: {msg}"
