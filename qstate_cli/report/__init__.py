"""Reports from result files: one self-contained HTML file and GitHub-flavoured Markdown.

    write_report(docs, html=Path | None, markdown=Path | None)   # what `qstate report` and
    render_html(docs) -> str                                       # `qstate diagnose --html`
    render_markdown(docs) -> str                                   # call

HTML: jinja2 with autoescape on (every string from a result file is escaped), plots as
base64 PNG data URIs, inline CSS and a Content-Security-Policy that allows nothing but
data: images and the inline style, so the file opens offline and fetches nothing.
Markdown: tables for PR comments, long ones folded in <details>; plots only as links to
PNG files when `plots_dir` is given (a PR comment cannot embed data URIs).
The PNGs' names are qstate's, so each is written as a regular file inside `plots_dir`, and
`plots_dir` must lie inside its own parent folder (atomic.py, "picked" names): a link
planted there never carries a write elsewhere. `picked_in` does the same for the reports
whose names qstate picked (a suite's OUT/report.html, reports/<stem>.md).
"""
from __future__ import annotations

import datetime as _dt
import os
import re
from pathlib import Path

from .. import __version__
from ..atomic import check_inside, write_bytes_atomic
from ..errors import QstateError
from ..kinds import KINDS, load
from ..results import NUMBER_FIELDS, TEXT_FIELDS, load as load_result, write_text_atomic
from .labels import context
from .markdown import markdown_text
from .model import Report, Section, Table

__all__ = ["build_report", "load_documents", "render_html", "render_markdown", "write_report"]

ENV_COLUMNS = [("device", "device"), ("device_name", "device name"), ("cpu_isa", "CPU ISA"), ("cpu_cores", "CPU cores"),
               ("torch", "torch"), ("triton", "triton"), ("python", "python"), ("qstate", "qstate"),
               ("git_sha", "git"), ("created", "created")]


def load_documents(paths) -> tuple[list[dict], list[str]]:
    """Result documents from files and folders (every *.json in a folder, sorted)."""
    docs, sources = [], []
    for p in map(Path, paths):
        files = sorted(f for f in p.glob("*.json") if not f.name.startswith(".")) if p.is_dir() else [p]
        if p.is_dir() and not files:
            raise QstateError(f"{p}: no results files (*.json) in this folder")
        for f in files:
            docs.append(load_result(f))
            sources.append(str(f))
    if not docs:
        raise QstateError("no results given")
    return docs, sources


def _source(doc: dict, i: int) -> str:
    suite = (doc.get("meta") or {}).get("suite") or {}
    if suite.get("file"):
        return f"{suite['file']} (run {suite.get('run')})"
    argv = (doc.get("env") or {}).get("argv")
    return " ".join(map(str, argv)) if argv else f"results #{i + 1}"


def _generic(doc: dict, source: str, palette) -> tuple[Section, list[str]]:
    rows = [r for r in doc["records"] if isinstance(r, dict)]
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if not any(isinstance(r.get(k), (list, dict)) for r in rows)][:14]
    sec = Section(f"{doc.get('kind', 'results')}", str(doc.get("kind")), source,
                  tables=[Table.of("Records", rows, [(k, k) for k in keys])])
    return sec, [f"{doc.get('kind')}: {len(rows)} rows"]


def _as_text(doc: dict) -> dict:
    """The document with each row that did not run holding its suite point's lists (a failed
    point's sizes; older qstate: its configurations) as text, so sections group and sort it as
    a failed row like any other (results.field_problem allows nothing else there)."""
    def flat(row):
        if not isinstance(row, dict) or row.get("status", "ok") == "ok":
            return row
        return {k: ", ".join(map(str, v)) if isinstance(v, list) and k in TEXT_FIELDS + NUMBER_FIELDS else v
                for k, v in row.items()}
    return {k: [flat(r) for r in v] if isinstance(v, list) and k not in ("env", "meta") else v
            for k, v in doc.items()}


def _label(row: dict) -> str | None:
    """The name a row is coloured by: its name, else its config."""
    label = row.get("name") or row.get("config")
    return None if label is None else str(label)


def section_builder(kind: str | None):
    """The report section of `kind` (kinds.py), or a generic table of its records."""
    if kind not in KINDS:
        return _generic
    return load(KINDS[kind].section, f"the report of kind {kind!r}")


