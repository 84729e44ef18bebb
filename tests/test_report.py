"""Reports from recorded results: HTML parses, every image is an embedded PNG, user strings
are escaped; Markdown folds long tables; `qstate report` as a command."""
import base64
import copy
import json
import struct
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.report import load_documents, render_html, render_markdown, write_report

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "results"
FIXTURES = [DATA / f"{k}.json" for k in ("kernels", "memory", "diagnose", "train")]
HOSTILE = '<script>alert("x")</script>"><img src=http://evil.example/x.png> | col'
runner = CliRunner()


class Page(HTMLParser):
    """Every tag with its attributes, and the text."""

    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def docs():
    return load_documents(FIXTURES)[0]


@pytest.fixture(scope="module")
def hostile_docs(docs):
    """The fixtures with a configuration named like an attack, in records and series."""
    out = copy.deepcopy(docs)
    for doc in out:
        for key in ("records", "series", "histograms"):
            for row in doc.get(key) or []:
                for field in ("name", "config"):
                    if row.get(field) in ("bred-4bit",):
                        row[field] = HOSTILE
        doc["env"]["device_name"] = "<b>gpu</b>"
    return out


@pytest.fixture(scope="module")
def hostile_html(hostile_docs):
    return render_html(hostile_docs)


def test_html_embeds_every_plot_as_png_and_references_nothing(hostile_html):
    page = parse(hostile_html)
    imgs = [attrs for tag, attrs in page.tags if tag == "img"]
    assert len(imgs) == 8  # kernels sweep, memory, drift, stall, code stall, staleness, predicted/observed, loss
    for attrs in imgs:
        src = attrs["src"]
        assert src.startswith("data:image/png;base64,")
        width, height = png_size(base64.b64decode(src.split(",", 1)[1], validate=True))
        assert width > 300 and height > 200
        assert attrs["alt"]
    for tag, attrs in page.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed", "base")
        for name, value in attrs.items():
            if name in ("src", "href", "action", "srcset"):
                assert value.startswith(("data:", "#")), (tag, name, value)
    csp = [a for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in csp[0]["content"] and "img-src data:" in csp[0]["content"]


def test_html_escapes_user_strings(hostile_html):
    page = parse(hostile_html)
    assert "<script>" not in hostile_html and "<b>gpu</b>" not in hostile_html
    assert "&lt;script&gt;" in hostile_html
    text = "".join(page.text)
    assert HOSTILE in text and "<b>gpu</b>" in text  # shown literally, as text


def test_html_has_every_section_and_the_summary(hostile_html):
    html = hostile_html
    for heading in ("Environment", "Summary", "Kernels: time and roofline", "Memory: optimizer-state bytes",
                    "Diagnose: drift, stalling, staleness", "Training: loss per configuration",
                    "Staleness model", "Recommended reset periods", "Not measured"):
        assert heading in html, heading
    assert "synthetic fixture" in html  # the documents' note is shown as a banner
    assert "CUDA out of memory" in html and "bitsandbytes is not installed" in html
    assert "1.98x the speed of torch fused AdamW" in html


def test_markdown_is_github_flavoured_and_escaped(hostile_docs):
    md = render_markdown(hostile_docs)
    assert md.startswith("## qstate report")
    assert "<details><summary>Size sweep (25 rows)</summary>" in md and md.count("<details>") == md.count("</details>")
    assert "<script>" not in md and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in md
    lines = md.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| config | state |"))
    columns = lines[header].replace("\\|", "").count("|")
    body = lines[header + 2:lines.index("", header)]
    assert any(HOSTILE[:6].replace("<", "&lt;") in row for row in body)
    assert all(row.replace("\\|", "").count("|") == columns for row in body)  # escaped pipes keep the columns
    assert "![" not in md  # no images without plots_dir


def test_write_report_saves_plots_and_links_them(docs, tmp_path):
    written = write_report(docs[:2], tmp_path / "r.html", tmp_path / "md" / "r.md", plots_dir=tmp_path / "md" / "img")
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == 2 and all(png_size(p.read_bytes())[0] > 0 for p in pngs)
    md = (tmp_path / "md" / "r.md").read_text()
    assert "](img/kernels-adamw-fp32-cuda.png)" in md and "](img/memory-gpt2-small.png)" in md


def test_compare_results_render_as_a_verdict_table(tmp_path):
    from qstate_cli.compare import compare_paths

    verdict = compare_paths(DATA / "compare" / "baseline", DATA / "compare" / "new")
    html = render_html([verdict.document()])
    assert "qstate compare: regression (8 regressed, 2 failed" in html and 'class="status-regressed"' in html
    assert "- compare: regression (8 regressed, 2 failed" in render_markdown([verdict.document()])


def test_a_compare_results_file_reports_the_verdict_as_compare_prints_it(tmp_path):
    """`qstate report x.json` of `qstate compare A B --results x.json` said only "compare: 1
    missing, 4 same": no regression heading, the failing row not bold, meta.notes and
    strict_timing dropped, names without their kind (and `@` followed by a word joiner), the
    files as a Python list. Its section is now compare's own Markdown, heading and all."""
    r = runner.invoke(app, ["compare", str(DATA / "compare" / "baseline"), str(DATA / "compare" / "new"),
                            "--strict-timing", "--results", str(tmp_path / "x.json"), "--markdown",
                            str(tmp_path / "v.md")])
    assert r.exit_code == 1, r.output
    own = (tmp_path / "v.md").read_text()
    heading, _, body = own.partition("\n")
    assert heading.startswith("### qstate compare: regression (") and "With --strict-timing" in body
    r = runner.invoke(app, ["report", str(tmp_path / "x.json"), "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "out" / "x.md").read_text()
    assert heading in md.splitlines() and body.strip() in md  # the same heading, notes, files, rule, tables
    assert "| **missing** | `kernels: torch-foreach [torch-foreach] fp32 n=65536 @cuda` |" in md
    assert "- 1 of 22 timing rows could not be judged" in md and "['" not in md and "\u2060" not in md
    assert f"- {heading.removeprefix('### qstate ')}" in md  # the summary line says regression too
    html = (tmp_path / "out" / "x.html").read_text()
    page = "".join(parse(html).text)
    doc = json.loads((tmp_path / "x.json").read_text())
    assert all(note in page for note in doc["meta"]["notes"]) and "With --strict-timing" in page
    assert "Baseline tests/data/results/compare/baseline/diagnose.json, " in page and "['" not in page
    bad = sum(bool(row.get("regression")) for row in doc["records"])
    assert html.count('<tr class="regression">') == 2 * bad  # the changed rows, then all verdicts (folded)
    assert "kernels: torch-foreach [torch-foreach] fp32 n=65536 @cuda" in page


def test_an_ab_compare_file_shows_its_timing_test():
    """An A/B verdict (compare --ab --results) writes no alpha and no rule: its timing test
    is shown as the rule, not the files' rank test it was not judged by."""
    doc = {"schema_version": 1, "kind": "compare", "env": None, "records": [
        {"name": "sr-4bit vs bred-4bit [reference] fp32 n=65536 @cpu", "kind": "kernels", "metric": "time_ms",
         "unit": "ms", "better": "lower", "baseline": 1.0, "new": 1.5, "ratio": 1.5, "status": "regressed",
         "regression": True}],
           "meta": {"baseline": ["bred-4bit"], "new": ["sr-4bit"], "threshold": 1.1, "strict_timing": False,
                    "timing_test": "A/B: one-sided sign test of the 5 paired round ratios", "notes": ["A/B note"]}}
    md = render_markdown([doc])
    assert "### qstate compare: regression (1 regressed)" in md and "- A/B note" in md
    assert "A/B: one-sided sign test of the 5 paired round ratios" in md and "rank test" not in md
    assert "Baseline bred-4bit; new sr-4bit." in md


def test_a_small_ratio_keeps_its_digits():
    """q1 vs q2: a JSON ratio of 0.000384 printed as 0.000 (ratio, raw ratio and noise floor
    were formatted .3f)."""
    from qstate_cli.compare.table import verdict_table

    t = verdict_table([{"status": "noisy", "name": "k", "metric": "time_ms", "baseline": 1004.05, "new": 244.2,
                        "ratio": 0.0003836842, "raw_ratio": 0.2432192937, "noise_floor": 4.5702261755}])
    row = dict(zip(t.headers, t.rows[0]))
    assert (row["ratio"], row["raw ratio"], row["noise floor"]) == ("0.0003837", "0.2432", "4.57")


def test_report_command_writes_both_files_by_default(tmp_path):
    r = runner.invoke(app, ["report", str(DATA / "memory.json"), str(DATA / "train.json"), "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "memory.html").read_text().startswith("<!DOCTYPE html>")
    assert "Training: loss per configuration" in (tmp_path / "memory.md").read_text()
    r = runner.invoke(app, ["report", str(DATA / "memory.json"), "--markdown", str(tmp_path / "only.md"), "--plots"])
    assert r.exit_code == 0 and (tmp_path / "only-plots" / "memory-gpt2-small.png").exists()
    assert not (tmp_path / "only.html").exists()


def test_report_of_bad_input_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    out = subprocess.run([sys.executable, "-m", "qstate_cli", "report", str(bad), "-o", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {bad}: not a JSON results file")
    assert "Traceback" not in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = runner.invoke(app, ["report", str(empty)])
    assert r.exit_code == 2 and "no results files" in r.output


@pytest.mark.parametrize("kind", ["kernels", "memory", "diagnose", "train", "compare", "something-else"])
def test_sparse_documents_still_render(kind):
    """No records, or rows with most fields missing or null, render without plots failing."""
    sparse = [{"name": "a", "config": "a", "status": "ok", "time_ms": None, "numel": None, "state": "v",
               "bytes_per_param": float("nan"), "stall_rate": 0.1, "stall_rate_predicted": None},
              {"name": "b", "status": "failed", "reason": "boom", "extra": {"nested": [1]}}]
    for records in ([], sparse):
        d = {"schema_version": 1, "kind": kind, "env": None, "meta": {}, "records": records,
             "series": [{"config": "a", "state": "v", "step": 1, "drift": None, "stall_rate": float("nan")}]}
        page = parse(render_html([d]))
        assert all(attrs["src"].startswith("data:image/png;base64,") for tag, attrs in page.tags if tag == "img")
        assert render_markdown([d]).startswith("## qstate report")


def test_kernels_plots_leave_out_the_copy_and_draw_one_point_per_size(docs, monkeypatch):
    """The copy rows (no optimizer) made a panel titled 'None: fp32 params, None grads'; a size
    measured more than once was drawn as a vertical line; a 38x slower row read '0.03x'."""
    from qstate_cli.report import plots, sections
    from qstate_cli.report.plots import Palette

    doc = copy.deepcopy(next(d for d in docs if d["kind"] == "kernels"))
    ours = next(r for r in doc["records"] if r.get("path") == "triton" and r.get("status", "ok") == "ok")
    top = max(r["numel"] for r in doc["records"] if r.get("path") == "triton" and r.get("status", "ok") == "ok")
    fused = next(r for r in doc["records"] if r.get("path") == "torch-fused" and r["numel"] == top
                 and r.get("param_dtype") == ours.get("param_dtype"))
    for r in doc["records"]:
        if r.get("path") == "triton" and r["numel"] == top and r.get("status", "ok") == "ok":
            r["time_ms"] = fused["time_ms"] * 38.7  # every one of ours is 38.7x slower at the top size
    again = dict(ours, time_ms=ours["time_ms"] * 3)  # the same name at the same size, measured twice
    copy_row = dict(ours, name="copy", role="copy", optimizer=None, grad_dtype=None, config="copy", path="copy")
    doc["records"] += [again, copy_row]
    drawn = []
    monkeypatch.setattr(plots, "new_figure", _recording_figure(plots.new_figure, drawn))
    sec, lines = sections.kernels(doc, "k.json", Palette(["copy", ours["name"]]))
    assert sec.plots and not any("None" in p.title for p in sec.plots), [p.title for p in sec.plots]
    for p in sec.plots:
        p.png()
    xs = [x for name, x in drawn if name == f"{ours['name']} [triton]"]  # the legend names the path
    assert xs and all(len(x) == len(set(x)) for x in xs)  # one point per size
    assert not any(name == "copy" for name, _ in drawn)
    assert "torch fused AdamW is 38.7x faster" in lines[0] and "0.0" not in lines[0].split("bandwidth")[1]


def _recording_figure(new_figure, drawn):
    def make(*args, **kw):
        fig, axes = new_figure(*args, **kw)
        for ax in axes:
            plot = ax.plot

            def recording(x, y, *a, _plot=plot, **k):
                drawn.append((str(k.get("label", "")).replace(" (baseline)", ""), list(x)))
                return _plot(x, y, *a, **k)
            ax.plot = recording
        return fig, axes
    return make


@pytest.mark.parametrize("kind", ["kernels", "memory", "diagnose", "train"])
def test_failed_rows_render_as_failed_with_their_reason(kind, tmp_path):
    """A failed suite point's row, as older qstate wrote it (its parameters as lists: `config`
    was a list, and the report died on `unhashable type: 'list'`), and as it is written now."""
    old = {"config": ["nearest-4bit", "bf16"], "baseline": [], "numel": [1000, 2000], "seed": 99999999999999999999999,
           "status": "failed", "reason": "OverflowError: Python int too large to convert to C long", "point": "p1"}
    now = {"name": "bf16", "config": "bf16", "numel": "1000, 2000", "status": "failed", "reason": "RuntimeError: boom",
           "point": "p2"}
    ok = json.loads((DATA / f"{kind}.json").read_text())
    ok["records"] += [old, now]
    (tmp_path / "r.json").write_text(json.dumps(ok))
    docs, sources = load_documents([tmp_path / "r.json"])
    md = render_markdown(docs, sources)
    assert "RuntimeError: boom" in md and "nearest-4bit, bf16" in md
    assert "failed" in md
    r = runner.invoke(app, ["report", str(tmp_path / "r.json"), "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "r.html").read_text().startswith("<!DOCTYPE html>")


def test_a_kernels_row_without_a_name_still_reports(tmp_path):
    """A stranger's results file whose rows lack `name` (compare takes it): the summary line
    said KeyError, exit 1."""
    from qstate_cli.cli import app

    doc = {"schema_version": 1, "kind": "kernels", "env": {"device": "cpu"},
           "records": [{"path": "cpu-numba", "optimizer": "adamw", "config": "fp32", "numel": 4096,
                        "time_ms": 0.089, "status": "ok"}]}
    (tmp_path / "k.json").write_text(json.dumps(doc))
    res = CliRunner().invoke(app, ["report", str(tmp_path / "k.json"), "--html", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    assert "the fastest of ours is None (cpu-numba)" in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("name", [r"\[click\](https://evil.example)", r"\\[click\\](x)", "\\![img\\](y)"])
def test_markdown_backslashes_cannot_reopen_a_link(name):
    """A backslash from a file is escaped too: `\\[x\\](url)` with only the brackets escaped
    reads `\\\\[x\\\\](url)`, an escaped backslash before a live link."""
    from markdown_it import MarkdownIt

    from qstate_cli.report.markdown import escape

    page = MarkdownIt("commonmark").render(escape(name))
    assert "<a " not in page and "<img" not in page
    assert "click" in page or "img" in page


def test_html_tables_scroll_in_their_own_box_and_print_folded_rows(hostile_html):
    """Without a browser (test_report_browser.py measures it in one): every table sits in a
    box that scrolls sideways, and print CSS opens what <details> folds; still no script."""
    assert hostile_html.count('<div class="scroll">') == hostile_html.count("<table>") > 0
    assert ".scroll { overflow-x: auto" in hostile_html
    css = hostile_html.split("@media print", 1)[1].split("</style>", 1)[0]
    assert "details::details-content { content-visibility: visible" in css
    assert "<script" not in hostile_html


def test_sections_of_one_run_in_two_folders_get_their_folders(tmp_path):
    """`report cmp.json q1/memory.json q2/memory.json`: both sections were titled "Memory:
    optimizer-state bytes (memory)", the suite run's name they share."""
    doc = json.loads((DATA / "memory.json").read_text())
    doc.setdefault("meta", {})["suite"] = {"name": "quick", "run": "memory"}
    for folder in ("q1", "q2"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "memory.json").write_text(json.dumps(doc))
    docs, sources = load_documents([tmp_path / "q1" / "memory.json", tmp_path / "q2" / "memory.json",
                                    tmp_path / "q1" / "memory.json"])
    titles = [line for line in render_markdown(docs, sources).splitlines() if line.startswith("### ")]
    assert titles == ["### Memory: optimizer-state bytes (q1/memory.json #1)",
                      "### Memory: optimizer-state bytes (q2/memory.json)",
                      "### Memory: optimizer-state bytes (q1/memory.json #2)"]
    other = dict(doc, meta={**doc["meta"], "suite": {"name": "quick", "run": "memory-b"}})
    titles = [s.title for s in __import__("qstate_cli.report", fromlist=["build_report"]).build_report(
        [doc, other], ["a/m.json", "b/m.json"]).sections]
    assert titles == ["Memory: optimizer-state bytes (memory)", "Memory: optimizer-state bytes (memory-b)"]


# The probe's hostile names (a suite description, a run description, tensor names).
FORMATTING = ["*star*_under_ **b** <script>alert(2)</script>", "p|ipe`tick`[x](http://e<dot>com)@bob",
              "Run <b>bold</b> | `code` <!-- comment --> &amp; $\\frac{a}{ $", "~~struck~~ $x$ $$y$$ _it_ __b__",
              "final_val_loss"]


@pytest.mark.parametrize("text", FORMATTING)
def test_markdown_text_cannot_format_the_comment(text):
    """`*`, backticks and `$` from a file rendered as bold, code and (on GitHub) math; `~~` as
    strikethrough, `_x_` as emphasis. Escaped, each reads as it was written."""
    import html as html_lib

    from markdown_it import MarkdownIt

    from qstate_cli.report.markdown import escape

    out = escape(text)
    page = MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(out)
    for tag in ("<em>", "<strong>", "<code>", "<s>", "<a ", "<script", "<b>"):
        assert tag not in page, (tag, out)
    shown = html_lib.unescape(page.removeprefix("<p>").removesuffix("</p>\n")).replace("\u2060", "")
    assert shown == text.replace("\n", " ")
    assert all(out[i - 1] == "\\" for i, c in enumerate(out) if c == "$")  # GitHub math: \$ is a dollar
    assert ("final_val_loss" in out) == ("final_val_loss" in text)  # an `_` inside a word is left alone


def test_a_hostile_suite_description_renders_as_text(docs):
    doc = copy.deepcopy(next(d for d in docs if d["kind"] == "memory"))
    doc["meta"]["suite"] = {"name": "evil", "run": "mem", "description": FORMATTING[0],
                            "run_description": FORMATTING[2]}
    md = render_markdown([doc])
    assert "\\*star\\*\\_under\\_ \\*\\*b\\*\\*" in md and "\\`code\\`" in md and "\\$\\\\frac{a}{ \\$" in md
