"""Sharded (FSDP2) traces whose ranks disagree: a rank that stopped early (crash,
interrupt), a rank missing, one rank's file alone; and `meta.zero_tensors` of a joined
trace. The shard files are built here the way the Recorder writes them under torchrun
(rank<r>-steps*.pt + manifest-rank<r>.json, or rank<r>.pt; meta rank and world_size);
the last test records a real 2-rank FSDP2 run with torchrun (gloo, CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.trace import load_trace, save_trace
from qstate_cli.trace.io import MANIFEST_TAG
from qstate_cli.trace.schema import Trace, TraceTensor, recorded_elements

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

STEPS = 6
# name, shape, recorded blocks, element where rank 1's shard starts (dim 0 cut in half)
TENSORS = [("w", (96, 64), [0, 1, 2], 3072),     # block 1 is cut by the shard boundary
           ("late", (4, 1024), [1], 2048),        # its recorded block lies in rank 1's shard only
           ("dead", (4, 1024), [0], 2048)]        # zero gradient at every step (rank 0 holds it)


def reference() -> list[TraceTensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (name, shape, blocks, _) in enumerate(TENSORS):
        b = torch.tensor(blocks)
        n = recorded_elements(b, shape[0] * shape[1]).numel()
        grads = torch.zeros(STEPS, n) if name == "dead" else torch.randn(STEPS, n, generator=g)
        out.append(TraceTensor(name, i, shape, b, grads))
    return out


def piece(t: TraceTensor, rank: int, cut: int, a: int, b: int) -> TraceTensor:
    """Rank `rank`'s elements of t (its shard starts at element `cut`), steps a..b-1 (0-based)."""
    idx = recorded_elements(t.blocks, t.numel)
    mine = (idx < cut) if rank == 0 else (idx >= cut)
    return TraceTensor(t.name, t.index, t.shape, t.blocks, t.grads[a:b][:, mine].contiguous(), None, idx[mine])


def rank_trace(rank: int, a: int, b: int, zero_meta=None) -> Trace:
    tensors = [piece(t, rank, cut, a, b) for t, (_, _, _, cut) in zip(reference(), TENSORS)]
    meta = {"source": "Recorder", "rank": rank, "world_size": 2}
    if zero_meta:
        meta["zero_tensors"] = zero_meta
    return Trace("adamw", {"lr": 1e-3}, 0, a + 1, b - a, "fp32", tensors, meta)


def write_stream(d: Path, rank: int, last_step: int, flush: int = 2, first_step: int = 1, zero_meta=None) -> None:
    """What Recorder(flush_steps=flush) leaves for one rank that recorded steps first..last."""
    files = []
    for a in range(first_step - 1, last_step, flush):
        b = min(a + flush, last_step)
        name = f"rank{rank}-steps{a + 1:08d}-{b:08d}.pt"
        save_trace(rank_trace(rank, a, b, zero_meta), d / name)
        files.append(name)
    (d / f"manifest-rank{rank}.json").write_text(json.dumps(
        {"format": MANIFEST_TAG, "files": files, "steps": last_step - first_step + 1, "step_start": first_step}))


def info(path) -> tuple[int, dict | None, str]:
    r = CliRunner().invoke(app, ["trace", "info", str(path), "--json"])
    doc = json.loads(r.stdout) if r.exit_code == 0 else None
    return r.exit_code, doc, r.stderr


def assert_steps(trace: Trace, n: int) -> None:
    assert (trace.step_start, trace.n_steps) == (1, n)
    for got, want in zip(trace.tensors, reference()):
        assert not got.partial and got.name == want.name
        assert torch.equal(got.grads, want.grads[:n]), got.name


def test_a_rank_that_stopped_early_keeps_the_steps_every_rank_streamed(tmp_path, capsys):
    """Rank 1 crashed after writing steps 1..5, rank 0 wrote 1..6: steps 1..5 load, equal to
    the recorded gradients, and stderr names step 6 of rank 0 as dropped (the old loader
    grouped files by step range across ranks and refused the whole directory)."""
    d = tmp_path / "crash-stream"
    d.mkdir()
    write_stream(d, 0, 6)
    write_stream(d, 1, 5)
    assert_steps(load_trace(d), 5)
    err = capsys.readouterr().err
    assert "loading steps 1..5" in err and "dropped step 6 of rank 0 (manifest-rank0.json)" in err
    assert "steps 1..6" in err and "steps 1..5" in err and "\n" not in err.strip()
    code, doc, err = info(d)
    assert code == 0 and doc["summary"]["steps"] == "1..5 (5)", err
    assert "dropped step 6 of rank 0" in err


def test_a_rank_that_stopped_early_without_streaming(tmp_path, capsys):
    d = tmp_path / "crash"
    d.mkdir()
    save_trace(rank_trace(0, 0, 6), d / "rank0.pt")
    save_trace(rank_trace(1, 0, 5), d / "rank1.pt")
    assert_steps(load_trace(d), 5)
    assert "dropped step 6 of rank 0 (rank0.pt)" in capsys.readouterr().err


