"""Suite checks that need more than the schema: names, file parameters, exclude values, and
where a point's bad value was written (load.py calls them; nothing here imports pydantic).

Every check returns `[(loc, message)]`, `loc` a path of keys and indices in the suite
document (load.py turns it into `FILE:LINE: KEY` or `--set TEXT: KEY`).

- `name_problem`: the rule for a suite's or a run's name (it names a folder and files),
  also applied to a name taken from the file's stem (`...yaml` would write into `results/..`).
- `exclude_value_errors`: an exclude value that no point could have (`{config: bf61}` when
  the axis is [fp32, bf16]) is a misspelling, not an exclude; the closest values are named.
- `point_errors`: what `run` would refuse at a point, reported at the parameter's own place
  (`defaults.lr`, `axes.dtype[1]`, `baselines[0]`, or the `--set` that gave it).
"""
from __future__ import annotations

import difflib
import math
import re
from pathlib import Path

from ..errors import QstateError, clip
from ..kinds import KINDS, PATH_PARAMS
from ..options import flags_of, option_fields
from .expand import Point, axis_values, expand_run
from .kinds import check_point, is_overridden, options_class

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # a suite or run name: it names a folder and files
MAX_NAME = 80

SPECIAL_PATHS = ("demo",)  # values of those that are names, not paths
CORPUS_PREFIX = "corpus:"  # corpus:NAME names a corpus trace (trace/corpus.py), recorded on first use


def closest(word, choices, n: int = 3) -> str:
    """`; did you mean A, B?` for the choices close to `word`, else ''."""
    texts = {str(c): c for c in choices}
    close = difflib.get_close_matches(str(word), list(texts), n=n, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(str(word).lower(), [t.lower() for t in texts], n=n, cutoff=0.6)
        close = [next(t for t in texts if t.lower() == c) for c in close]
    return f"; did you mean {', '.join(close)}?" if close else ""


def unknown_key(key, allowed) -> str:
    """The message of a key a mapping does not take, with the closest allowed ones."""
    hint = closest(key, allowed)
    return f"unknown key{hint}" if hint else f"unknown key (use {', '.join(sorted(allowed))})"


def name_problem(name) -> str | None:
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name) or len(name) > MAX_NAME:
        return (f"{clip(str(name))!r} cannot name the results folder: use letters, digits, _ . and -, starting "
                f"with a letter or digit, at most {MAX_NAME} characters")
    return None


def stem_errors(data, path: Path) -> list[tuple[tuple, str]]:
    """A suite without `name:` is named by its file's stem: the same rule as a `name:`."""
    if not isinstance(data, dict) or data.get("name") is not None:
        return []
    problem = name_problem(path.stem)
    return [(("name",), f"the file name gives the suite name {problem}; add a `name:` key")] if problem else []


# -- file parameters ---------------------------------------------------------------------

def is_name(value: str) -> bool:
    return value in SPECIAL_PATHS or value.startswith(CORPUS_PREFIX)


def missing_file(value) -> str | None:
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
        hint = closest(Path(value).name, SPECIAL_PATHS)
        return f"{value}: no such file (a relative path is read from the suite's folder){hint}"
    return None


def resolve_paths(run: dict, folder: Path) -> dict:
    """Relative file parameters read from the suite file's folder, not the working directory."""
    def resolve(value):
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, str) and not is_name(value) and not Path(value).expanduser().is_absolute():
            return str(folder / value)
        return value

    for key in PATH_PARAMS:
        if key in run["defaults"]:
            run["defaults"][key] = resolve(run["defaults"][key])
        if isinstance(run["axes"].get(key), list):
            run["axes"][key] = resolve(run["axes"][key])
        run["excludes"] = [{**ex, key: resolve(ex[key])} if key in ex else ex for ex in run["excludes"]]
    return run


# -- excludes ----------------------------------------------------------------------------

def _set_covers(loc: tuple, where: dict) -> bool:
    """Whether a --set replaced `loc` or a mapping above it (its values are not the file's)."""
    text = tuple(map(str, loc))
    return any(text[:len(s)] == tuple(map(str, s)) for s in where)


def _shown(values: list) -> str:
    head = ", ".join(map(str, values[:8]))
    return head + (f", ... ({len(values)} values)" if len(values) > 8 else "")


