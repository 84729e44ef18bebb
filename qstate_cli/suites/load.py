"""Read a suite: YAML with line marks, `--set` overrides, validation, normalized runs.

Every problem is reported as `FILE:LINE: KEY: message`: the YAML is composed into
nodes (yaml.SafeLoader, which keeps marks), and the location of a schema error (a path
of keys and indices) is walked down the node tree to the line of the deepest key that
exists (so a missing key points at the mapping that lacks it). A value given with
`--set` is reported as `--set KEY` instead of a line. A scalar that parses but is no
value (an integer of 100,000 digits, past Python's int conversion limit; a date such as
2024-13-45) raises ValueError, not a YAMLError, while the document is constructed: it is
reported the same way, at the line of that scalar (`unreadable_scalar`).
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import QstateError, clip
from ..kinds import KINDS, runnable_kinds
from ..options import option_fields
from . import bounded_yaml
from .checks import (axis_errors, closest, exclude_value_errors, point_errors, resolve_paths,
                     stem_errors, unknown_key)
from .kinds import CONFIG_AXES, is_overridden, options_class
from .expand import Point, check_points, expand_run

RUN_KEYS = ("kind", "axes", "excludes", "baselines")


class SuiteError(QstateError):
    """A suite that does not validate; `issues` holds every `FILE:LINE: KEY: message`."""

    def __init__(self, issues: list[str], command: str = "qstate suite validate"):
        self.issues = issues
        more = f" (and {len(issues) - 1} more; see `{command}`)" if len(issues) > 1 else ""
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
    node = loader = None
    try:
        node, loader = bounded_yaml.compose(text)  # limits: bounded_yaml.py
        if node is None:
            raise SuiteError([f"{path}:1: the suite is empty"])
        _check_duplicates(path, node, set(), ())
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise SuiteError([f"{_where(exc, str(path), lambda m: f'{path}:{m.line + 1}')}: invalid YAML: "
                          f"{_problem(exc)}"]) from None
    except ValueError as exc:
        line, problem = unreadable_scalar(node, exc)
        raise SuiteError([f"{path}:{line}: invalid YAML: {problem}"]) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, node


def unreadable_scalar(node, exc: ValueError) -> tuple[int, str]:
    """(1-based line, what is wrong) of the first scalar under `node`, in document order,
    that SafeLoader cannot turn into a value (module docstring); each node once (aliases
    share nodes; bounded_yaml limited their number). Line 1 and the error's own words when
    no single scalar is to blame."""
    reader = yaml.SafeLoader("")
    stack, seen = [node], set()
    try:
        while stack:
            n = stack.pop()
            if n is None or id(n) in seen:
                continue
            seen.add(id(n))
            if isinstance(n, yaml.ScalarNode):
                try:
                    reader.construct_object(n)
                except ValueError as bad:
                    return n.start_mark.line + 1, _scalar_problem(n, bad)
            elif isinstance(n, (yaml.SequenceNode, yaml.MappingNode)):
                children = n.value if isinstance(n, yaml.SequenceNode) else [x for pair in n.value for x in pair]
                stack.extend(reversed(children))
    finally:
        reader.dispose()
    return (node.start_mark.line + 1 if node is not None else 1), clip(" ".join(str(exc).split()), 160)


def _scalar_problem(node, exc: ValueError) -> str:
    """What is wrong with a scalar, in words a suite's author can act on (not Python's advice
    to call sys.set_int_max_str_digits)."""
    digits = sum(c.isdigit() for c in node.value)
    if node.tag == "tag:yaml.org,2002:int" and digits > sys.get_int_max_str_digits() > 0:
        return f"a number of {digits:,} digits (at most {sys.get_int_max_str_digits():,}; a suite's numbers are small)"
    return f"{clip(node.value, 40)!r} is not a value: {clip(' '.join(str(exc).split()), 120)}"


def _where(exc, default: str, at) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return at(mark) if mark else default


def _problem(exc) -> str:
    return " ".join(str(getattr(exc, "problem", None) or exc).split())


def _check_duplicates(path, node, seen_nodes: set, loc: tuple) -> None:
    """Duplicate keys, each node checked once (aliases share nodes; bounded_yaml refused cycles),
    named by their whole key (`runs[0].defaults`)."""
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen = {}
        for key, value in node.value:
            here = loc + ((key.value,) if isinstance(key, yaml.ScalarNode) else ("[key]",))
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise SuiteError([f"{path}:{key.start_mark.line + 1}: {key_name(here)}: duplicate key "
                                      f"(first on line {seen[key.value]})"])
                seen[key.value] = key.start_mark.line + 1
            _check_duplicates(path, value, seen_nodes, here)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(path, item, seen_nodes, loc + (i,))


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
        except ValueError as exc:  # a scalar that is no value (module docstring)
            node, loader = bounded_yaml.compose(raw)
            loader.dispose()
            raise QstateError(f"--set {clip(text, 60)!r}: the value is not valid YAML: "
                              f"{unreadable_scalar(node, exc)[1]}") from None
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
    except ImportError as exc:
        return _basic_errors(data), _no_schema(exc)
    return schema.validate(data), None


def _no_schema(exc: ImportError) -> str:
    """Why the pydantic schema could not load: pydantic missing, or one too old for it
    (Discriminator and Tag arrived in pydantic 2.5)."""
    try:
        import pydantic
    except ImportError:
        return "pydantic is not installed: the suite had a basic check only"
    return (f"pydantic {getattr(pydantic, 'VERSION', '?')} cannot load the suite schema ({exc}); it needs "
            f"pydantic >= 2.5: the suite had a basic check only")


def _basic_errors(data) -> list[tuple[tuple, str]]:
    if not isinstance(data, dict):
        return [((), "a suite is a mapping")]
    allowed = {"name", "description", "defaults", "runs", *RUN_KEYS}
    errs = [((k,), unknown_key(k, allowed)) for k in data if k not in allowed]
    for i, run in enumerate(data.get("runs") or []):
        if not isinstance(run, dict):
            errs.append((("runs", i), "a run is a mapping"))
            continue
        run_keys = {"name", "description", "defaults", *RUN_KEYS}
        errs += [(("runs", i, k), unknown_key(k, run_keys)) for k in run if k not in run_keys]
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
                    hint = closest(key, known) or \
                        f" (`qstate {KINDS[kind].command}` options: {', '.join(sorted(known))})"
                    errs.append((where + (key,), f"{kind} has no parameter {key!r}{hint}"))
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
    if path.is_dir():
        raise QstateError(f"{path}: is a folder; name a suite file (e.g. {path / '*.yaml'})")
    if not path.is_file():
        raise QstateError(f"{path}: no such suite file")
    data, node = read_yaml(path)
    sets = list(sets or [])
    where = apply_sets(data, sets) if isinstance(data, dict) else {}
    errs, note = _schema_errors(data)
    notes = [note] if note else []
    if not errs:
        errs = _semantic_errors(data) + stem_errors(data, path) + axis_errors(data)
    if not errs:
        errs = exclude_value_errors(data, where)
    if not errs and check_params:
        runs = [(("runs", i), r) for i, r in enumerate(data["runs"])] if data.get("runs") else [((), data)]
        errs = _param_errors(data, runs, notes)
    if not errs:
        errs = _size_errors(data)
    runs = [resolve_paths(run, path.parent) for run in _normalize(data)] if not errs else []
    if not errs and check_params:
        errs = point_errors(data, runs)
    if errs:
        words = [str(path)] + [w for text in sets for w in ("--set", text)]  # the command that lists them all
        raise SuiteError([_issue(path, node, loc, msg, where) for loc, msg in errs],
                         "qstate suite validate " + " ".join(shlex.quote(w) for w in words))
    return LoadedSuite(name=data.get("name") or path.stem, file=str(path), description=data.get("description", ""),
                       runs=runs, sets=sets, notes=list(dict.fromkeys(notes)))


def _issue(path, node, loc: tuple, msg: str, where: dict[tuple, str]) -> str:
    for set_loc, text in where.items():
        if tuple(map(str, loc[:len(set_loc)])) == tuple(map(str, set_loc)):
            return f"--set {text}: {key_name(loc)}: {msg}"
    return f"{path}:{line_of(node, loc)}: {key_name(loc)}: {msg}"
