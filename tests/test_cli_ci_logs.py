"""Progress in a CI log, COLUMNS that is no width, and a stdout that fails after a run.

A rich bar on a file draws only when it stops (`qstate run suite.yaml 2>err.log` wrote
nothing for 7 minutes), so stderr that is no terminal gets plain lines (progress_view.Lines);
`COLUMNS=0` made every table and line vanish with exit 0; and a `qstate run` whose table
could not be printed (`> /dev/full`, `| true`) skipped its report."""
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from qstate_cli.cli import output, progress_view
from qstate_cli.progress import Progress
from qstate_cli.results import Result

ROOT = Path(__file__).resolve().parents[1]

SUITE = """
name: logged
runs:
  - name: sweep
    kind: kernels
    defaults: {bits: 4}
    axes:
      config: [a, b, c]
      numel: [1024]
"""

# A suite run in a real process with fake kernels rows; each row records how many bytes
# stderr held when its point ran, so a test can tell lines written as the run goes from
# lines written at its end.
CHILD = """
import os, sys, time
from qstate_cli.suites import register_hook
def row(params):
    time.sleep(float(os.environ.get("ROW_SLEEP_S", "0")))
    return {"records": [{"name": params["config"][0], "numel": params["numel"],
                         "stderr_bytes": os.fstat(2).st_size, "status": "ok"}]}
register_hook("kernels", row)
from qstate_cli.cli import main
sys.argv = ["qstate"] + sys.argv[1:]
main()
"""


def _env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture
def suite_file(tmp_path):
    path = tmp_path / "logged.yaml"
    path.write_text(textwrap.dedent(SUITE))
    return path


def _run_child(suite_file, out, stdout, stderr, **env_extra):
    env = _env(**env_extra)
    env.pop("FORCE_COLOR", None), env.pop("TTY_COMPATIBLE", None)  # rich would take a file for a terminal
    return subprocess.Popen([sys.executable, "-c", CHILD, "run", str(suite_file), "--out", str(out)], cwd=ROOT,
                            stdout=stdout, stderr=stderr, env=env)


# -- 1. progress in a log ------------------------------------------------------------------------

def test_run_writes_a_line_per_point_to_a_log_as_it_goes(suite_file, tmp_path):
    out, log = tmp_path / "out", tmp_path / "err.log"
    with open(log, "w") as err:
        proc = _run_child(suite_file, out, subprocess.DEVNULL, err, ROW_SLEEP_S="1.1")  # a line per point
        assert proc.wait(timeout=120) == 0, log.read_text()
    text = log.read_text()
    progress = [line for line in text.splitlines() if line.startswith("[")]
    assert [line.split(" ", 1)[0] for line in progress] == ["[0/3", "[1/3", "[2/3", "[3/3"], text
    assert [line.split("] ", 1)[1] for line in progress] == [
        "sweep: config=a numel=1024", "sweep: config=b numel=1024", "sweep: config=c numel=1024", "done"], text
    assert progress[0].startswith("[0/3 0:00:00] ")
    assert "━" not in text and "\r" not in text and "\x1b" not in text  # no bar frames
    seen = [row["stderr_bytes"] for row in json.loads((out / "sweep.json").read_text())["records"]]
    assert seen[0] < seen[1] < seen[2], seen  # each point's line was in the log while it ran


def test_a_terminal_keeps_the_bar_and_a_log_gets_lines(monkeypatch):
    monkeypatch.setattr(output, "stderr", Console(file=io.StringIO(), force_terminal=True))
    monkeypatch.setenv("TERM", "xterm")
    assert isinstance(output.progress_view(), progress_view._Bar)
    monkeypatch.setenv("TERM", "dumb")  # rich draws no frames there either
    assert isinstance(output.progress_view(), progress_view.Lines)
    monkeypatch.setattr(output, "stderr", Console(file=io.StringIO()))
    assert isinstance(output.progress_view(), progress_view.Lines)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Timers:
    """The timers a Lines arms, fired by hand."""

    def __init__(self):
        self.armed = []

    def __call__(self, delay_s, fn):
        timer = type("Timer", (), {"cancelled": False})()
        timer.cancel = lambda: setattr(timer, "cancelled", True)
        self.armed.append((delay_s, fn, timer))
        return timer

    def fire(self, clock):
        delay_s, fn, timer = self.armed[-1]
        assert not timer.cancelled
        clock.now += delay_s
        fn()


def _lines(**kw):
    clock, timers, written = Clock(), Timers(), []
    view = progress_view.Lines(clock=clock, write=written.append, arm=timers, **kw)
    return view, clock, timers, written


