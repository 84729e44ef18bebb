"""Trace limits at their edges and failed writes (the refusals themselves are cases of
tests/bad_inputs.py): step numbers fit int64 up to 2^63-1, a tensor up to 2^48 elements,
dense views (a transposed tensor) still load, and a write that fails is one line."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from bad_inputs import raw_trace, small_trace
from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.trace import load_trace, save_trace

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def test_the_last_step_may_be_2_63_minus_1_not_more(tmp_path):
    ok = raw_trace(tmp_path, "ok.pt", lambda d: d.update(step_start=2**63 - 4))  # steps 2^63-4 .. 2^63-1
    assert load_trace(ok).step_start == 2**63 - 4
    past = raw_trace(tmp_path, "past.pt", lambda d: d.update(step_start=2**63 - 3))
    with pytest.raises(QstateError, match=r"ends past step 2\^63-1"):
        load_trace(past)


def test_a_tensor_may_have_2_48_elements_not_more(tmp_path):
    def shape(s):
        def edit(d):  # one recorded block of 2048 elements
            t = d["tensors"][0]
            t.update(shape=s, blocks=torch.tensor([0]), grads=t["grads"][:, :2048].clone())
            del t["sha256"]
        return edit

    assert load_trace(raw_trace(tmp_path, "ok.pt", shape([2**24, 2**24]))).tensors[0].numel == 2**48
    for bad in ([2**24 + 1, 2**24], [0, 2**49]):  # in all, and in one dimension (0 elements in all)
        with pytest.raises(QstateError, match=r"past 2\^48 elements"):
            load_trace(raw_trace(tmp_path, "bad.pt", shape(bad)))


def test_dense_views_load_and_odd_tensors_are_named():
    from qstate_cli.trace.plain import tensor_kind, tensor_problem

    assert tensor_kind(torch.zeros(3, 4).t()) == "" and tensor_kind(torch.zeros(10)[4:]) == ""
    assert tensor_kind(torch.zeros(3).to_sparse()) == "sparse_coo"
    assert tensor_kind(torch.empty(3, device="meta")) == "meta"
    assert tensor_problem(torch.zeros(1).expand(2**20, 2**20)).startswith(
        "a view of 1,099,511,627,776 elements over 4 bytes of storage")


def test_a_transposed_gradient_still_loads(tmp_path):
    def edit(d):
        t = d["tensors"][0]
        t["grads"] = t["grads"].t().contiguous().t()  # same values, column-major
    assert torch.equal(load_trace(raw_trace(tmp_path, "t.pt", edit)).tensors[0].grads, small_trace().tensors[0].grads)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failed_write_is_one_line_not_a_torch_runtime_error():
    with pytest.raises(QstateError, match=r"^/dev/full: cannot write \(No space left on device\)$"):
        save_trace(small_trace(), "/dev/full")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_trace_demo_to_dev_full_exits_2_with_one_error_line(tmp_path, monkeypatch):
    """`trace demo -o /dev/full` printed a 75-line torch RuntimeError (exit 1); the
    progress lines come first, the error last."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["trace", "demo", "--steps", "2", "-o", "/dev/full"], env={"COLUMNS": "200"})
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: /dev/full: cannot write (No space left on device)"
    assert os.listdir(tmp_path) == []
