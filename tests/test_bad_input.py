"""Every case of the bad-input catalogue (tests/bad_inputs.py) through the real CLI:
exit code 2, exactly one line on stderr, no traceback, the expected message, and no side
effect (the case's folder byte for byte as it was). Every case runs in-process through
CliRunner; one case of each class also runs as a real subprocess (`python -m qstate_cli`,
~10 s each on this machine, so not all of them)."""
from __future__ import annotations

import re
import signal

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app

from bad_inputs import CASES, snapshot, run_subprocess

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

BY_ID = {c.id: c for c in CASES}
ONE_PER_GROUP = list({c.group: c.id for c in reversed(CASES)}.values())


def _check(case, code: int, stderr: str, before: dict, after: dict) -> None:
    no_schema = "note: pydantic is not installed: the suite had a basic check only"  # the GPU machine's note
    lines = [line for line in stderr.strip().splitlines() if line != no_schema]
    assert code == 2, f"{case.id}: exit {code}\n{stderr}"
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, f"{case.id}: {len(lines)} lines on stderr:\n{stderr}"
    assert re.search(case.message, lines[0]), f"{case.id}: {lines[0]!r} does not match {case.message!r}"
    assert lines[0].startswith("error: ") or re.match(r"\S+:\d*:? ", lines[0]), lines[0]  # suite: FILE:LINE
    assert after == before, f"{case.id}: files changed: {set(after) ^ set(before) or 'contents'}"


@pytest.fixture
def alarm():
    """A case that hangs fails instead of stalling the suite."""
    def fire(*_):
        raise TimeoutError("the case ran past 120 s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("case_id", list(BY_ID))
def test_bad_input_in_process(case_id, tmp_path, monkeypatch, alarm):
    case = BY_ID[case_id]
    argv = case.make(tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, argv, env={"COLUMNS": "200", **case.env})
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    _check(case, r.exit_code, r.stderr, before, snapshot(tmp_path))


@pytest.mark.parametrize("case_id", ONE_PER_GROUP)
def test_bad_input_subprocess(case_id, tmp_path):
    case = BY_ID[case_id]
    argv = case.make(tmp_path)
    before = snapshot(tmp_path)
    r = run_subprocess(argv, tmp_path, case.env)
    _check(case, r.returncode, r.stderr, before, snapshot(tmp_path))
    assert r.stdout == "", r.stdout


def test_catalogue_covers_each_class_with_distinct_ids():
    assert len(BY_ID) == len(CASES)
    assert len(ONE_PER_GROUP) == len({c.group for c in CASES})


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_atomic_writes_respect_the_umask(mask, tmp_path):
    """mkstemp makes 0600 files; a results file gets 0666 less the umask, as open() would."""
    import os

    from qstate_cli.results import write_json_atomic, write_text_atomic

    old = os.umask(mask)
    try:
        write_json_atomic(tmp_path / "a.json", {"x": 1})
        write_text_atomic(tmp_path / "sub" / "b.md", "x")
        (tmp_path / "plain").write_text("x")
    finally:
        os.umask(old)
    want = (tmp_path / "plain").stat().st_mode & 0o777
    assert want == 0o666 & ~mask
    for p in (tmp_path / "a.json", tmp_path / "sub" / "b.md"):
        assert p.stat().st_mode & 0o777 == want, oct(p.stat().st_mode)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.json", "b.md", "plain", "sub"]  # no temp file left


def test_trace_checksums_round_trip_and_old_traces_still_load(tmp_path):
    """save_trace records one sha256 per tensor and load_trace verifies it; a trace written
    before checksums existed (no 'sha256') loads unverified; one flipped byte is refused."""
    import torch

    from bad_inputs import _flip_tensor_bytes, small_trace
    from qstate_cli.errors import QstateError
    from qstate_cli.trace import load_trace, save_trace

    trace = small_trace()
    path = save_trace(trace, tmp_path / "t.pt")
    back = load_trace(path)
    for a, b in zip(trace.tensors, back.tensors):
        assert torch.equal(a.grads, b.grads) and torch.equal(a.blocks, b.blocks)
    raw = torch.load(path, weights_only=True)
    assert all(len(t["sha256"]) == 64 for t in raw["tensors"])
    for t in raw["tensors"]:
        del t["sha256"]
    torch.save(raw, tmp_path / "old.pt")
    assert load_trace(tmp_path / "old.pt").n_steps == trace.n_steps
    (tmp_path / "bad.pt").write_bytes(_flip_tensor_bytes(path.read_bytes()))
    with pytest.raises(QstateError, match="does not match its sha256"):
        load_trace(tmp_path / "bad.pt")


HOSTILE_NAME = "![x](http://evil.example/p.png) [click](https://evil.example) @octocat www.evil.example <b>"


@pytest.mark.parametrize("command", ["report", "compare"])
def test_markdown_from_hostile_names_makes_no_image_link_or_mention(command, tmp_path):
    """Run names and labels go to PR comments: no image, link, autolink or @mention survives."""
    import json

    from bad_inputs import RESULTS

    doc = json.loads((RESULTS / "memory.json").read_text())
    for row in doc["records"]:
        row["name"] = HOSTILE_NAME
    doc["meta"]["suite"] = {"run": HOSTILE_NAME, "file": HOSTILE_NAME}
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(doc))
    md = tmp_path / "out.md"
    args = (["report", str(path), "--markdown", str(md)] if command == "report"
            else ["compare", str(path), str(path), "--markdown", str(md)])
    r = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    text = md.read_text()
    assert "octocat" in text and "evil.example" in text  # the text is kept, readable
    if command == "compare":  # its row names are code spans: literal, grep-able, never a link or a mention
        import html

        from markdown_it import MarkdownIt

        page = MarkdownIt("commonmark").enable("table").render(text)
        # the 5 rows now share a name: each adds the identity field that differs (compare/identity.names)
        assert f"<code>memory: {html.escape(HOSTILE_NAME, quote=False)} gpt2-small config=m=fp32,v=fp32</code>" in page
        assert "<a " not in page and "<img" not in page and "<b>" not in page
        text = re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", text)  # what GitHub reads outside the code spans
        assert "memory:" not in text
    assert not re.search(r"(?<!\\)\]\(http", text) and not re.search(r"(?<!\\)\[click", text)  # no [x](url)
    for live in ("@octocat", "http://", "https://", "www.evil", "<b>"):
        assert live not in text, live


