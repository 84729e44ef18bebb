"""Reports tell apart what a suite's axes made (report/labels.py): a configuration run at
points that differ in another parameter is separate lines and a table column, a kernels
name on two paths is two lines; a diagnose section says what it replayed; text from a
results file never reaches matplotlib's mathtext parser."""
import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.report import build_report, plots, render_html, render_markdown
from qstate_cli.report.plots import Palette

DATA = Path(__file__).resolve().parent / "data" / "results"
runner = CliRunner()


def fixture(kind: str) -> dict:
    return json.loads((DATA / f"{kind}.json").read_text())


def as_suite(doc: dict, points: list[tuple[dict, callable]], run: str = "r", **suite) -> dict:
    """`doc` as a suite run: each point (params, edit) gets a copy of every row list, tagged
    with the point and changed by edit(row) (which may drop a row by returning None)."""
    out = {k: v for k, v in doc.items() if not isinstance(v, list)}
    out["meta"] = {**(doc.get("meta") or {}), "suite": {"name": "s", "file": "s.yaml", "run": run, "description": "",
                             "points": {f"p{i}": {"label": str(p), "params": p} for i, (p, _) in enumerate(points)},
                             **suite}}
    for key, rows in doc.items():
        if isinstance(rows, list):
            out[key] = [e for i, (_, edit) in enumerate(points) for r in rows
                        if (e := edit({**copy.deepcopy(r), "point": f"p{i}"})) is not None]
    return out


@pytest.fixture
def drawn(monkeypatch):
    """Every line and histogram the plots draw: (label, x, y)."""
    out = []
    new_figure = plots.new_figure

    def recording_figure(*args, **kw):
        fig, axes = new_figure(*args, **kw)
        for ax in axes:
            for method in ("plot", "stairs"):
                def record(*a, _orig=getattr(ax, method), _m=method, **k):
                    if _m == "plot" and len(a) >= 2:
                        out.append((str(k.get("label")), list(a[0]), list(a[1])))
                    elif _m == "stairs":
                        out.append((str(k.get("label")), list(a[1]), list(a[0])))
                    return _orig(*a, **k)
                setattr(ax, method, record)
        return fig, axes
    monkeypatch.setattr(plots, "new_figure", recording_figure)
    return out


def draw_all(docs):
    report = build_report(docs)
    for sec in report.sections:
        for p in sec.plots:
            p.png()
    return report


def table(report, title):
    t = next(t for sec in report.sections for t in sec.tables if t.title.startswith(title))
    return [dict(zip(t.headers, row)) for row in t.rows]


def _reset_doc(order=("none", 20)):
    """bf16 replayed without resets and with a reset every 20 steps (the user's r1 suite);
    the reset=20 rows drift 10x less."""
    base = fixture("diagnose")

    def only_bf16(scale):
        def edit(r):
            if r.get("config") != "bf16":
                return None
            for k in ("drift", "drift_max_abs"):
                if isinstance(r.get(k), float):
                    r[k] *= scale
            return r
        return edit
    return as_suite(base, [({"trace": "demo", "config": "bf16", "reset": v}, only_bf16(1.0 if v == "none" else 0.1))
                           for v in order])


def test_a_reset_axis_is_two_lines_and_a_table_column(drawn):
    """The drift and stall plots drew reset=none and reset=20 as one zig-zag line labelled
    "bf16", and the summary showed two identical-looking bf16 rows without a reset column."""
    report = draw_all([_reset_doc()])
    labels = {label for label, _, _ in drawn}
    assert {"bf16 reset=none", "bf16 reset=20", "bf16 reset=20 (predicted)"} <= labels
    assert "bf16" not in labels
    lines = [(label, x) for label, x, _ in drawn if label in ("bf16 reset=none", "bf16 reset=20")]
    assert lines and all(len(x) == len(set(x)) for _, x in lines)  # one point per step: no zig-zag
    rows = table(report, "Summary per configuration")
    assert {(r["config"], r["reset"], r["state"]) for r in rows} == {
        ("bf16", "none", "m"), ("bf16", "none", "v"), ("bf16", "20", "m"), ("bf16", "20", "v")}
    summary = report.summary[0]
    assert "best update fidelity bf16 reset=" in summary and "most drift bf16 reset=none" in summary