def test_lines_of_many_quick_steps_are_a_few():
    view, clock, timers, written = _lines()
    view.begin(2000)
    for step in range(1, 2001):  # a replay: the same label after every step, 128 steps a second
        clock.now += 1 / 128
        view.unit("replaying 7 configurations", step)
    view.stop()
    assert written == ["[1/2000 0:00:00] replaying 7 configurations",  # then one per 5 s, and the last
                       "[641/2000 0:00:05] replaying 7 configurations",
                       "[1281/2000 0:00:10] replaying 7 configurations",
                       "[1921/2000 0:00:15] replaying 7 configurations",
                       "[2000/2000 0:00:15] done"]
    # one timer per line written (each step came before it was due, so each was cancelled), not one per step
    assert len(timers.armed) == 4 and all(timer.cancelled for _, _, timer in timers.armed)


def test_a_long_unit_after_quick_ones_is_named_while_it_runs():
    view, clock, timers, written = _lines()
    view.begin(3)
    view.unit("run: a", 0)
    clock.now += 0.1
    view.unit("run: b", 1)  # within a second of the line before: waits
    clock.now += 0.1
    view.unit("run: c", 2)  # replaces b, which never gets its line
    assert written == ["[0/3 0:00:00] run: a"]
    timers.fire(clock)  # c is still running a second after a's line
    assert written[-1] == "[2/3 0:00:01] run: c"
    clock.now += 60
    view.unit("done", 3)
    view.stop()
    assert written[-1] == "[3/3 0:01:01] done" and len(written) == 3  # the suite's own "done", once


def test_rows_with_their_own_lines_get_no_unit_lines():
    view, clock, timers, written = _lines(units=False)  # bench: row_line says each row
    view.begin(2)
    for i in range(2):
        view.unit(f"row {i}", i)
        clock.now += 3
        view.advance()
    view.stop()
    assert written == ["[2/2 0:00:06] done"] and not timers.armed


def test_a_label_is_written_as_text():
    view, clock, timers, written = _lines()
    view.begin(1)
    view.unit("optimizer \x1b]0;pwned\x07layer.weight", 0)  # a parameter name from a checkpoint
    assert written == ["[0/1 0:00:00] optimizer \\x1b]0;pwned\\x07layer.weight"]


def test_a_timer_replaced_or_stopped_writes_nothing():
    view, clock, timers, written = _lines()
    view.begin(None)
    view.unit("a", 0)
    clock.now += 0.5
    view.unit("b", 1)
    _, stale, timer = timers.armed[-1]
    view.stop(finished=False)  # an error or Ctrl-C: its own message says the rest
    assert timer.cancelled
    stale()
    assert written == ["[0 0:00:00] a"]


def test_a_real_timer_writes_the_waiting_line():
    written = []
    view = progress_view.Lines(write=written.append, unit_every_s=0.05)
    view.begin(2)
    view.unit("a", 0)
    view.unit("b", 1)  # waits for its timer (its own thread)
    deadline = time.monotonic() + 10
    while len(written) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    view.stop(finished=False)
    assert [line.split("] ")[1] for line in written] == ["a", "b"]


def test_run_engine_in_a_log_prints_each_row_once(capsys):
    def execute(options, progress: Progress):
        progress.begin(3, Result("memory", meta={}))
        for i in range(3):
            progress.start(f"row {i}", i)
            progress.row({"name": f"row {i}", "status": "ok"})
        return Result("memory", records=[{"name": f"row {i}", "status": "ok"} for i in range(3)])

    output.run_engine(execute, None, output.Destinations(), lambda doc: print("TABLE"),
                      row_line=lambda r: f"measured {r['name']}", header=lambda n, doc: f"bench: {n} rows")
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[:4] == ["bench: 3 rows", "measured row 0", "measured row 1", "measured row 2"]
    assert lines[4].startswith("[3/3 ") and lines[4].endswith("] done") and len(lines) == 5, lines
    assert captured.out == "TABLE\n"


# -- 2. COLUMNS that is no width -----------------------------------------------------------------

