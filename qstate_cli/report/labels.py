"""What tells apart the rows of one results document, and what the document measured.

A suite's points differ in their parameters (`meta.suite.points[key].params`). Rows made
at points that differ only in a parameter a row's label does not hold (diagnose's `reset`,
train's `batch_size`, kernels' `threads`) would read as one configuration, so the sections
label them by the parameters that vary between the document's points (`bf16 reset=20`),
draw them as separate lines (same colour, another line style) and show those parameters as
table columns. `skip` names what a section shows already (the configuration, the x axis,
what splits its figures).

`context` says what a document is (its suite's and run's descriptions) and `replay_context` what
a diagnose document replayed (trace, steps, codec path, the engine's notes), as plain
text: the renderers escape it.
"""
from __future__ import annotations

import json
from pathlib import PurePath

from ..results import is_finite_number


def _points(doc: dict) -> dict:
    """meta.suite.points ({} where a file, maybe written by hand, has none)."""
    meta = doc.get("meta")
    suite = meta.get("suite") if isinstance(meta, dict) else None
    points = suite.get("points") if isinstance(suite, dict) else None
    return points if isinstance(points, dict) else {}


def point_part(doc: dict, row: dict, part: str) -> dict | None:
    """`part` ("params" or "meta") of the suite point that made `row`
    (meta.suite.points[row.point]); None where there is no such point or part."""
    key = row.get("point")
    point = _points(doc).get(key) if isinstance(key, str) else None
    value = point.get(part) if isinstance(point, dict) else None
    return value if isinstance(value, dict) else None


def point_params(doc: dict, row: dict) -> dict:
    """The parameters of the suite point that made `row` ({} when none)."""
    return point_part(doc, row, "params") or {}


def show(value) -> str | None:
    """A parameter's value as text, the same for equal values (compare matches rows on it): a
    list of one value is that value (a failed point's record holds it so), lists joined by
    ", ", a whole float as its int (20.0 is 20), None stays None."""
    if isinstance(value, list):
        return show(value[0]) if len(value) == 1 else ", ".join(str(show(v)) for v in value)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (dict, bool)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def varying(doc: dict, skip=()) -> list[str]:
    """The parameters whose values differ between the document's suite points that set them
    (a kernels baseline point has no `rounding`: that is no second value), in the order the
    points name them, less `skip`."""
    params = [p.get("params") for p in _points(doc).values() if isinstance(p, dict)]
    params = [p for p in params if isinstance(p, dict)]
    keys = dict.fromkeys(k for p in params for k in p)
    return [k for k in keys if k not in skip and len({show(p[k]) for p in params if k in p}) > 1]


def variant(doc: dict, row: dict, keys) -> str:
    """`key=value ...` of those `keys` the row's point sets ("" without any)."""
    params = point_params(doc, row)
    return " ".join(f"{k}={show(params[k])}" for k in keys if k in params)


def with_axes(rows: list[dict], doc: dict, keys) -> list[dict]:
    """Copies of `rows` with `variant` (the text above) and `axis:KEY` fields for the table
    columns `axis_columns(keys)`."""
    out = []
    for r in rows:
        params = point_params(doc, r)
        out.append({**r, "variant": variant(doc, r, keys), **{f"axis:{k}": show(params.get(k)) for k in keys}})
    return out


def axis_columns(keys) -> list[tuple]:
    return [(f"axis:{k}", k) for k in keys]


def label(base, row: dict) -> str:
    """`base` with the row's variant, if any."""
    v = row.get("variant")
    return f"{base} {v}" if v else str(base)


def context(doc: dict) -> list[str]:
    """The suite's and the run's descriptions, one line each, where meta.suite has them:
    `run_description` beside `description` (the suite's), or in files written before that,
    `description` alone (the run's); any other non-empty text under a key naming a
    description, labelled by its key."""
    suite = (doc.get("meta") or {}).get("suite")
    if not isinstance(suite, dict):
        return []
    name, run = show(suite.get("name")), show(suite.get("run"))
    out = []
    for key, value in suite.items():
        if "description" not in str(key).lower() or not isinstance(value, str) or not value.strip():
            continue
        if key == "description" and "run_description" in suite:
            what = f"Suite {name}" if name else "Suite"
        elif key in ("description", "run_description"):
            what = f"Run {run}" if run else "Run"
        else:
            what = str(key).replace("_", " ").capitalize()
        out.append(f"{what}: {' '.join(value.split())}")
    return out


def _n(v) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _replay(params_trace, meta: dict) -> str | None:
    trace = meta.get("trace")
    name = show(params_trace) or (PurePath(str(trace)).name if trace else None)
    if name is None:
        return None
    text = f"trace {name}"
    if trace and PurePath(str(trace)).name not in (name, str(trace)):
        text += f" ({PurePath(str(trace)).name})"
    steps, total = meta.get("steps"), meta.get("trace_steps")
    if is_finite_number(steps):
        text += f", {_n(steps)} of {_n(total)} steps" if is_finite_number(total) else f", {_n(steps)} steps"
        start = meta.get("step_start")
        if is_finite_number(start) and start != 1:
            text += f" from step {_n(start)}"
    if is_finite_number(meta.get("ranks")) and meta["ranks"] > 1:
        text += f" on {_n(meta['ranks'])} ranks"
    return text


def _codec(metas: list[dict]) -> str | None:
    """'codec cpu-numba' or 'codec cpu-numba (bf16), reference (nearest-4bit m: why)'."""
    paths: dict[tuple, list[str]] = {}
    for meta in metas:
        codec = meta.get("codec")
        if not isinstance(codec, dict):
            continue
        for config, states in codec.items():
            for state, entry in (states.items() if isinstance(states, dict) else ()):
                if isinstance(entry, list) and entry:
                    key = (str(entry[0]), str(entry[1]) if len(entry) > 1 and entry[1] else None)
                    paths.setdefault(key, [])
                    if f"{config} {state}" not in paths[key]:
                        paths[key].append(f"{config} {state}")
    if not paths:
        return None
    if len(paths) == 1:
        (path, why), = paths
        return f"codec {path}" + (f" ({why})" if why else "")
    return "codec " + ", ".join(f"{path} ({', '.join(cfgs)}{': ' + why if why else ''})"
                                for (path, why), cfgs in paths.items())


def replay_context(doc: dict) -> list[str]:
    """What a diagnose document replayed, from its meta (or its suite points' meta, where
    that differs between points): one line of trace, steps and codec path, then the
    engine's notes."""
    meta = doc.get("meta") or {}
    points = [p for p in _points(doc).values() if isinstance(p, dict) and isinstance(p.get("meta"), dict)]
    metas = [p["meta"] for p in points] or [meta]
    traces = [(p.get("params") or {}).get("trace") if isinstance(p.get("params"), dict) else None for p in points]
    replays = list(dict.fromkeys(filter(None, (_replay(t, m) for t, m in zip(traces or [None], metas)))))
    parts = ["Replayed " + "; ".join(replays)] if replays else []
    codec = _codec(metas)
    if codec:
        parts.append(codec)
    out = [", ".join(parts) + "."] if parts else []
    notes = [n for m in [meta] + metas for n in (m.get("notes") if isinstance(m.get("notes"), list) else [])]
    out += [f"Note: {n}" for n in dict.fromkeys(str(n) for n in notes)]
    return out
