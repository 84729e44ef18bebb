"""What the process around a command does (__main__.py, cli/group.py), as real subprocesses:
an interrupt at any moment (while the CLI loads, while typer builds the command, while the
command line is parsed, during the command, after it) and a second one while the process
exits; stdout whose encoding cannot hold a path; a file name that is not UTF-8; a read-only
HOME under `qstate report` (report/plots.py).

The signals are sent by the process to itself from a patched step (os.kill, then a sleep
the handler interrupts), so each lands where it is meant to without a race against the
interpreter's start.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qstate_cli.errors import QstateError
from qstate_cli.trace import BLOCK, load_trace, save_trace, synthetic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests" / "data" / "results"
ENV = {"COLUMNS": "200", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
       "HOME": os.environ.get("HOME", "/tmp"), "TRITON_INTERPRET": "1"}
CODE = {"SIGINT": 130, "SIGTERM": 143}
LINE = {"SIGINT": "qstate: interrupted", "SIGTERM": "qstate: terminated"}

# A test run in the background inherits SIGINT ignored: the child gets Python's handler back.
PROLOGUE = """
import atexit, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
SIG = signal.Signals[sys.argv[1]]
def signal_here():
    os.kill(os.getpid(), SIG)
    time.sleep(30)  # the handler raises here
"""

RUN = """
sys.argv = ["qstate", *sys.argv[2:]]
from qstate_cli.__main__ import main
main()
"""


def script(body: str, sig: str, *argv, env=None) -> subprocess.CompletedProcess:
    code = textwrap.dedent(PROLOGUE) + textwrap.dedent(body) + textwrap.dedent(RUN)
    return subprocess.run([sys.executable, "-c", code, sig, *argv], env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=120)


def qstate(*argv, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qstate_cli", *argv], env={**ENV, **(env or {})}, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def no_traceback(r) -> None:
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


# -- an interrupt at any moment -------------------------------------------------------------

WHERE = {
    # while the CLI imports torch: the line and out at once (SIGTERM took its default action: -15)
    "loading": """
        class Loading:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    signal_here()
        sys.meta_path.insert(0, Loading())
    """,
    # an import that an exception raised into breaks or loses (numpy's C module cut short:
    # "cannot load module more than once per process"): here one that swallows it went on
    "loading, swallowed": """
        class Loading:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    try:
                        signal_here()
                    except BaseException:
                        pass
        sys.meta_path.insert(0, Loading())
    """,
    # typer builds the click command from the app: cli() was outside the try (a traceback)
    "building": """
        import typer.main
        typer.main.get_command = lambda app: signal_here()
    """,
    # the command line parsed: typer's own silent 130, for a SIGTERM too
    "parsing": """
        import typer.core
        typer.core.TyperGroup.parse_args = lambda self, ctx, args: signal_here()
    """,
}


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("where", list(WHERE))
def test_an_interrupt_outside_the_command_is_one_line_and_its_code(where, sig):
    r = script(WHERE[where], sig, "formats")
    no_traceback(r)
    assert (r.returncode, r.stderr.splitlines()) == (CODE[sig], [LINE[sig]]), r.stderr
    assert r.stdout == ""


def test_a_sigterm_after_the_command_exits_143_not_130():
    """Once the command returned, click's ctx.exit: typer turned a SIGTERM there into 130."""
    r = script("""
        from typer import _click as click  # typer 0.29 vendors click
        def exit_late(self, code=0):
            signal_here()
        click.Context.exit = exit_late
    """, "SIGTERM", "formats")
    no_traceback(r)
    assert r.returncode == 143 and r.stderr.splitlines() == [LINE["SIGTERM"]], r.stderr


# -- a second signal while the process exits -----------------------------------------------

SECOND = """
import typer.core
invoke = typer.core.TyperGroup.invoke
def interrupted(self, ctx):
    # registered once torch is loaded, so it runs before torch's own atexit callbacks
    atexit.register(again, "atexit")
    if SIG is None:  # no first signal: the command runs and succeeds
        return invoke(self, ctx)
    signal_here()  # the command is interrupted here
def again(where):
    for second in (signal.SIGINT, signal.SIGTERM):
        os.kill(os.getpid(), second)
        time.sleep(0.05)
    print(f"{where}: signals ignored", file=sys.stderr, flush=True)
typer.core.TyperGroup.invoke = interrupted
"""

