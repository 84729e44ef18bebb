"""Small promises of the command line, through CliRunner: JSON fields that are values (not
text made for a table), help text that says what the code does, and where the cache is."""
from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.runtime import cache_dir

runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def test_trace_info_json_gives_the_hparams_as_an_object_and_the_table_as_text(tmp_path):
    from bad_inputs import small_trace
    from qstate_cli.trace import save_trace

    path = save_trace(small_trace(), tmp_path / "t.pt")
    r = runner.invoke(app, ["trace", "info", str(path), "--json"], env=WIDE)
    assert r.exit_code == 0, r.output
    hparams = json.loads(r.stdout)["summary"]["hparams"]
    assert hparams == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    r = runner.invoke(app, ["trace", "info", str(path)], env=WIDE)
    assert r.exit_code == 0 and "lr=0.001, betas=[0.9, 0.999], eps=1e-08, weight_decay=0.0" in r.stdout


def test_trace_corpus_json_says_null_where_nothing_is_needed(tmp_path):
    r = runner.invoke(app, ["trace", "corpus", "--json"], env={**WIDE, "QSTATE_CACHE": str(tmp_path)})
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["corpus:digits-cnn"]["needs"] == "sklearn"
    assert rows["corpus:synthetic-heavy"]["needs"] is None and rows["corpus:synthetic-heavy"]["size_mib"] is None
    r = runner.invoke(app, ["trace", "corpus"], env={**WIDE, "QSTATE_CACHE": str(tmp_path)})
    assert r.exit_code == 0 and "sklearn" in r.stdout  # the table still reads "-" for none


def test_report_out_help_says_it_names_the_folder_of_both_reports(tmp_path, monkeypatch):
    r = runner.invoke(app, ["report", "--help"], env={"COLUMNS": "300"})
    assert r.exit_code == 0
    text = " ".join(r.stdout.replace("│", " ").split())
    assert "Folder for both reports, STEM.html and STEM.md (STEM: the first RESULTS' name), when neither " \
           "--html nor --markdown is given (default: reports)." in text
    data = Path(__file__).parent / "data" / "results" / "memory.json"
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["report", str(data)], env=WIDE)  # no --out: ./reports/
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["memory.html", "memory.md"]


def test_the_cache_folder_is_absolute(tmp_path, monkeypatch):
    """A relative $QSTATE_CACHE is read from the working folder once (a later chdir does not
    move the cache); a relative $XDG_CACHE_HOME is ignored, as the XDG spec says."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QSTATE_CACHE", "rel/cache")
    assert cache_dir() == tmp_path / "rel" / "cache"
    monkeypatch.delenv("QSTATE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "rel")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "qstate"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "qstate" and os.path.isabs(cache_dir())