def test_no_common_step_names_each_ranks_range(tmp_path):
    d = tmp_path / "apart"
    d.mkdir()
    write_stream(d, 0, 4)
    write_stream(d, 1, 6, first_step=5)
    code, doc, err = info(d)
    assert code == 2 and doc is None
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "no step is recorded by every shard" in line
    assert "rank 0 (manifest-rank0.json): steps 1..4" in line
    assert "rank 1 (rank1-steps00000005-00000006.pt): steps 5..6" in line  # a manifest of one file names the file


def test_a_rank_without_files_is_named(tmp_path):
    """Rank 1 stopped before its first file: the error names it, not a count of elements."""
    d = tmp_path / "half"
    d.mkdir()
    write_stream(d, 0, 4)
    with pytest.raises(QstateError, match=r"recording on 2 ranks, but only rank\(s\) 0 wrote files here "
                                          r"\(none from rank\(s\) 1"):
        load_trace(d)


def test_one_ranks_file_alone_says_to_load_the_directory(tmp_path):
    save_trace(rank_trace(0, 0, 3), tmp_path / "rank0.pt")
    code, _, err = info(tmp_path / "rank0.pt")
    assert code == 2 and "one rank's file of a sharded (FSDP2) recording on 2 ranks (rank 0)" in err
    assert "load the directory" in err


def test_zero_tensors_are_recomputed_from_the_joined_gradients(tmp_path):
    """Each rank's file lists what was zero in its own view (rank 0 holds no element of
    'late'); the joined trace lists only what is zero on every rank ('dead')."""
    for stream in (False, True):
        d = tmp_path / f"z{int(stream)}"
        d.mkdir()
        if stream:
            write_stream(d, 0, 6, zero_meta=["late", "dead"])
            write_stream(d, 1, 6, zero_meta=["dead"])
        else:
            save_trace(rank_trace(0, 0, 6, ["late", "dead"]), d / "rank0.pt")
            save_trace(rank_trace(1, 0, 6, ["dead"]), d / "rank1.pt")
        trace = load_trace(d)
        assert_steps(trace, 6)
        assert trace.meta["zero_tensors"] == ["dead"]
        code, doc, _ = info(d)
        assert code == 0 and doc["summary"]["meta.zero_tensors"] == "dead"


WORKER = r'''
import contextlib, io, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from qstate_cli.trace import Recorder

torch.set_num_threads(1)
out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.late = torch.nn.Parameter(torch.randn(4, 1024, generator=g) / 32)  # only rows 2..3 (rank 1's) train
        self.dead = torch.nn.Parameter(torch.randn(4, 1024, generator=g) / 32)  # never used: no gradient
        self.w = torch.nn.Parameter(torch.randn(6, 1024, generator=g) / 32)

    def forward(self, x):
        return (x @ self.late[2:].T).pow(2).mean() + (x @ self.w.T).tanh().mean()


def run(name, steps, **kw):
    model = Model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        with Recorder(opt, os.path.join(out, name), model=model, blocks_per_tensor=1, steps=steps[rank], **kw):
            for step in range(max(steps)):
                x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(step))
                opt.zero_grad()
                model(x).backward()
                opt.step()
    with open(os.path.join(out, f"{name}-err{rank}.txt"), "w") as fh:
        fh.write(err.getvalue())


run("whole", [6, 6])
run("stream", [6, 4], flush_steps=2)  # rank 1 stops recording after step 4, as if it had crashed there
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # gloo's threads can abort a normal exit (docs/distributed.md)
'''


@pytest.mark.distributed
@pytest.mark.fsdp2_on_gloo
def test_fsdp2_recording_under_torchrun(tmp_path):
    """A real 2-rank FSDP2 recording: rank 0 holds none of the recorded elements of 'late'
    and prints nothing about it; 'dead' is the one tensor in meta.zero_tensors (the old
    recorder listed 'late' too, from rank 0's view, and warned about it); a rank whose
    streamed recording stops early loads as the steps both ranks wrote."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 is not available")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = load_trace(tmp_path / "whole")
    assert whole.n_steps == 6 and whole.meta["zero_tensors"] == ["dead"]
    late = next(t for t in whole.tensors if t.name == "late")
    assert late.blocks.tolist() == [1] and bool(late.grads.ne(0).any(1).all())
    rank0_file = torch.load(tmp_path / "whole" / "rank0.pt", weights_only=True)
    assert "late" not in rank0_file["meta"].get("zero_tensors", [])
    errs = [(tmp_path / f"whole-err{r}.txt").read_text() for r in (0, 1)]
    assert not any("late" in e for e in errs), errs
    assert any("dead" in e and "zero at every one of 6 steps" in e for e in errs), errs
    code, doc, _ = info(tmp_path / "whole")
    assert code == 0 and doc["summary"]["meta.zero_tensors"] == "dead"
    code, doc, err = info(tmp_path / "stream")
    assert code == 0 and doc["summary"]["steps"] == "1..4 (4)", err
    assert "dropped steps 5..6 of rank 0 (manifest-rank0.json)" in err
    stream = load_trace(tmp_path / "stream")
    for a, b in zip(stream.tensors, whole.tensors):
        assert torch.equal(a.grads, b.grads[:4]), a.name