RUN_THEN_AGAIN = """
sys.argv = ["qstate", *sys.argv[2:]]
from qstate_cli.__main__ import main
try:
    main()
finally:  # SystemExit on its way out: a KeyboardInterrupt here replaced it (died by SIGINT, -2)
    again("unwinding")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "none"])
def test_a_signal_while_the_process_exits_is_ignored(sig):
    """A second Ctrl-C during the exit printed "Exception ignored in atexit callback:
    dump_compile_times ... KeyboardInterrupt", or the process died by the signal (-2, -15)
    instead of exiting 130 / 143; one after a command that succeeded did the same to its 0."""
    code = textwrap.dedent(PROLOGUE.replace("signal.Signals[sys.argv[1]]", "getattr(signal, sys.argv[1], None)"))
    code += textwrap.dedent(SECOND) + textwrap.dedent(RUN_THEN_AGAIN)
    r = subprocess.run([sys.executable, "-c", code, sig, "formats"], env=ENV, capture_output=True, text=True,
                       timeout=120)
    no_traceback(r)
    assert r.returncode == CODE.get(sig, 0), r.stderr
    said = [LINE[sig]] if sig in LINE else []
    assert r.stderr.splitlines() == [*said, "unwinding: signals ignored", "atexit: signals ignored"]
    assert (sig != "none") == (r.stdout == "")


def test_a_caller_in_the_same_process_gets_its_signal_handlers_back(monkeypatch):
    """Signals stay ignored only in qstate's own process (__main__): CliRunner, a test, gets
    its SIGINT and SIGTERM handlers back after an interrupted command."""
    import typer.core
    from typer.testing import CliRunner

    from qstate_cli.cli import app

    def interrupted(self, ctx):
        raise KeyboardInterrupt

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(typer.core.TyperGroup, "invoke", interrupted)
    r = CliRunner().invoke(app, ["formats"])
    assert r.exit_code == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# -- stdout's encoding ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def trace_bytes(tmp_path_factory) -> bytes:
    path = save_trace(synthetic.gaussian(4 * BLOCK, 3), tmp_path_factory.mktemp("trace") / "t.pt")
    return path.read_bytes()


def test_a_path_stdout_cannot_encode_is_escaped_not_a_traceback(tmp_path, trace_bytes):
    """`PYTHONIOENCODING=ascii qstate trace info "résultats dir/tracé.pt"`: rich's table raised
    UnicodeEncodeError from stdout's write (30 lines, exit 1; `run` lost its report)."""
    folder = tmp_path / "résultats dir"
    folder.mkdir()
    (folder / "tracé.pt").write_bytes(trace_bytes)
    r = qstate("trace", "info", "résultats dir/tracé.pt", env={"PYTHONIOENCODING": "ascii"}, cwd=tmp_path)
    no_traceback(r)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "r\\xe9sultats dir/trac\\xe9.pt" in r.stdout


def test_stdout_escapes_what_its_encoding_cannot_hold():
    """A file name that is not UTF-8 (its bytes decoded as surrogates) on a UTF-8 stdout."""
    import io

    from qstate_cli.cli.group import _Stdout

    for encoding, text, written in [("utf-8", "lat\udce9n é\n", "lat\\udce9n é\n"),
                                    ("ascii", "tracé\n", "trac\\xe9\n")]:
        raw = io.BytesIO()
        stream = io.TextIOWrapper(raw, encoding=encoding)
        _Stdout(stream).write(text)
        stream.flush()
        assert raw.getvalue().decode(encoding) == written


# -- a file name that is not UTF-8 ----------------------------------------------------------

