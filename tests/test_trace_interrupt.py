"""Ctrl-C (or an error) while a trace is recorded loses nothing (trace/partial.py).

A `trace demo -o out/keep.pt` interrupted replaced a complete keep.pt with a partial
trace; an interrupted `trace info demo` left a 139-step trace cached under the 2000-step
demo's name, which every later `diagnose demo` replayed as the whole recording.
Now: the demo and corpus recorders write nothing on an interrupt (the earlier file is
kept, one line says so), a cached trace whose steps do not match its name is recorded
again, and a user's Recorder writes its partial trace beside an earlier file, never over it.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bad_inputs import small_trace
from qstate_cli.trace import Recorder, load_trace, save_trace

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
ROOT = Path(__file__).resolve().parents[1]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train(rec_kwargs: dict, path: Path, steps_before_stop: int, stop=KeyboardInterrupt):
    """A 2-parameter loop under a Recorder planned for 50 steps, stopped by `stop` after
    `steps_before_stop` optimizer steps."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(3000)), torch.nn.Parameter(torch.zeros(100))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    with pytest.raises(stop):
        with Recorder(opt, path, steps=50, blocks_per_tensor=None, **rec_kwargs):
            for step in range(50):
                if step == steps_before_stop:
                    raise stop
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()


def test_a_users_recorder_writes_the_partial_trace_where_no_file_was(tmp_path, capsys):
    """docs/trainers.md: the Recorder also writes the trace on Ctrl-C; the line says how many steps."""
    train({}, tmp_path / "t.pt", 7)
    assert load_trace(tmp_path / "t.pt").n_steps == 7
    err = capsys.readouterr().err
    assert "recording interrupted (Ctrl-C) after 7 steps of the 50 planned: wrote them to" in err


def test_a_partial_trace_never_replaces_an_earlier_file(tmp_path, capsys):
    """An earlier (complete) trace at the path is kept byte for byte; the partial one goes
    beside it, and the line names both."""
    earlier = save_trace(small_trace(), tmp_path / "t.pt")
    before = digest(earlier)
    train({}, tmp_path / "t.pt", 5, stop=ValueError)
    assert digest(earlier) == before
    assert load_trace(tmp_path / "t.partial.pt").n_steps == 5
    err = capsys.readouterr().err
    assert f"stopped by ValueError after 5 steps of the 50 planned: wrote them to {tmp_path / 't.partial.pt'} " \
           f"(beside the earlier {tmp_path / 't.pt'}, which is kept)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.partial.pt", "t.pt"]  # no temporary file


def test_partial_false_writes_nothing_and_says_the_earlier_file_is_kept(tmp_path, capsys):
    earlier = save_trace(small_trace(), tmp_path / "t.pt")
    before = digest(earlier)
    train({"partial": False}, tmp_path / "t.pt", 9)
    assert digest(earlier) == before and [p.name for p in tmp_path.iterdir()] == ["t.pt"]
    err = capsys.readouterr().err
    assert f"interrupted (Ctrl-C) after 9 steps of the 50 planned: no trace written (a partial one is not kept); " \
           f"{tmp_path / 't.pt'} is kept as it was" in err


def _interrupting_batches(real, after: int):
    def batches(*args, **kwargs):
        gen = real(*args, **kwargs)
        for _ in range(after):
            yield next(gen)
        raise KeyboardInterrupt
    return batches


def test_an_interrupted_demo_keeps_the_earlier_trace(tmp_path, monkeypatch, capsys):
    from qstate_cli.trace import demo

    earlier = save_trace(small_trace(), tmp_path / "keep.pt")
    before = digest(earlier)
    monkeypatch.setattr(demo.tiny_lm, "batches", _interrupting_batches(demo.tiny_lm.batches, 3))
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(earlier, demo.DemoSettings(steps=20))
    assert digest(earlier) == before and [p.name for p in tmp_path.iterdir()] == ["keep.pt"]
    assert "after 3 steps of the 20 planned: no trace written" in capsys.readouterr().err


