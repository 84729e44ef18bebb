"""A trace is checked at the cost of what its file holds, never of what it declares
(trace/schema.py module docstring).

The probe's trace: 65,536 block indices of one tensor (527 KB) and a shard's `elements`.
Checking that the elements lie in the blocks spelled the blocks out, 2048 int64 values per
index (134 million elements): `qstate trace info` peaked at 6.5 GB and took 82 s before its
exit-2 refusal; joining the rank's pieces (io._join) did the same. Each case here fails if
the blocks are spelled out at all (recorded_elements raises), and must still be refused in
one line.
"""
from __future__ import annotations

import time

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.trace import load_trace, schema

N_BLOCKS = 65536  # 134 million elements declared in 512 KiB of block indices


def _bomb(tmp_path, name="bomb.pt", elements=(0,), grads=(1, 1), blocks=None, numel=N_BLOCKS * schema.BLOCK):
    blocks = torch.arange(N_BLOCKS, dtype=torch.int64) if blocks is None else torch.tensor(blocks)
    obj = {"format": "qstate-trace", "schema_version": 1, "optimizer": {"name": "adamw", "hparams": {}},
           "seed": 0, "step_start": 1, "n_steps": 1, "block_size": schema.BLOCK, "grad_dtype": "fp32",
           "tensors": [{"name": "w", "index": 0, "shape": [numel], "blocks": blocks,
                        "elements": torch.tensor(list(elements), dtype=torch.int64), "grads": torch.zeros(*grads)}]}
    torch.save(obj, tmp_path / name)
    return tmp_path / name


@pytest.fixture
def never_spelled_out(monkeypatch):
    def refuse(blocks, numel):
        raise AssertionError(f"recorded_elements spelled out {blocks.numel()} blocks while checking a trace")

    monkeypatch.setattr(schema, "recorded_elements", refuse)


SPARSE = {"blocks": [0, 3], "numel": 3 * 2048 + 1000}  # blocks 0 and 3 of 4; the last is 1000 long


@pytest.mark.parametrize("edit, says", [
    ({"grads": (1, 2)}, r"grads have shape \(1, 2\), expected \(1, 1\)"),  # the shape, before any element
    ({"elements": (2048 + 5,), **SPARSE}, "'elements' must be ascending, distinct elements of the recorded blocks"),
    ({"elements": (3 * 2048 + 1000,), **SPARSE}, "'elements' must be ascending, distinct"),  # past numel
    ({"elements": (7, 3), "grads": (1, 2)}, "'elements' must be ascending, distinct"),
    ({"elements": (7, 7), "grads": (1, 2)}, "'elements' must be ascending, distinct"),
    ({"elements": (-1,)}, "'elements' must be ascending, distinct"),
])
def test_a_shards_elements_are_checked_without_spelling_out_its_blocks(edit, says, tmp_path, never_spelled_out):
    with pytest.raises(QstateError, match=says):
        load_trace(_bomb(tmp_path, **edit))


def test_elements_in_the_blocks_pass(tmp_path, never_spelled_out):
    """Elements of the first, a middle and the short last block are in; the file loads as one
    rank's piece, which io._join then refuses as incomplete, by counting."""
    path = _bomb(tmp_path, elements=(5, 3 * 2048, 3 * 2048 + 999), grads=(1, 3), **SPARSE)
    with pytest.raises(QstateError, match=r"hold 3 elements, not each of its 3048 recorded elements once"):
        load_trace(path)


def test_the_probes_trace_is_refused_in_one_line_at_once(tmp_path, never_spelled_out):
    path = _bomb(tmp_path)
    assert path.stat().st_size < 600_000
    started = time.perf_counter()
    r = CliRunner().invoke(app, ["trace", "info", str(path)])
    assert time.perf_counter() - started < 20  # was 82 s and 6.5 GB
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "hold 1 elements, not each of its 134217728 recorded elements once" in lines[0], lines
