"""Files whose names qstate picks inside a folder (atomic.py, `picked_in`): a suite's
OUT/<run>.json, the reports, a plots folder's PNGs, a trace folder's files.

A symlink planted at such a name (a results folder unpacked from a tarball, then `qstate
run` or `qstate report`) overwrote the file it pointed to, anywhere the user could write;
now the link itself is replaced by a regular file and its target is left as it was, a FIFO
reached through one is not written, and a plots folder that leads outside its folder is
refused before any work. A path the user typed still writes a link's target
(tests/test_output.py: test_a_symlink_output_writes_its_target_and_stays_a_link).
"""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.results import load, write_json_atomic, write_text_atomic

from bad_inputs import RESULTS, small_trace
from test_suite_runner import hooks, suite_file  # noqa: F401 - fixtures

runner = CliRunner()
VICTIM = "#!/bin/sh\necho the user's own file\n"


def _victim(tmp_path: Path, name: str = "victim.sh") -> Path:
    path = tmp_path / name
    path.write_text(VICTIM)
    return path


def _regular(path: Path) -> bool:
    return stat.S_ISREG(os.lstat(path).st_mode)


def _fifo_reader(path: Path) -> int:
    """A FIFO at `path`, held open for reading so that a write to it (the bug) cannot block."""
    os.mkfifo(path)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)


def test_a_link_at_a_picked_name_is_replaced_and_a_typed_path_still_writes_its_target(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    victim = _victim(tmp_path)
    os.symlink(victim, out / "run.json")
    write_json_atomic(out / "run.json", {"x": 1}, picked_in=out)
    assert victim.read_text() == VICTIM
    assert _regular(out / "run.json") and json.loads((out / "run.json").read_text()) == {"x": 1}
    os.symlink(victim, tmp_path / "typed.md")  # the user's own link: written through, as before
    write_text_atomic(tmp_path / "typed.md", "typed")
    assert (tmp_path / "typed.md").is_symlink() and victim.read_text() == "typed"
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # no temporary file left


def test_a_fifo_at_or_behind_a_picked_name_is_not_written_in_place(tmp_path):
    """Written in place, a FIFO nobody reads would block the run for ever; a device behind a
    link would be written."""
    out = tmp_path / "out"
    out.mkdir()
    fifo = tmp_path / "elsewhere.fifo"
    readers = [_fifo_reader(fifo), _fifo_reader(out / "report.html")]
    os.symlink(fifo, out / "report.md")
    try:
        write_text_atomic(out / "report.md", "md", picked_in=out)
        write_text_atomic(out / "report.html", "html", picked_in=out)
        assert [os.read(r, 100) for r in readers] == [b"", b""]  # nothing went into either FIFO
    finally:
        for r in readers:
            os.close(r)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert _regular(out / "report.md") and (out / "report.md").read_text() == "md"
    assert _regular(out / "report.html") and (out / "report.html").read_text() == "html"


def test_a_picked_name_in_a_folder_that_leads_outside_is_refused(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "plots")
    with pytest.raises(QstateError, match=r"plots: this folder leads outside .*out \(to .*elsewhere\)"):
        write_text_atomic(out / "plots" / "a.png", "x", picked_in=out)
    assert list(elsewhere.iterdir()) == []


def test_a_trace_folders_files_are_written_in_the_folder(tmp_path):
    """The recorder's streamed files and manifest (trace/recorder.py flush) are names it picks."""
    from qstate_cli.trace import load_trace, save_trace

    victim = _victim(tmp_path)
    folder = tmp_path / "trace"
    folder.mkdir()
    os.symlink(victim, folder / "steps00000001-00000004.pt")
    save_trace(small_trace(), folder / "steps00000001-00000004.pt", picked_in=folder)
    assert victim.read_text() == VICTIM and _regular(folder / "steps00000001-00000004.pt")
    assert load_trace(folder / "steps00000001-00000004.pt").n_steps == 4


def test_a_suite_run_replaces_links_planted_in_its_out_folder(hooks, suite_file, tmp_path):  # noqa: F811
    """The probe's case: `qstate run` into a folder holding OUT/<run>.json -> a file elsewhere."""
    out = tmp_path / "out"
    out.mkdir()
    victims = [_victim(tmp_path, "victim.sh"), _victim(tmp_path, "victim.json")]
    os.symlink(victims[0], out / "sweep.json")
    os.symlink(victims[1], out / "diag.json")
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(out)], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert [v.read_text() for v in victims] == [VICTIM, VICTIM]
    for name in ("sweep.json", "diag.json", "report.html", "report.md"):
        assert _regular(out / name), name
    assert len(load(out / "sweep.json")["records"]) == 12