@pytest.mark.parametrize("columns", ["0", "5", "19", "abc", "-3", "８０", ""])
def test_columns_that_is_no_width_is_ignored(monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    assert output._console(file=io.StringIO()).width == 160  # as if unset: the width for a pipe
    assert output._console(file=io.StringIO(), force_terminal=True).width >= output.MIN_COLUMNS
    con = output._console(file=io.StringIO())
    con.print(output.table("T", [{"format": "bred-4bit", "bits": 4}]))
    assert "bred-4bit" in con.file.getvalue()


def test_columns_that_is_a_width_is_kept(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert output._console(file=io.StringIO()).width == 100
    assert output._console(file=io.StringIO(), force_terminal=True).width == 100


def test_columns_0_still_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "qstate_cli", "formats"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=_env(COLUMNS="0"))
    assert out.returncode == 0, out.stderr
    assert "bred-4bit" in out.stdout and len(out.stdout) > 1000


# -- 3. a stdout that fails after the run --------------------------------------------------------

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_run_to_dev_full_still_writes_the_report(suite_file, tmp_path):
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        proc = _run_child(suite_file, out, full, subprocess.PIPE)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert b"error: stdout: cannot write" in err
    assert {p.name for p in out.iterdir()} == {"sweep.json", "report.html", "report.md"}


def test_run_into_a_closed_pipe_still_writes_the_report(suite_file, tmp_path):
    out = tmp_path / "out"
    proc = _run_child(suite_file, out, subprocess.PIPE, subprocess.PIPE)
    proc.stdout.close()  # `| true`: the reader is gone before the table comes
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert {p.name for p in out.iterdir()} == {"sweep.json", "report.html", "report.md"}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_an_engine_command_to_dev_full_still_writes_its_report(tmp_path):
    html = tmp_path / "t.html"
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "qstate_cli", "diagnose", "--theory", "--html", str(html)],
                             cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, env=_env())
    assert out.returncode == 2, out.stderr
    assert html.read_text().startswith("<!")


def test_a_suite_points_phases_are_lines_every_few_seconds():
    """Inside a point the count stays (points done) and the label names the engine's phase:
    more of the same unit, a line per 5 s; the next point is a new unit again."""
    view, clock, timers, written = _lines()
    view.begin(16)
    view.unit("diagnose: defaults", 15)
    for step in range(1, 1281):  # the replay's steps, 128 a second
        clock.now += 1 / 128
        view.unit(f"diagnose: defaults: replaying 7 configurations ({step}/2000)", 15)
    clock.now += 1.5
    view.unit("memory: config=fp32", 16)
    assert written == ["[15/16 0:00:00] diagnose: defaults",
                       "[15/16 0:00:05] diagnose: defaults: replaying 7 configurations (640/2000)",
                       "[15/16 0:00:10] diagnose: defaults: replaying 7 configurations (1280/2000)",
                       "[16/16 0:00:11] memory: config=fp32"]  # a new point: a new unit, a second after


def test_a_unit_after_rows_advanced_the_count_is_a_new_unit():
    """run_engine's rows advance the count before the engine's next start (a training run, a
    doctor row): the next label is a new unit, its line a second after, not five."""
    view, clock, timers, written = _lines()
    view.begin(4)
    view.unit("A seed 0", 0)
    clock.now += 1.5
    view.advance()  # A's row
    view.unit("B seed 0", 1)
    assert written[-1] == "[1/4 0:00:01] B seed 0"


def test_run_suite_passes_the_engines_phases_and_logs_on(tmp_path):
    """A diagnose point that replays for minutes wrote nothing to a CI log between its start
    and the suite's end: the engine's progress went nowhere. Its phases and log lines are now
    the suite's, under the point's label and count."""
    from bad_inputs import small_trace

    from qstate_cli.suites import load_suite
    from qstate_cli.suites.runner import run_suite
    from qstate_cli.trace.io import save_trace

    save_trace(small_trace(), tmp_path / "t.pt")
    (tmp_path / "s.yaml").write_text(textwrap.dedent(f"""\
        name: s
        runs:
          - name: diag
            kind: diagnose
            defaults: {{trace: {tmp_path / "t.pt"}, config: [nearest-4bit], backend: reference}}
          - name: k
            kind: kernels
            defaults: {{numel: 4096, config: nearest-4bit, device: cpu, backend: reference,
                        threads: {os.cpu_count() + 1}, rounds: 2, warmup_ms: 1, rep_ms: 1, copy_numel: 4096}}
        """))
    starts, logs = [], []
    run_suite(load_suite(tmp_path / "s.yaml"), tmp_path / "out",
              progress=Progress(on_start=lambda label, done: starts.append((label, done)), on_log=logs.append))
    assert starts[0] == ("diag: defaults", 0) and starts[-1] == ("done", 2)
    assert starts[1:5] == [(f"diag: defaults: replaying 1 configuration ({k}/4)", 0) for k in range(1, 5)]
    assert starts[5] == ("k: defaults", 1)
    assert starts[6:-1] and all(done == 1 and label.startswith("k: defaults: ") for label, done in starts[6:-1])
    assert len(logs) == 1 and logs[0].startswith(f"warning: --threads {os.cpu_count() + 1} is more than the")
