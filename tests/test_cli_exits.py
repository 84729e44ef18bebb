"""The exit codes a script or CI reads when the output side fails or a signal stops qstate,
as real subprocesses (a pipe's reader gone, a full device, a closed stdout, a file-size
limit, SIGTERM): cli/group.py's contract.

    2    an output or stdout that cannot be written: one line, no traceback
    141  stdout's reader is gone (`| head`): silent, as a tool killed by SIGPIPE
    143  SIGTERM: the same path as Ctrl-C (temporary files removed, finished rows kept
         and said, the terminal's cursor shown again)
"""
from __future__ import annotations

import json
import os
import pty
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {"COLUMNS": "200", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
       "HOME": os.environ.get("HOME", "/tmp"), "TRITON_INTERPRET": "1"}
QSTATE = [sys.executable, "-m", "qstate_cli"]


def qstate(*argv, cwd, env=None, **kw) -> subprocess.CompletedProcess:
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
    return subprocess.run([*QSTATE, *argv], cwd=cwd, env={**ENV, **(env or {})}, text=True, timeout=240, **kw)


def one_error_line(r, message: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert lines == [message], r.stderr


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.tmp"))


# -- stdout ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["formats"], ["audit"], ["--help"]])
def test_a_pipe_whose_reader_is_gone_exits_141_silently(argv, tmp_path):
    """`qstate audit | head -1`: click's EPIPE handling exited 1, the regression code. The
    reader closes before qstate writes anything, so every write meets the closed pipe
    (`--help` is printed while the command line is parsed, outside any command)."""
    p = subprocess.Popen([*QSTATE, *argv], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=240) == 141, err
    assert err == ""


@pytest.mark.parametrize("argv", [["formats"], ["--version"], ["trace", "corpus", "--json"]])
def test_a_full_stdout_is_one_line_exit_2(argv, tmp_path):
    """`qstate formats > /dev/full` was a traceback, exit 1; `--version`'s few bytes fail only
    when the interpreter flushes stdout at exit (a second traceback there)."""
    with open("/dev/full", "w") as full:
        r = qstate(*argv, cwd=tmp_path, env={"QSTATE_CACHE": str(tmp_path / "cache")}, stdout=full)
    assert r.returncode == 2, r.stderr
    one_error_line(r, "error: stdout: cannot write (No space left on device)")


@pytest.mark.parametrize("argv", [["formats"], ["diagnose", "--theory", "--json", "-"]])
def test_a_closed_stdout_is_one_line_exit_2(argv, tmp_path):
    """`qstate diagnose --theory --json - >&-` was an AttributeError ('NoneType' ... write);
    `formats >&-` exited 0, its tables lost."""
    r = qstate(*argv, cwd=tmp_path, stdout=None, preexec_fn=lambda: os.close(1))
    assert r.returncode == 2, r.stderr
    one_error_line(r, "error: stdout: cannot write (it is closed)")


# -- output files ----------------------------------------------------------------------------

# qstate under a file-size limit: past `limit` bytes a write fails with EFBIG (Python ignores
# SIGXFSZ). The process must not write .pyc files meanwhile (PYTHONDONTWRITEBYTECODE): the
# import system keeps a short write, and a truncated .pyc then breaks every later import of
# its module. The limit is set once torch._dynamo is imported: torch 2.9 writes a generated
# module to a temporary file (torch.distributed.nn.jit's instantiator) on that import, which
# qstate's first nn.init under a device context makes, and past the limit that was torch's
# traceback, not qstate's output failing.
SIZE_LIMITED = """
import resource, runpy, sys
import torch._dynamo
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
runpy.run_module("qstate_cli", run_name="__main__", alter_sys=True)
"""


def qstate_size_limited(limit: int, *argv, cwd) -> subprocess.CompletedProcess:
    """`python -m qstate_cli *argv` with writes limited to `limit` bytes (SIZE_LIMITED)."""
    return subprocess.run([sys.executable, "-c", SIZE_LIMITED, str(limit), *argv], cwd=cwd, capture_output=True,
                          env={**ENV, "PYTHONDONTWRITEBYTECODE": "1"}, text=True, timeout=240)


@pytest.mark.parametrize("argv, name", [
    (["audit", "--json", "a.json"], "a.json"),
    (["report", str(ROOT / "tests" / "data" / "results" / "memory.json"), "--html", "r.html"], "r.html"),
    (["bench", "memory", "-n", "1000,2000,3000", "--device", "cpu", "--csv", "m.csv"], "m.csv"),
])
def test_an_output_file_that_cannot_be_written_is_one_line_exit_2(argv, name, tmp_path):
    """A full disk, a quota or a file-size limit while writing --json/--html/--csv was a
    traceback and exit 1 (read by CI as a regression). Now one line naming the file (after
    bench's header and progress, which go to stderr too), and no temporary file left."""
    r = qstate_size_limited(200, *argv, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == f"error: {name}: cannot write (File too large)", r.stderr
    assert len(lines) == 1 or argv[0] == "bench", r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a partial or temporary file was left"


# -- SIGTERM ---------------------------------------------------------------------------------

def _read_all(fd: int, into: bytearray) -> threading.Thread:
    def drain():
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other side closed
                return
            if not chunk:
                return
            into.extend(chunk)
    t = threading.Thread(target=drain, daemon=True)
    t.start()
    return t


def _wait_for(predicate, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _terminate_when(p: subprocess.Popen, ready, seconds: float, what: str) -> tuple[str, str]:
    """SIGTERM to p once ready() (p still running), then its (stdout, stderr)."""
    try:
        _wait_for(lambda: ready() or p.poll() is not None, seconds, what)
        assert p.poll() is None, p.stderr.read()
        p.send_signal(signal.SIGTERM)
        return p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()


def test_sigterm_during_bench_train_keeps_the_rows_shows_the_cursor_and_exits_143(tmp_path):
    """SIGTERM took the default action: the progress bar's hidden cursor stayed hidden, and no
    line said what was kept. Its stderr is a terminal here, so the bar really hides it
    (`--backend reference`: torch ops only, nothing to compile, ~1 s a row)."""
    master, slave = pty.openpty()
    err = bytearray()
    p = subprocess.Popen([*QSTATE, "bench", "train", "-c", "fp32", "--steps", "20", "--seeds", "500",
                          "--eval-every", "20", "--backend", "reference", "--json", "r.json"], cwd=tmp_path,
                         env={**ENV, "TERM": "xterm"}, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    reader = _read_all(master, err)
    try:
        _wait_for(lambda: (tmp_path / "r.json").exists() or p.poll() is not None, 180, "the first finished row")
        assert p.poll() is None, err.decode(errors="replace")[-2000:]
        p.send_signal(signal.SIGTERM)
        p.stdout.read()
        assert p.wait(timeout=60) == 143
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(timeout=10)
    os.close(master)
    text = err.decode(errors="replace")
    assert "Traceback" not in text, text
    kept = len(json.loads((tmp_path / "r.json").read_text())["records"])
    assert kept >= 1 and f"interrupted: {kept} finished row(s) kept in r.json" in text, text
    assert text.rstrip().endswith("qstate: terminated"), text
    assert "\x1b[?25l" in text, "the bar never hid the cursor: the test saw no terminal"
    assert text.rfind("\x1b[?25h") > text.rfind("\x1b[?25l"), "the cursor was left hidden"
    assert temp_files(tmp_path) == []


SLOW_WRITE = textwrap.dedent("""
    import json, sys, time
    dump = json.dump
    def slow_dump(obj, fh, **kw):  # half the document, then a wait: SIGTERM lands mid-write
        text = json.dumps(obj, **kw)
        fh.write(text[: len(text) // 2])
        fh.flush()
        time.sleep(60)
        fh.write(text[len(text) // 2:])
    json.dump = slow_dump
    sys.argv = ["qstate", *sys.argv[1:]]
    from qstate_cli.__main__ import main
    main()
""")


def test_sigterm_during_an_atomic_write_leaves_no_temporary_file(tmp_path):
    """`trace demo -o t.pt` killed by SIGTERM while it saved left `.t.pt.XXXX.tmp` (32 MB):
    atomic_path removes its temporary file on an exception, and SIGTERM now is one. The
    write is slowed down (json.dump waits halfway) so that the signal lands inside it."""
    p = subprocess.Popen([sys.executable, "-c", SLOW_WRITE, "audit", "--json", "a.json"], cwd=tmp_path, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = _terminate_when(p, lambda: temp_files(tmp_path), 120, "the temporary file")
    assert p.returncode == 143, err
    assert err.strip().splitlines() == ["qstate: terminated"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a temporary or partial file was left"


def test_sigterm_during_run_says_how_to_resume_and_exits_143(tmp_path):
    """`qstate run` exited 143 with no "finished points are kept ... --resume" line."""
    suite = tmp_path / "s.yaml"
    suite.write_text("kind: train\ndefaults: {config: [fp32], steps: 20, eval_every: 20, backend: reference}\n"
                     "axes:\n  seed: [" + ", ".join(str(i) for i in range(200)) + "]\n")
    p = subprocess.Popen([*QSTATE, "run", str(suite), "--out", "o", "--no-report"], cwd=tmp_path, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = _terminate_when(p, lambda: list((tmp_path / "o").glob("*.json")), 180, "the first point")
    assert p.returncode == 143, err
    assert "Traceback" not in err, err
    assert "interrupted: finished points are kept in o/; continue with" in err and "--resume" in err, err
    assert err.rstrip().endswith("qstate: terminated"), err
    assert temp_files(tmp_path) == []