def test_a_kernels_name_on_two_paths_is_two_lines_at_their_own_times(drawn):
    """`backend: [reference, cpu]` drew one "nearest-4bit" line at the median of the reference
    (120 ms) and cpu-numba (0.09 ms) rows, with no path in the legend."""
    base = fixture("kernels")
    name = next(r["name"] for r in base["records"] if r.get("path") == "triton")

    def on(path, factor):
        def edit(r):
            if r.get("name") != name or r.get("status", "ok") != "ok" or r.get("model"):
                return None
            return {**r, "path": path, "time_ms": r["time_ms"] * factor, "samples_ms": None}
        return edit
    doc = as_suite(base, [({"config": [name], "backend": "reference"}, on("reference", 1000.0)),
                          ({"config": [name], "backend": "cpu"}, on("cpu-numba", 1.0))])
    draw_all([doc])
    times = {}
    for label, x, y in drawn:
        times.setdefault(label, (x, y))
    ref, cpu = f"{name} [reference] backend=reference", f"{name} [cpu-numba] backend=cpu"
    assert ref in times and cpu in times and name not in times
    by_size = {r["numel"]: r["time_ms"] for r in doc["records"] if r["path"] == "cpu-numba"}
    x, y = times[cpu]
    assert y == [by_size[n] for n in x]  # its own times, not a median with the other path's
    assert min(times[ref][1]) > 100 * max(y)


def test_train_tables_show_the_axis_and_a_failed_run_says_failed():
    """Two `bred-4bit seed 0` rows without batch_size, and a run that ran out of memory read
    `diverged: no`."""
    base = fixture("train")

    def failed(r):
        return {k: r.get(k) for k in ("config", "seed", "optimizer", "model", "point")} | {
            "steps": 0, "diverged": False, "status": "failed", "reason": "RuntimeError: can't allocate memory"}
    doc = as_suite(base, [({"config": "bred-4bit", "batch_size": 100000000}, failed),
                          ({"config": "bred-4bit", "batch_size": 4}, lambda r: r)])
    report = build_report([doc])
    rows = table(report, "Runs")
    assert {r["batch_size"] for r in rows} == {"100000000", "4"}
    big = [r for r in rows if r["batch_size"] == "100000000"]
    assert big and all(r["diverged"] == "failed" and r["status"] == "failed" for r in big)
    assert all(r["diverged"] in ("no", "yes") for r in rows if r["batch_size"] == "4")
    assert report.summary[0].endswith("diverged: nearest-4bit batch_size=4")  # the fixture's; a failed run did not


HOSTILE = '<b onmouseover="x">bold</b> & $\\frac{a}{ $'