def test_resume_does_not_read_through_a_link_at_a_run_file(hooks, suite_file, tmp_path):  # noqa: F811
    """`--resume` read OUT/<run>.json through a link planted there (its finished points
    taken from a file elsewhere); now it is refused before any point runs, nothing written."""
    out = tmp_path / "out"
    assert runner.invoke(app, ["run", str(suite_file), "--out", str(out)], env={"COLUMNS": "300"}).exit_code == 0
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(out / "sweep.json", elsewhere)
    os.symlink(elsewhere, out / "sweep.json")
    before = elsewhere.read_bytes()
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(out), "--resume"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == (f"error: {out / 'sweep.json'}: a symbolic link where this run's results file "
                                "should be; --resume reads only the file qstate wrote: remove the link, or run "
                                "without --resume")
    assert (out / "sweep.json").is_symlink() and elsewhere.read_bytes() == before


def test_qstate_report_replaces_links_at_the_names_it_picks(tmp_path, monkeypatch):
    """`qstate report RESULTS` names reports/<stem>.html and .md itself."""
    monkeypatch.chdir(tmp_path)
    victim = _victim(tmp_path)
    fifo = tmp_path / "elsewhere.fifo"
    reader = _fifo_reader(fifo)
    (tmp_path / "reports").mkdir()
    os.symlink(victim, tmp_path / "reports" / "memory.html")
    os.symlink(fifo, tmp_path / "reports" / "memory.md")
    try:
        r = runner.invoke(app, ["report", str(RESULTS / "memory.json")])
        assert os.read(reader, 100) == b""
    finally:
        os.close(reader)
    assert r.exit_code == 0, r.output
    assert victim.read_text() == VICTIM and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert _regular(tmp_path / "reports" / "memory.html") and _regular(tmp_path / "reports" / "memory.md")
    assert "<html" in (tmp_path / "reports" / "memory.html").read_text()


def test_a_plots_folder_leading_outside_is_refused_before_any_work(tmp_path):
    md, elsewhere = tmp_path / "md", tmp_path / "elsewhere"
    md.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, md / "r-plots")
    r = runner.invoke(app, ["report", str(RESULTS / "memory.json"), "--markdown", str(md / "r.md"), "--plots"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "r-plots: this folder leads outside" in lines[0], r.stderr
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in md.iterdir()) == ["r-plots"]


def test_a_run_removes_the_temporaries_a_killed_write_left(hooks, suite_file, tmp_path):  # noqa: F811
    """SIGKILL (the OOM killer) during a write left `.sweep.json.XXXXXXXX.tmp` in OUT, which no
    later run or --resume removed; now the next run does, and nothing it did not name."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.json").write_text("{}")  # an earlier run of this suite: the folder is its
    left = [out / ".sweep.json.k3_x9QaZ.tmp", out / ".report.html.abcdefgh.tmp"]
    kept = [out / ".notes.json.abcdefgh.tmp", out / ".sweep.json.short.tmp", out / "mine.tmp",
            out / ".diag.json.justnow1.tmp"]  # the last: written a moment ago (a live write)
    for path in left + kept:
        path.write_text("{partial")
        if path != kept[-1]:
            os.utime(path, (time.time() - 60, time.time() - 60))
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(out)], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept)
    assert f"{out}: removed 2 temporary file(s) an interrupted write left" in r.stderr
