"""The output layer (cli/output.py), the same for every command: destinations checked before
the work, files rewritten after every row, the table or the JSON on stdout at the end,
and what was measured kept when the run is interrupted."""
import csv
import json
from pathlib import Path

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


def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path, monkeypatch):
    """Compared by real path (x, ./x, a symlink to x) and by inode (a hard link); checked in
    check() before any work; an input folder, a missing input and /dev/null twice are fine."""
    import os

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.pt").write_text("trace")
    os.symlink("t.pt", tmp_path / "link.pt")
    os.link(tmp_path / "t.pt", tmp_path / "hard.pt")
    for spelling in ("t.pt", "./t.pt", str(tmp_path / "t.pt"), "link.pt", "hard.pt"):
        with pytest.raises(QstateError, match=r"^--json .*: is also an input \(TRACE\); name another file$"):
            Destinations(json=Path(spelling), inputs=(("TRACE", "t.pt"),)).check()
    with pytest.raises(QstateError, match=r"^--csv t.pt: is also an input \(--against\)"):
        Destinations(json=Path("r.json"), csv=Path("t.pt"), inputs=(("TRACE", "x.pt"), ("--against", "t.pt"))).check()
    with pytest.raises(QstateError, match=r"^--markdown same.out: --html writes it too; name another file$"):
        Destinations(html=Path("same.out"), markdown=Path("./same.out")).check()
    with pytest.raises(QstateError, match=r"^--plot .*c.svg: --json writes it too"):
        output.check_outputs([("--json", tmp_path / "c.svg"), ("--plot", "c.svg")])
    (tmp_path / "shards").mkdir()
    ok = Destinations(json=Path("shards/r.json"), csv=Path("r.csv"), inputs=(("TRACE", "shards"), ("TRACE", "demo")))
    assert ok.check().files() == {"json": Path("shards/r.json"), "csv": Path("r.csv")}
    output.check_outputs([("--json", "/dev/null"), ("--csv", "/dev/null")], [("TRACE", "t.pt")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.pt", "link.pt", "shards", "t.pt"]


def test_rewriting_a_file_keeps_its_mode(tmp_path):
    """An existing 0600 file stays 0600 (and a read-only one read-only); a new one gets 0666
    less the umask."""
    import os

    from qstate_cli.results import write_json_atomic, write_text_atomic

    for name, mode in (("secret.json", 0o600), ("shared.csv", 0o640), ("frozen.json", 0o444)):
        path = tmp_path / name
        path.write_text("old")
        path.chmod(mode)
        (write_json_atomic if name.endswith(".json") else write_text_atomic)(path, {"x": 1} if "json" in name else "x")
        assert path.stat().st_mode & 0o7777 == mode, (name, oct(path.stat().st_mode))
        assert path.read_text() != "old"
    mask = os.umask(0o022)
    os.umask(mask)
    write_text_atomic(tmp_path / "new.md", "x")
    assert (tmp_path / "new.md").stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_symlink_output_writes_its_target_and_stays_a_link(tmp_path):
    import os

    from qstate_cli.results import check_writable, write_text_atomic

    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "r.md").write_text("old")
    (tmp_path / "real" / "r.md").chmod(0o600)
    os.symlink("real/r.md", tmp_path / "r.md")
    os.symlink("real/missing.md", tmp_path / "dangling.md")
    check_writable(tmp_path / "r.md", "--markdown")
    write_text_atomic(tmp_path / "r.md", "new")
    write_text_atomic(tmp_path / "dangling.md", "made")
    assert (tmp_path / "r.md").is_symlink() and os.readlink(tmp_path / "r.md") == "real/r.md"
    assert (tmp_path / "real" / "r.md").read_text() == "new"
    assert (tmp_path / "real" / "r.md").stat().st_mode & 0o7777 == 0o600
    assert (tmp_path / "dangling.md").is_symlink() and (tmp_path / "real" / "missing.md").read_text() == "made"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["missing.md", "r.md"]  # no temp file left


def test_a_fifo_or_device_output_is_written_in_place(tmp_path):
    """A FIFO (and, as root, a character device like /dev/null) is opened and written where it
    is, never replaced by a regular file; run_engine writes it once, at the end, not per row."""
    import os
    import stat

    from qstate_cli.results import check_writable, write_json_atomic

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # keeps the FIFO open: no writer blocks
    try:
        check_writable(fifo, "--json")
        write_json_atomic(fifo, {"x": 1})
        assert json.loads(os.read(reader, 1 << 16)) == {"x": 1}
        output.run_engine(fake_engine(ROWS), {}, Destinations(csv=fifo), lambda doc: None)
        assert os.read(reader, 1 << 16).decode() == output.to_csv(ROWS)  # one copy, not one per row
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    if os.geteuid() == 0:
        null = tmp_path / "null"
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        output.run_engine(fake_engine(ROWS), {}, Destinations(json=null, csv=null), lambda doc: None)
        assert stat.S_ISCHR(os.lstat(null).st_mode) and os.lstat(null).st_rdev == os.makedev(1, 3)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["null"] if os.geteuid() == 0 else []) + ["out.fifo"]


def _rendered(tab, width: int) -> list[str]:
    from rich.console import Console

    console = Console(width=width, record=True, color_system=None)
    console.print(tab)
    return console.export_text().splitlines()


def test_a_wide_table_goes_on_below_with_its_key_columns_and_never_folds_a_cell():
    """diagnose's table (rank, config, 17 numbers): rich folded its cells to fit 80 or 100
    columns (`0.` above `00` above `41`). Each part fits the width, repeats rank and config,
    and shows every cell whole; where the console is wide enough it is one table."""
    cols = ["rank", "config"] + [f"metric {k}" for k in range(17)]
    rows = [{"rank": i + 1, "config": name, **{f"metric {k}": 0.001234 * (k + 1) * (i + 1) for k in range(17)}}
            for i, name in enumerate(["bf16", "nearest-4bit", "torchao-4bit"])]
    tab = output.table("diagnose", rows, cols, formats={c: ".4g" for c in cols[2:]})
    for width in (80, 100):
        lines = _rendered(tab, width)
        assert max(len(ln) for ln in lines) <= width
        heads = [ln for ln in lines if "rank" in ln and "config" in ln]
        assert len(heads) >= 2  # several parts, each with the key columns
        text = "\n".join(lines)
        for row in rows:
            for c in cols[2:]:
                assert f" {format(row[c], '.4g')} " in text  # whole, on one line
            assert sum(row["config"] in ln for ln in lines) == len(heads)  # every part has every row
        assert sum(f"metric {k}" in text for k in range(17)) == 17
    wide = _rendered(tab, 250)
    assert sum("rank" in ln for ln in wide) == 1 and "(1/" not in "\n".join(wide)


def test_a_column_of_free_text_wraps_within_its_table():
    rows = [{"name": "bnb-adamw8bit", "note": "unavailable: bitsandbytes is not importable (ModuleNotFoundError: "
                                              "No module named 'bitsandbytes'); pip install 'qstate-cli[peers]'"}]
    lines = _rendered(output.table(None, rows), 60)
    assert max(len(ln) for ln in lines) <= 60
    assert "'qstate-cli[peers]'" in "\n".join(lines)  # whole: a cell is text, not rich markup
    assert sum("bnb-adamw8bit" in ln for ln in lines) == 1
