"""Quantized optimizers under FSDP2 and DDP, and DCP checkpoints, on 2 gloo processes (CPU).

One spawn (tests/distributed_worker.py, ~1 minute on a loaded 2-core machine) runs every
scenario and the single-process references; the tests compare what it saved. Skipped
where torch.distributed, gloo or FSDP2 (`torch.distributed.fsdp.fully_shard`) is missing.
"""
from __future__ import annotations

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2, torch >= 2.6)
except ImportError:
    pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) is not available", allow_module_level=True)

import distributed_worker as worker  # noqa: E402

# every test reads the one spawn, which runs FSDP2 on gloo before the DDP scenarios
pytestmark = [pytest.mark.distributed, pytest.mark.fsdp2_on_gloo]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    worker.spawn(str(out), world=2, timeout_s=600)

    def load(name):
        return torch.load(out / f"{name}.pt", weights_only=True)

    load.out = out
    return load


def assert_same(a: dict, b: dict, what: str):
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(x, y), f"{what}: parameter {i} differs, max |diff| {(x - y).abs().max():.3g}"
    assert a["states"].keys() == b["states"].keys()
    for k in a["states"]:
        x, y = a["states"][k], b["states"][k]
        assert torch.equal(x, y), f"{what}: state {k} differs at {(x != y).nonzero()[:5].flatten().tolist()}"


@pytest.mark.parametrize("states", ["bred-4bit", "nearest-4bit"])
def test_fsdp2_equals_single_process_bit_for_bit(runs, states):
    fsdp, single = runs(f"fsdp-{states}"), runs(f"single-{states}")
    assert torch.equal(fsdp["losses"], single["losses"])
    assert_same(fsdp, single, f"FSDP2 {states}")
    audit = {(r["name"], r["state"]): r for r in fsdp["audit"]}
    assert {r["blocks"] for r in audit.values()} == {"global"}
    assert audit["0.weight", "m"]["world_independent"] and not audit["0.bias", "m"]["world_independent"]
    assert audit["0.weight", "m"]["local_shape"] == "128x128" and audit["0.weight", "m"]["global_shape"] == "256x128"


def test_fsdp2_with_the_batch_split_tracks_single_process(runs):
    """Each rank sees half the batch: the mean of the two half-batch gradients differs from
    the whole batch's in the last bits, so only the losses are compared (float tolerance)."""
    split, single = runs("fsdp-split")["losses"], runs("single-bred-4bit")["losses"]
    assert torch.allclose(split, single, rtol=1e-5, atol=0), (split - single).abs().max()


def test_uneven_shards_are_quantized_on_local_blocks_and_say_so(runs):
    rows = [r for rank_rows in runs("uneven")["audit"] for r in rank_rows]
    assert len(rows) == 2 * 4 * 2  # ranks x parameters x states
    assert not any(r["fp32"] for r in rows), "a shard fell back to fp32"
    assert all(r["format"].split(":")[0] in ("int4", "lin4nz") for r in rows)
    local = {(r["rank"], r["name"]) for r in rows if r["blocks"] == "local"}
    assert local == {(k, n) for k in (0, 1) for n in ("0.bias", "2.weight", "2.bias")}
    w = next(r for r in rows if (r["rank"], r["name"], r["state"]) == (1, "2.weight", "m"))
    assert "starts at element 480" in w["reason"] and "depend on the world size" in w["reason"]
    losses, single = runs("uneven")["losses"], runs("single-uneven")["losses"]
    assert torch.isfinite(losses).all()
    assert ((losses - single).abs() / single).max() < 0.05  # other blocks, other rounding; same training


def test_ddp_equals_single_process_bit_for_bit(runs):
    ddp, single = runs("ddp"), runs("single-bred-4bit")
    assert torch.equal(ddp["losses"], single["losses"])
    assert_same(ddp, single, "DDP")


@pytest.mark.parametrize("world", [2, 1])
def test_dcp_saved_at_2_loads_bit_for_bit_and_steps_the_same(runs, world):
    saved = runs("dcp-2")
    loaded = runs(f"dcp-{world}")
    assert_same(loaded["loaded"], saved["saved"], f"DCP load at world size {world}")
    assert_same(loaded["loaded_after"], saved["after"], f"next step after loading at world size {world}")


def test_dcp_local_blocks_load_at_their_world_size_and_are_refused_elsewhere(runs):
    assert runs("uneven-reload-2")["same"]
    refused = runs("uneven-reload-1")["refused"]
    assert refused and "saved on other blocks" in refused and "load it at a world size" in refused


def test_fsdp2_recording_loads_as_the_single_process_trace(runs):
    from qstate_cli.trace import load_trace

    out = runs.out
    assert sorted(p.name for p in (out / "rec-fsdp").iterdir()) == ["rank0.pt", "rank1.pt"]
    fsdp, single = load_trace(out / "rec-fsdp"), load_trace(out / "rec-single.pt")
    assert [t.name for t in fsdp.tensors] == [t.name for t in single.tensors]
    assert (fsdp.n_steps, fsdp.step_start) == (single.n_steps, single.step_start) == (3, 1)
    for a, b in zip(fsdp.tensors, single.tensors):
        assert (a.index, a.shape) == (b.index, b.shape)
        assert torch.equal(a.blocks, b.blocks), a.name  # the same sampled global blocks
        assert torch.equal(a.grads, b.grads), a.name
    # (96, 64) = 3 blocks, one of them cut by the shard boundary: both ranks hold a piece of it
    rank1 = torch.load(out / "rec-fsdp" / "rank1.pt", weights_only=True)
    w = next(t for t in rank1["tensors"] if t["name"] == "0.weight")
    assert w["elements"].numel() < single.tensors[0].n_recorded and int(w["elements"][0]) >= 3072


def test_fsdp2_streamed_recording_loads_as_the_single_process_trace(runs):
    from qstate_cli.trace import load_trace

    out = runs.out / "rec-fsdp-stream"
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest-rank0.json", "manifest-rank1.json", "rank0-steps00000001-00000002.pt",
        "rank0-steps00000003-00000003.pt", "rank1-steps00000001-00000002.pt", "rank1-steps00000003-00000003.pt"]
    streamed, single = load_trace(out), load_trace(runs.out / "rec-single.pt")
    assert streamed.n_steps == 3
    for a, b in zip(streamed.tensors, single.tensors):
        assert torch.equal(a.blocks, b.blocks) and torch.equal(a.grads, b.grads), a.name


def test_ddp_records_one_copy(runs):
    from qstate_cli.trace import load_trace

    ddp, single = load_trace(runs.out / "rec-ddp.pt"), load_trace(runs.out / "rec-single.pt")
    assert ddp.meta["rank"] == 0 and ddp.meta["world_size"] == 2
    for a, b in zip(ddp.tensors, single.tensors):
        assert torch.equal(a.grads, b.grads)