def build_report(docs: list[dict], sources: list[str] | None = None, title: str | None = None) -> Report:
    if not docs:
        raise QstateError("no results to report")
    from .plots import Palette

    sources = sources or [_source(d, i) for i, d in enumerate(docs)]
    docs = [_as_text(d) for d in docs]
    names = set()
    for d in docs:
        for key in ("records", "series", "histograms"):
            names |= {_label(r) for r in d.get(key) or [] if isinstance(r, dict)}
    palette = Palette(n for n in names if n is not None)
    env_rows, seen = [], {}
    for d, src in zip(docs, sources):
        env = d.get("env") or {}
        key = tuple(str(env.get(k)) for k, _ in ENV_COLUMNS[:-1])
        if key in seen:
            seen[key]["results"] += f", {d.get('kind')}"
            continue
        seen[key] = {"results": str(d.get("kind")), **{k: env.get(k) for k, _ in ENV_COLUMNS}}
        env_rows.append(seen[key])
    env = Table.of("", env_rows, [("results", "results")] + ENV_COLUMNS)
    banners = list(dict.fromkeys(str(d["meta"]["note"]) for d in docs if (d.get("meta") or {}).get("note")))
    summary, secs = [], []
    for d, src in zip(docs, sources):
        sec, lines = section_builder(d.get("kind"))(d, src, palette)
        sec.notes[:0] = context(d)  # the suite run's descriptions first
        secs.append(sec)
        summary += lines
    _distinct_titles(secs, docs, sources)
    kinds = ", ".join(dict.fromkeys(str(d.get("kind")) for d in docs))
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return Report(title or f"qstate report: {kinds}", created, env, banners, summary, secs)


def _distinct_titles(secs: list[Section], docs: list[dict], sources: list[str]) -> None:
    """Sections of one title (two diagnose runs of a suite) get their suite run's name after
    it; where that does not tell them apart (the same run of two suite folders: q1/memory.json,
    q2/memory.json), the fewest last parts of their files' paths that do (a file given twice:
    #1, #2)."""
    groups: dict[str, list[int]] = {}
    for i, sec in enumerate(secs):
        groups.setdefault(sec.title, []).append(i)
    for same in (g for g in groups.values() if len(g) > 1):
        runs = [_run(docs[i]) for i in same]
        if all(runs) and len(set(runs)) == len(runs):
            labels = runs
        else:
            paths = [Path(str(sources[i]).split(" (run ")[0]).parts or (str(sources[i]),) for i in same]
            distinct = set(paths)
            k = next(k for k in range(1, max(map(len, paths)) + 1) if len({p[-k:] for p in distinct}) == len(distinct))
            labels = [str(Path(*p[-k:])) for p in paths]
            labels = [f"{label} #{labels[:n + 1].count(label)}" if labels.count(label) > 1 else label
                      for n, label in enumerate(labels)]  # one file given twice
        for i, label in zip(same, labels):
            secs[i].title += f" ({label})"


def _run(doc: dict) -> str | None:
    suite = (doc.get("meta") or {}).get("suite")
    run = suite.get("run") if isinstance(suite, dict) else None
    return None if run in (None, "") else str(run)


_NUMERIC = re.compile(r"^[+-]?(\d[\d,]*)(\.\d+)?([eE][+-]?\d+)?%?$|^(nan|inf|-inf|NaN)$")


def _html(report: Report) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.tests["numeric"] = lambda text: bool(_NUMERIC.match(str(text)))
    return env.get_template("report.html.j2").render(report=report, version=__version__)


def render_html(docs: list[dict], sources: list[str] | None = None, title: str | None = None) -> str:
    """The report as one self-contained HTML page (plots embedded, nothing fetched)."""
    return _html(build_report(docs, sources, title))


def render_markdown(docs: list[dict], sources: list[str] | None = None, title: str | None = None) -> str:
    """GitHub-flavoured Markdown: the same tables, long ones in <details>; no images."""
    return markdown_text(build_report(docs, sources, title))


def write_report(docs: list[dict], html=None, markdown=None, *, sources: list[str] | None = None,
                 title: str | None = None, plots_dir=None, picked_in=None) -> list[Path]:
    """Write the HTML and/or Markdown report (atomic writes); `plots_dir` also saves every
    plot as PNG and links them from the Markdown. `picked_in`: the folder in which qstate
    named `html` and `markdown` (a suite's OUT; module docstring). Returns the files written."""
    report, written = build_report(docs, sources, title), []
    if html is not None:
        written.append(write_text_atomic(Path(html), _html(report), picked_in))
    if markdown is not None:
        if plots_dir is not None:
            plots_dir = check_inside(plots_dir, Path(plots_dir).parent)
            plots_dir.mkdir(parents=True, exist_ok=True)
            for sec in report.sections:
                for plot in sec.plots:
                    target, n = plots_dir / f"{plot.name}.png", 2
                    while target in written:
                        target, n = plots_dir / f"{plot.name}-{n}.png", n + 1
                    write_bytes_atomic(target, plot.png(), picked_in=plots_dir.parent)
                    written.append(target)
                    plot.link = os.path.relpath(target.resolve(), Path(markdown).resolve().parent)
        written.append(write_text_atomic(Path(markdown), markdown_text(report), picked_in))
    return written