def test_an_interrupted_cache_recording_leaves_no_cache_entry(tmp_path, monkeypatch):
    from qstate_cli.trace import demo

    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo.tiny_lm, "batches", _interrupting_batches(demo.tiny_lm.batches, 2))
    with pytest.raises(KeyboardInterrupt):
        demo.cached_demo(demo.DemoSettings(steps=6))
    assert not demo.demo_path(demo.DemoSettings(steps=6)).exists()


def test_a_cached_demo_whose_steps_do_not_match_its_name_is_recorded_again(tmp_path, monkeypatch, capsys):
    """The poisoned cache of the QA probe: a trace of other steps under the demo's name."""
    from qstate_cli.trace import demo

    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path))
    settings = demo.DemoSettings(steps=3)
    path = demo.demo_path(settings)
    save_trace(small_trace(), path)  # 4 steps, where the name says 3
    assert demo.cached_demo(settings) == path
    assert load_trace(path).n_steps == 3
    assert "holds steps 1..4 (4), not the 3 its name says (an interrupted recording?): recording it again" in \
        capsys.readouterr().err
    before = digest(path)
    assert demo.cached_demo(settings) == path and digest(path) == before  # a whole one is reused as it is


def test_a_cached_corpus_trace_whose_steps_do_not_match_is_recorded_again(tmp_path, monkeypatch, capsys):
    from qstate_cli.trace import corpus, recipes

    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path))
    e = corpus.CorpusEntry("tiny-synthetic", "test", 5, recipes.record_synthetic)
    monkeypatch.setitem(corpus.ENTRIES, e.name, e)
    path = corpus.cached_path(e)
    save_trace(small_trace(), path)
    assert corpus.cached_trace(e.name) == path and load_trace(path).n_steps == 5
    assert "the cached corpus trace" in capsys.readouterr().err


def test_ctrl_c_during_trace_demo_keeps_the_earlier_file(tmp_path):
    """The probe's reproduction, as a real process and a real SIGINT: exit 130, the earlier
    complete trace byte for byte, a line saying so, no traceback."""
    earlier = save_trace(small_trace(), tmp_path / "keep.pt")
    before = digest(earlier)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "qstate_cli", "trace", "demo", "--steps", "2000", "-o", "keep.pt"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # the first progress line (step 200): recording is under way
        line = proc.stderr.readline()
        lines.append(line)
        if not line or line.startswith("step "):
            break
    proc.send_signal(signal.SIGINT)
    err = "".join(lines) + proc.stderr.read()
    assert proc.wait(timeout=120) == 130, err
    assert "Traceback" not in err and "no trace written" in err and "keep.pt is kept as it was" in err, err
    assert digest(earlier) == before and [p.name for p in tmp_path.iterdir()] == ["keep.pt"]


def test_a_trainer_callback_stopped_by_ctrl_c_keeps_the_earlier_file(tmp_path, capsys):
    """The Lightning and Hugging Face callbacks end their RecordingSession with the exception
    that stopped training: its partial trace goes beside an earlier file too."""
    from qstate_cli.trace.trainers import RecordingSession

    earlier = save_trace(small_trace(), tmp_path / "t.pt")
    before = digest(earlier)
    params = [torch.nn.Parameter(torch.zeros(3000))]
    opt = torch.optim.SGD(params, lr=0.1)
    session = RecordingSession(tmp_path / "t.pt", blocks_per_tensor=None, steps=50)
    session.start(opt)
    for _ in range(4):
        params[0].grad = torch.ones(3000)
        opt.step()
    assert session.finish(KeyboardInterrupt) == tmp_path / "t.partial.pt"
    assert digest(earlier) == before and load_trace(tmp_path / "t.partial.pt").n_steps == 4
    assert "interrupted (Ctrl-C) after 4 steps of the 50 planned" in capsys.readouterr().err
