"""Which row of the baseline and which row of NEW are the same measurement (`qstate compare`).

A row's identity is its kind's `identity` fields (kinds.py). A suite whose points differ
only in a parameter those fields do not hold (diagnose's `reset` or `trace`, train's
`batch_size`, kernels' `threads`, `rounds` or `copy_numel`; the fp32 run each train point
makes) writes rows that share them, and so do two runs of one suite (suites/diagnose.yaml
replays bf16 in its `configs` run and again in `resets`). Compare then extends the
identity of every row of the kind, on both sides alike, by what tells such rows apart:

1. the suite point's parameters (`meta.suite.points[row.point].params`) and the suite run
   (`meta.suite.run`, shown as `run`): each in which two rows of one side with the same
   identity differ. A row whose point lacks a parameter (or a file written without a suite)
   takes its own field of that name, else its document's `meta` field (a `qstate diagnose
   --reset 20` file: meta.reset), else none;
2. where rows still share an identity, the kind's `distinguish` row fields (diagnose's
   reset_applied and block_size, train's batch_size and lr, ...), the same way;
3. then the file's name (`file`: two plain results files in one folder, matched to the
   files of the same names on the other side).

So the identity of rows that never collide is what the kinds table says (a baseline made
before this matches as it did), and reordering an axis changes nothing. Rows that nothing
tells apart (the same point twice in one file) are refused, exit 2: pairing them by their
order in the files would judge one measurement against another. The added parameters are
part of the row's compare name (`bf16 v reset=20`), and so is each identity field that the
short name leaves out where two rows of the comparison would otherwise print one name
(`bf16 m numel=8192`: `names`): no two rows of a verdict share a name.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import PurePath

from ..errors import QstateError
from ..kinds import KINDS, PATH_PARAMS
from ..report.labels import point_params, show
from .metrics import identity, row_name


class _Row:
    __slots__ = ("row", "doc", "source", "side", "base", "params")

    def __init__(self, row, doc, source, side, kind):
        self.row, self.doc, self.source, self.side = row, doc, source, side
        self.base = identity(kind, row)
        self.params = point_params(doc, row)

    def value(self, key: str, source: str):
        """The row's value of `key` taken from `source`: "params" (its suite point's, else its
        own field, else its document's meta), "row" (its own field), "run" or "file"."""
        meta = self.doc.get("meta") or {}
        if source == "run":
            suite = meta.get("suite")
            return show(suite.get("run")) if isinstance(suite, dict) else None
        if source == "file":
            return PurePath(self.source).name
        if source == "params" and key in self.params:
            value = self.params[key]
            if key in PATH_PARAMS and isinstance(value, str):  # resolved from the suite's folder: the checkout's
                return PurePath(value).name  # own path must not tell one run from the same run elsewhere
            return show(value)
        if key in self.row:
            return show(self.row[key])
        return show(meta.get(key)) if source == "params" and key in meta else None


def _collisions(rows: list[_Row], extras: list[tuple[str, str]]) -> list[list[_Row]]:
    """Groups of rows of one side that share an identity (with `extras`)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r.side, r.base, tuple(r.value(k, src) for k, src in extras))].append(r)
    return [g for g in groups.values() if len(g) > 1]


def _splitting(groups: list[list[_Row]], candidates, extras) -> list[tuple[str, str]]:
    """The candidates (key, source) in which the rows of some group differ."""
    taken = {k for k, _ in extras}
    return [(k, src) for k, src in candidates if k not in taken
            and any(len({r.value(k, src) for r in g}) > 1 for g in groups)]


def keyed_rows(kind: str, sides: dict[str, list[tuple[dict, str]]]) -> tuple[dict, list, dict]:
    """{side: {key: _Row}} for sides {side: [(doc, source), ...]}, the added identity
    parameters as (key, source) pairs (`_Row.value`), for `name` (module docstring), and
    {side: {key: _Row}} of the copy rows of kernels results (no subjects, never judged, and
    left out of the first: keyed only so that a row that is a copy on one side and a
    subject on the other is seen). QstateError when two rows of one side stay the same."""
    rows: list[_Row] = []
    copy_rows: list[_Row] = []
    for side, docs in sides.items():
        for doc, source in docs:
            for row in doc["records"]:
                if not isinstance(row, dict):
                    raise QstateError(f"a {kind} results file has a record that is not a mapping: {str(row)[:60]}")
                (copy_rows if row.get("role") == "copy" else rows).append(_Row(row, doc, source, side, kind))
    extras: list[tuple[str, str]] = []
    groups = _collisions(rows, extras)
    for candidates in (lambda: [(k, "params") for k in sorted({k for g in groups for r in g for k in r.params})]
                       + [("run", "run")],
                       lambda: [(k, "row") for k in KINDS[kind].distinguish],
                       lambda: [("file", "file")]):
        if not groups:
            break
        extras += _splitting(groups, candidates(), extras)
        groups = _collisions(rows, extras)
    if groups:
        g = groups[0]
        files = sorted({r.source for r in g})
        raise QstateError(
            f"{g[0].side} {', '.join(files)}: {len(g)} {kind} rows are each {name(kind, g[0], extras)!r} and nothing "
            f"in them or their suite points tells them apart (the same point run twice?); compare them in "
            f"separate files")
    out: dict[str, dict] = {side: {} for side in sides}
    copies: dict[str, dict] = {side: {} for side in sides}
    for found, group in ((out, rows), (copies, copy_rows)):
        for r in group:
            found[r.side][(r.base, tuple(r.value(k, src) for k, src in extras))] = r
    return out, extras, copies


def name(kind: str, r: _Row, extras) -> str:
    """The row's compare name, with each added parameter that its name does not say already."""
    out = row_name(kind, r.row)
    for key, source in extras:
        v = r.value(key, source)
        if key in KINDS[kind].identity and v == show(r.row.get(key)):
            continue
        out += f" {key}={'-' if v is None else v}"
    return out


def names(kind: str, sides: dict[str, dict], extras) -> dict:
    """{key: compare name} for every key of `sides` (keyed_rows), each name unique in the
    comparison. A row's short name (metrics.row_name) leaves out identity fields: diagnose's
    says `config state`, not `numel` or `steps`, so the 4 traces of a corpus run printed
    `bf16 m` 4 times, two regressed rows had one name and the exit line named 17 rows for 34
    regressions. Where different keys would print one name, each gets the identity fields
    in which they differ (`bf16 m numel=8192`); rows that never share a name keep the short
    one (a benchmark series keeps its name)."""
    rows = {**sides.get("baseline", {}), **sides.get("NEW", {})}  # NEW's row names a key both sides have
    out = {key: name(kind, r, extras) for key, r in rows.items()}
    fields = KINDS[kind].identity
    for shown, keys in _same_name(out).items():
        differ = [i for i, f in enumerate(fields) if len({k[0][i] for k in keys}) > 1]
        for key in keys:
            out[key] = " ".join([shown] + [f"{fields[i]}={key[0][i]}" for i in differ])
    for shown, keys in _same_name(out).items():  # a name that is another row's name and fields: number them
        for i, key in enumerate(sorted(keys, key=str)):
            out[key] = f"{shown} #{i + 1}"
    return out


def _same_name(names_of: dict) -> dict[str, list]:
    groups = defaultdict(list)
    for key, shown in names_of.items():
        groups[shown].append(key)
    return {shown: keys for shown, keys in groups.items() if len(keys) > 1}