def exclude_value_errors(data: dict, where: dict) -> list[tuple[tuple, str]]:
    """Exclude values that match no value of their axis (or no baseline): a misspelt exclude
    silently drops nothing. An axis a --set replaced is not checked (`--set numel=65536`
    leaves the file's excludes of other sizes matching nothing, as intended)."""
    errs = []
    runs = [(("runs", i), r) for i, r in enumerate(data["runs"])] if data.get("runs") is not None else [((), data)]
    for prefix, run in runs:
        axes = run.get("axes") if isinstance(run.get("axes"), dict) else {}
        excludes = run.get("excludes") if isinstance(run.get("excludes"), list) else []
        for i, ex in enumerate(excludes):
            for key, want in ex.items() if isinstance(ex, dict) else ():
                if key == "baseline":
                    have, src = list(run.get("baselines") or []), prefix + ("baselines",)
                elif key in axes:
                    try:
                        have, src = axis_values(axes[key]), prefix + ("axes", key)
                    except QstateError:
                        continue  # a bad range: said by the schema or the size check
                else:
                    continue  # not an axis: said by load._semantic_errors
                if _set_covers(src, where) or _set_covers(prefix + ("excludes",), where):
                    continue
                for value in want if isinstance(want, list) else [want]:
                    if value not in have:
                        what = "the baselines" if key == "baseline" else f"axis {key}"
                        shown = repr(clip(value)) if isinstance(value, str) else clip(str(value))
                        hint = closest(value, [v for v in have if isinstance(v, str)]) if isinstance(value, str) else ""
                        errs.append((prefix + ("excludes", i, key), f"{shown} is not a value of {what} "
                                     f"({_shown(have)}), so this exclude matches nothing{hint}"))
                        break
    return errs


AXIS_SHAPE = "an axis is a list of values or a range {start, stop, step | factor}"


def axis_errors(data: dict) -> list[tuple[tuple, str]]:
    """Axes and baselines the schema refuses, found where it did not run (no pydantic: the
    basic check let `numel: []` run 0 points, a range with both step and factor ignore its
    factor, and `baselines: torch-fused` read as seven baselines 't', 'o', ...); with the
    schema, what it leaves: non-finite range bounds."""
    errs = []
    runs = [(("runs", i), r) for i, r in enumerate(data["runs"])] if data.get("runs") is not None else [((), data)]
    for prefix, run in ([((), data)] if data.get("runs") is not None else []) + runs:
        if not isinstance(run, dict):
            continue
        baselines = run.get("baselines")
        if baselines is not None and not (isinstance(baselines, list) and all(isinstance(b, str) for b in baselines)):
            errs.append((prefix + ("baselines",), "a list of baseline names (baselines: [torch-fused])"))
        axes = run.get("axes")
        if axes is not None and not isinstance(axes, dict):
            errs.append((prefix + ("axes",), "a mapping of parameter names to axes"))
            continue
        for name, spec in (axes or {}).items():
            problem = _axis_problem(spec)
            if problem:
                errs.append((prefix + ("axes", name) + problem[0], problem[1]))
    return errs


def _axis_problem(spec) -> tuple[tuple, str] | None:
    """(where in the axis, what) for an axis the schema (schema.AxisRange) refuses."""
    if isinstance(spec, list):
        return None if spec else ((), "an axis needs at least one value")
    if not isinstance(spec, dict):
        return (), AXIS_SHAPE
    extra = [k for k in spec if k not in ("start", "stop", "step", "factor")]
    if extra:
        return (extra[0],), unknown_key(extra[0], {"start", "stop", "step", "factor"})
    for key in ("start", "stop", "step", "factor"):
        value = spec.get(key)
        if value is None and key in ("start", "stop"):
            return (), f"a range needs {key}"
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return (key,), f"must be a number (got {value!r})"
        if isinstance(value, float) and not math.isfinite(value):
            return (key,), f"must be a finite number (got {value})"
    step, factor = spec.get("step"), spec.get("factor")
    if (step is None) == (factor is None):
        return (), "give exactly one of step or factor"
    if step is not None and step <= 0:
        return ("step",), "must be > 0"
    if factor is not None and factor <= 1:
        return ("factor",), "must be > 1"
    if spec["stop"] < spec["start"]:
        return (), f"stop ({spec['stop']}) is below start ({spec['start']})"
    if factor is not None and spec["start"] <= 0:
        return (), "a geometric range (factor) needs start > 0"
    return None