def test_a_diagnose_section_says_what_it_replayed():
    """No trace name, steps replayed, codec path or the engine's notes: two Diagnose sections
    differed only by file name."""
    def run(name, trace, steps, total, note):
        doc = fixture("diagnose")
        doc["meta"] = {"trace": f"/root/.cache/qstate/{trace.replace(':', '-')}-seed0.pt", "steps": steps,
                       "trace_steps": total, "notes": [note],
                       "codec": {"bf16": {"m": ["cpu-numba", None], "v": ["cpu-numba", None]},
                                 "nearest-4bit": {"m": ["reference", "no fused codec for it"],
                                                  "v": ["cpu-numba", None]}}}
        return as_suite(doc, [({"trace": trace, "config": ["bf16", "nearest-4bit"]}, lambda r: r)], run=name,
                        description=f"suite text {HOSTILE}", run_description=f"run text {name}")
    demo = run("diag", "demo", 40, 2000, f"4 of 4 tensors under 4096 elements {HOSTILE}")
    heavy = run("synth", "corpus:synthetic-heavy", 30, 3000, "another note")
    for d in (demo, heavy):  # the engine's meta lives per point in a suite file
        d["meta"]["suite"]["points"]["p0"]["meta"] = {k: v for k, v in d["meta"].items() if k != "suite"}
    report = build_report([demo, heavy])
    first, second = report.sections
    assert first.title != second.title and first.title.endswith("(diag)") and second.title.endswith("(synth)")
    assert first.notes[:2] == [f"Suite s: suite text {HOSTILE}", "Run diag: run text diag"]
    assert ("Replayed trace demo (demo-seed0.pt), 40 of 2000 steps, codec cpu-numba (bf16 m, bf16 v, "
            "nearest-4bit v), reference (nearest-4bit m: no fused codec for it).") in first.notes
    assert f"Note: 4 of 4 tensors under 4096 elements {HOSTILE}" in first.notes
    assert any(n.startswith("Replayed trace corpus:synthetic-heavy (corpus-synthetic-heavy-seed0.pt), 30 of 3000 "
                            "steps, codec") for n in second.notes)
    html, md = render_html([demo, heavy]), render_markdown([demo, heavy])
    assert "<b onmouseover" not in html and "&lt;b onmouseover=&#34;x&#34;&gt;bold&lt;/b&gt;" in html
    assert "<b onmouseover" not in md and "40 of 2000 steps" in md
    # a file written before run_description: `description` is the run's; no suite: no line
    old = copy.deepcopy(demo)
    del old["meta"]["suite"]["run_description"]
    assert build_report([old]).sections[0].notes[0] == f"Run diag: suite text {HOSTILE}"
    plain = fixture("diagnose")
    plain["meta"] = {"trace": "my.pt", "steps": 5}
    assert build_report([plain]).sections[0].notes == ["Replayed trace my.pt, 5 steps."]


@pytest.mark.parametrize("kind", ["kernels", "memory", "diagnose", "train"])
def test_dollar_signs_from_a_results_file_are_drawn_not_parsed(kind, tmp_path):
    """`cost $\\frac{a}{ $ x` as a row name crashed `qstate report` with matplotlib's mathtext
    ParseSyntaxException (rc 1); so did a diagnose config `b$\\undefinedcmd$`."""
    doc = fixture(kind)
    names = {}
    for key in ("records", "series", "histograms"):
        for r in doc.get(key) or []:
            for field in ("name", "config"):
                if isinstance(r.get(field), str):
                    r[field] = names.setdefault(r[field], ["cost $\\frac{a}{ $ x", "b$\\undefinedcmd$",
                                                           "_hidden $x$", "$$"][len(names) % 4])
            if kind == "kernels":
                r["device_name"] = "$\\gpu{$"
    (tmp_path / "evil.json").write_text(json.dumps(doc))
    r = runner.invoke(app, ["report", str(tmp_path / "evil.json"), "--html", str(tmp_path / "e.html"),
                            "--markdown", str(tmp_path / "e.md"), "--plots"])
    assert r.exit_code == 0, r.output
    from markdown_it import MarkdownIt  # the Markdown shows the name as it was (its backslash escaped)

    assert "cost $\\frac{a}{ $ x" in MarkdownIt("commonmark").enable("table").render((tmp_path / "e.md").read_text())
    assert list(tmp_path.glob("e-plots/*.png"))
    assert plots.plain("cost $\\frac{a}{ $ x") == "cost \\$\\frac{a}{ \\$ x"
    assert plots.plain("_hidden") == " _hidden"  # matplotlib leaves labels starting with _ out of legends


def test_plain_text_is_drawn_as_it_reads(drawn):
    """The legend shows the name with its dollars, once per line."""
    doc = fixture("train")
    for key in ("records", "series"):
        for r in doc[key]:
            if r.get("config") == "bred-4bit":
                r["config"] = "a $b$ c"
    plots.loss_curves(doc["series"], Palette(["a $b$ c"]))
    assert "a \\$b\\$ c" in {label for label, _, _ in drawn}