def test_suite_trace_paths_are_read_from_the_suite_folder(tmp_path, monkeypatch):
    """A relative trace path in a suite names a file next to the suite, wherever qstate runs."""
    from bad_inputs import small_trace
    from qstate_cli.suites import load_suite
    from qstate_cli.trace import save_trace

    (tmp_path / "suites").mkdir()
    save_trace(small_trace(), tmp_path / "suites" / "t.pt")
    suite = tmp_path / "suites" / "s.yaml"
    suite.write_text("kind: diagnose\ndefaults: {trace: t.pt, config: [bf16]}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_suite(suite)
    assert loaded.runs[0]["defaults"]["trace"] == str(tmp_path / "suites" / "t.pt")
    r = CliRunner().invoke(app, ["suite", "validate", str(suite)])
    assert r.exit_code == 0 and r.stdout.startswith("ok: "), r.output


@pytest.mark.parametrize("stop_after, json_file, said", [
    (0, True, "interrupted before any row finished: nothing was written"),
    (2, True, "interrupted: 2 finished row(s) kept in "),
    (2, False, "interrupted: 2 finished row(s) shown; no file was asked for"),
])
def test_interrupt_says_what_was_kept(stop_after, json_file, said, tmp_path, capsys):
    from qstate_cli.cli import output
    from qstate_cli.results import Result

    def execute(options, progress):
        result = Result("kernels", device="cpu")
        progress.begin(3, result)
        for i in range(3):
            if i == stop_after:
                raise KeyboardInterrupt
            row = {"name": f"r{i}", "status": "ok"}
            progress.row(row)
            result.records.append(row)
        return result

    out = output.Destinations(json=tmp_path / "r.json" if json_file else None)
    with pytest.raises(KeyboardInterrupt):
        output.run_engine(execute, None, out, show=lambda doc: None)
    assert said in capsys.readouterr().err
    assert (tmp_path / "r.json").exists() == (json_file and stop_after > 0)
