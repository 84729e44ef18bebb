"""The output layer (cli/output.py), the same for every command: destinations checked before
the work, files rewritten after every row, the table or the JSON on stdout at the end,
and what was measured kept when the run is interrupted."""
import csv
import json

import pytest

from qstate_cli.cli import output
from qstate_cli.cli.output import Destinations
from qstate_cli.errors import QstateError
from qstate_cli.results import Result


def test_destinations_are_checked_before_any_work(tmp_path):
    with pytest.raises(QstateError, match="is a folder"):
        Destinations(json=tmp_path).check()
    (tmp_path / "file").write_text("x")
    with pytest.raises(QstateError, match="file is a file, not a folder"):
        Destinations(csv=tmp_path / "file" / "rows.csv").check()
    with pytest.raises(QstateError, match="name a .png, .svg or .pdf"):
        Destinations(plot=tmp_path / "curves.gif").check()
    ok = Destinations(json=tmp_path / "new" / "r.json", plot=tmp_path / "c.svg").check()
    assert ok.json_file == tmp_path / "new" / "r.json" and not ok.json_to_stdout
    assert Destinations(json="-").json_file is None and Destinations(json="-").files() == {}


def fake_engine(rows, stop_after=None):
    def execute(options, progress):
        result = Result("kernels", meta={"options": options}, device="cpu")
        progress.begin(len(rows), result)
        for i, row in enumerate(rows):
            if stop_after is not None and i == stop_after:
                raise KeyboardInterrupt
            progress.start(row["name"], i)
            progress.row(row)
            result.records.append(row)
        return result
    return execute


ROWS = [{"name": "a", "time_ms": 1.0, "samples_ms": [1.0, 1.1]}, {"name": "b", "time_ms": 2.0, "samples_ms": [2.0]}]


def test_files_after_every_row_and_the_table_at_the_end(tmp_path, capsys):
    shown = []
    out = Destinations(json=tmp_path / "r.json", csv=tmp_path / "r.csv")
    doc = output.run_engine(fake_engine(ROWS), {"x": 1}, out, shown.append)
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["records"] == ROWS == doc["records"] and on_disk["kind"] == "kernels"
    assert on_disk["env"]["device"] == "cpu" and on_disk["meta"] == {"options": {"x": 1}}
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert [r["name"] for r in rows] == ["a", "b"] and json.loads(rows[0]["samples_ms"]) == [1.0, 1.1]
    assert shown == [doc]
    assert "wrote" in capsys.readouterr().err


def test_json_to_stdout_replaces_the_table(capsys):
    shown = []
    output.run_engine(fake_engine(ROWS), {}, Destinations(json="-"), shown.append)
    assert shown == [] and json.loads(capsys.readouterr().out)["records"] == ROWS


def test_ctrl_c_keeps_and_shows_the_rows_measured(tmp_path):
    shown = []
    with pytest.raises(KeyboardInterrupt):
        output.run_engine(fake_engine(ROWS, stop_after=1), {}, Destinations(json=tmp_path / "r.json"), shown.append)
    assert json.loads((tmp_path / "r.json").read_text())["records"] == ROWS[:1]
    assert [d["records"] for d in shown] == [ROWS[:1]]


def test_the_env_block_names_the_cpu_and_its_vector_isa(monkeypatch):
    """CPU timings depend on the host (docs/cpu.md: 1.1-1.4x torch on AVX-512, 2.5-3.5x on AVX2),
    so a result says which CPU ran it: its model name from /proc/cpuinfo and torch's vector ISA."""
    import builtins
    import platform

    import torch

    from qstate_cli import results

    env = results.environment("cpu")
    assert env["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    assert env["device_name"] == (names[0] if names and names[0] else platform.processor() or platform.machine())

    real_open = builtins.open

    def no_cpuinfo(path, *a, **kw):
        if str(path) == "/proc/cpuinfo":
            raise FileNotFoundError(path)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", no_cpuinfo)
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert results.cpu_name() == platform.machine()


def test_the_env_block_counts_the_cores_under_the_cpus(tmp_path, monkeypatch):
    """cpu_cores counts distinct (package, core) pairs of the host's CPUs, from sysfs: two
    hyperthreads of one core are one core; an unreadable topology is None, not a guess."""
    import os

    from qstate_cli import results

    topology = {0: ("0", "0"), 1: ("0", "0"), 2: ("0", "1"), 3: ("0", "1"), 4: ("1", "0")}  # CPU -> (package, core)
    for cpu, (pkg, core) in topology.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(pkg + "\n")
        (d / "core_id").write_text(core + "\n")
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert results.cpu_cores(str(tmp_path)) == 3  # core 0 and core 1 of package 0, core 0 of package 1
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert results.cpu_cores(str(tmp_path)) == 1  # two hyperthreads of one core
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert results.cpu_cores(str(tmp_path)) is None  # cpu5 has no topology here
    assert results.cpus_on_cores(2, 1) == "2 CPUs on 1 core" and results.cpus_on_cores(4, None) == ""
    monkeypatch.undo()
    env = results.environment("cpu")
    assert env["cpu_cores"] is None or 1 <= env["cpu_cores"] <= env["cpu_count"]