def test_a_trace_whose_name_is_not_utf8_is_not_called_corrupt(tmp_path, trace_bytes):
    """torch.load opens the file by its name encoded as UTF-8: the UnicodeEncodeError (a
    ValueError) said `corrupt or truncated trace`."""
    folder = Path(os.fsdecode(bytes(tmp_path) + b"/lat\xe9n"))
    folder.mkdir()
    path = folder / "t.pt"
    path.write_bytes(trace_bytes)
    with pytest.raises(QstateError, match=r"torch cannot open a file by this name \(it is not valid UTF-8\): rename"):
        load_trace(path)
    r = qstate("trace", "info", os.fsdecode(b"lat\xe9n/t.pt"), cwd=tmp_path)
    no_traceback(r)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["error: lat\\udce9n/t.pt: torch cannot open a file by this name (it is not valid "
                                     "UTF-8): rename it or its folder"]


# -- a read-only HOME -----------------------------------------------------------------------

def no_matplotlib_dirs(home: Path) -> dict:
    """An environment whose HOME is a file (mkdir under it fails, for root too) and no XDG folders."""
    env = {**ENV, "HOME": str(home)}
    for var in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR"):
        env.pop(var, None)
    return env


def test_a_report_under_a_read_only_home_is_quiet_and_caches_fonts_in_qstate_s_cache(tmp_path):
    """matplotlib warned twice ("mkdir -p failed", "created a temporary cache directory") on
    every `qstate report` and rebuilt its font cache each run."""
    home = tmp_path / "home"
    home.write_text("")
    env = {**no_matplotlib_dirs(home), "QSTATE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "qstate_cli", "report", str(RESULTS / "memory.json"), "--out", "rep"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"wrote {Path('rep', 'memory.html')}", f"wrote {Path('rep', 'memory.md')}"]
    assert list((tmp_path / "cache" / "matplotlib").glob("fontlist-*.json"))


def test_without_a_writable_cache_matplotlib_gets_a_temporary_folder_quietly(tmp_path):
    home = tmp_path / "home"
    home.write_text("")
    env = {**no_matplotlib_dirs(home), "QSTATE_CACHE": str(home / "cache"), "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", "import os, qstate_cli.report.plots; print(os.environ['MPLCONFIGDIR'])"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    folder = Path(r.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith("qstate-matplotlib-")
    assert not folder.exists(), "the temporary folder was left behind"


def test_bench_trains_plot_under_a_read_only_home_is_quiet_too(tmp_path):
    """train/plot.py imports matplotlib itself: it warned as report's plots did (mplconfig)."""
    home = tmp_path / "home"
    home.write_text("")
    env = {**no_matplotlib_dirs(home), "QSTATE_CACHE": str(tmp_path / "cache")}
    code = ("import json, sys; from qstate_cli.train import plot; "
            "plot.save_loss_curves(json.load(open(sys.argv[1])), sys.argv[2])")
    r = subprocess.run([sys.executable, "-c", code, str(RESULTS / "train.json"), str(tmp_path / "c.png")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert list((tmp_path / "cache" / "matplotlib").glob("fontlist-*.json"))


def test_out_of_memory_in_a_command_is_one_line(monkeypatch, tmp_path):
    """A diagnose or trace info that ran out of memory printed torch's 60-line traceback
    (DefaultCPUAllocator: can't allocate memory), exit 1."""
    from typer.testing import CliRunner

    from qstate_cli.cli import app
    from qstate_cli.diagnose import run as diagnose_run

    def too_big(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 11811160064 bytes. Error code 12 (Cannot allocate memory)")

    from qstate_cli.trace import synthetic
    from qstate_cli.trace.io import save_trace

    trace = str(save_trace(synthetic.gaussian(256, 3, beta2=0.999, seed=1), tmp_path / "t.pt"))
    monkeypatch.setattr(diagnose_run, "replay_result", too_big)
    r = CliRunner().invoke(app, ["diagnose", trace, "--steps-limit", "2", "--skip-reset-check"])
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.startswith("error: out of memory ([enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator")
    assert r.stderr.rstrip().endswith("(Cannot allocate memory)): qstate diagnose needs less: --steps-limit N, "
                                      "fewer --config, or more ranks under torchrun (docs/distributed.md)")
    assert len(r.stderr.splitlines()) == 1
    monkeypatch.setattr(diagnose_run, "replay_result", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    assert isinstance(CliRunner().invoke(app, ["diagnose", trace, "--steps-limit", "2"]).exception, RuntimeError)