# -- point values ------------------------------------------------------------------------

def point_errors(data: dict, runs: list[dict]) -> list[tuple[tuple, str]]:
    """What `run` would refuse at a point, found now: every point's options are checked as
    the run checks them (kinds.check_point: a name, type or range), and a file it names
    must exist. The first problem of each run is reported, at the place its value was
    written (`_locate`)."""
    errs = []
    for i, run in enumerate(runs):
        prefix = ("runs", i) if data.get("runs") is not None else ()
        raw = data["runs"][i] if data.get("runs") is not None else data
        if is_overridden(run["kind"]):
            continue
        try:
            cls = options_class(run["kind"])
        except QstateError:
            continue  # said in a note by load._param_errors
        for point in expand_run(run):
            missing = [(key, why) for key in PATH_PARAMS for why in [missing_file(point.params.get(key))] if why]
            if missing:
                errs.append((_locate(data, raw, prefix, run, point, missing[0][0]), missing[0][1]))
                break
            try:
                check_point(run["kind"], point.params, here=False)  # what run checks, the device by name
            except QstateError as exc:
                key, alone = _culprit(cls, point.params, exc)
                loc = _locate(data, raw, prefix, run, point, key) if key else \
                    prefix + (("axes",) if point.assignment else ("defaults",))
                alone = alone or not point.assignment  # no axes: the point is the defaults, its key says so
                errs.append((loc, str(exc) if alone else f"point {point.label}: {exc}"))
                break
    return errs


def _culprit(cls, params: dict, exc: QstateError) -> tuple[str | None, bool]:
    """The parameter a point's error is about, and whether its value is wrong by itself:
    the first whose value alone does not parse; else the one whose flag the message names;
    else the one without which the point passes; else (None, False)."""
    for key, value in params.items():
        try:
            cls.from_params({key: value})
        except QstateError:
            return key, True
        except Exception:  # noqa: BLE001 - a field that needs others: not decided here
            continue
    fields = {f.name: f for f in option_fields(cls)}
    text = str(exc)
    for key in params:
        f = fields.get(str(key).replace("-", "_"))
        if f is not None and any(re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) for flag in flags_of(f)):
            return key, False
    for key in params:
        try:
            cls.from_params({k: v for k, v in params.items() if k != key}).check(False)
        except Exception:  # noqa: BLE001 - still refused (or refused otherwise): not this one
            continue
        return key, False
    return None, False


def _same_path(resolved, written: str) -> bool:
    """Whether `resolved` (a path the suite's folder was joined to) is `written`: its last
    components are written's (`at.pt` is not `t.pt`)."""
    parts = Path(written).parts
    return bool(parts) and Path(str(resolved)).parts[-len(parts):] == parts


def _locate(data: dict, raw: dict, prefix: tuple, run: dict, point: Point, key: str) -> tuple:
    """Where the value of parameter `key` at `point` was written: its axis (and the index of
    the value in a listed axis), the baseline, the run's defaults or the suite's."""
    if key == KINDS[run["kind"]].baseline_param and "baseline" in point.assignment:
        baselines = list(raw.get("baselines") or [])
        value = point.assignment["baseline"]
        return prefix + ("baselines",) + ((baselines.index(value),) if value in baselines else ())
    if key in point.assignment:
        spec = (raw.get("axes") or {}).get(key)
        value = point.assignment[key]
        if isinstance(spec, list):
            index = next((j for j, v in enumerate(spec) if v == value
                          or (key in PATH_PARAMS and isinstance(v, str) and _same_path(value, v))), None)
            if index is not None:
                return prefix + ("axes", key, index)
        return prefix + ("axes", key)
    own = raw.get("defaults") if isinstance(raw.get("defaults"), dict) else {}
    top = data.get("defaults") if isinstance(data.get("defaults"), dict) else {}
    if own.get(key) is None and top.get(key) is not None:
        return ("defaults", key)  # the suite's defaults (a run's null keeps them)
    return prefix + ("defaults", key)
