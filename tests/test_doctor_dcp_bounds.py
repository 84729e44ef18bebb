"""DCP metadata whose checks would cost the square of its size (doctor/dcpmeta.py module
docstring): pickle shares one object wherever it recurs, so a 35 KB .metadata gave 3,000
keys one list of 3,000 chunks and `qstate doctor` checked 9 million chunks (36 s). The
totals are now counted first and refused in one line before any key is checked.
"""
from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                   TensorStorageMetadata)
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.doctor import dcpmeta

from bad_inputs import _dcp

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _shared(tmp_path, keys: int, chunks: int, dims: int = 1) -> str:
    """A .metadata of `keys` keys sharing one entry: one list of `chunks` chunks, one size."""
    size = torch.Size([0] * dims)
    chunk = ChunkStorageMetadata(offsets=size, sizes=size)
    entry = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=size, chunks=[chunk] * chunks)
    md = Metadata(state_dict_metadata={f"k{i}": entry for i in range(keys)}, storage_data={})
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    return str(folder)


@pytest.fixture
def dims_checked(monkeypatch):
    """How many sizes, offsets and chunk sizes the per-key loop read."""
    calls = []
    real = dcpmeta._dims
    monkeypatch.setattr(dcpmeta, "_dims", lambda value: calls.append(1) or real(value))
    return calls


def _refused(folder: str, says: str) -> None:
    r = CliRunner().invoke(app, ["doctor", folder])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines


def test_shared_chunk_lists_are_counted_and_refused_before_any_key_is_checked(tmp_path, dims_checked):
    folder = _shared(tmp_path, keys=300, chunks=300)
    _refused(folder, ".metadata: its tensors list 90,000 chunks, but it stores 0 items (each chunk is read from "
                     "an item of its own): a forged checkpoint")
    assert dims_checked == []  # was 300 x 300 chunk checks


def test_a_shared_size_of_many_dimensions_is_refused_before_any_key_is_checked(tmp_path, dims_checked):
    folder = _shared(tmp_path, keys=300, chunks=0, dims=10_000)
    _refused(folder, ".metadata: a tensor declares 10,000 dimensions (at most 64)")
    assert dims_checked == []


def test_a_long_planner_data_path_is_refused(tmp_path):
    folder = _dcp(tmp_path, lambda md: md.planner_data.update(
        {k: ("optimizer",) * 10_000 for k in md.state_dict_metadata}))
    _refused(folder, "is 10,000 keys long (at most 64)")
