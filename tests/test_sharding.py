"""Shards quantized on global blocks equal the whole tensor, bit for bit (one process).

The multi-process runs (FSDP2, DDP, DCP on gloo) are in test_distributed.py; here the
layout rule (optim/sharding.py) and the quantizer's global counters are checked directly:
a tensor cut into dim-0 shards, each encoded with its offset, stores exactly the codes
and scales of the whole tensor wherever the cut falls on block boundaries.
"""
from __future__ import annotations

import pytest
import torch

from qstate_cli.optim import AdamW
from qstate_cli.optim.audit import plan_shapes
from qstate_cli.optim.sharding import dim0_layout, position_block
from qstate_cli.quant.config import parse_config, parse_spec
from qstate_cli.quant.quantizer import Stream, decode, encode

SPECS = ["int4:bred:b128", "lin4nz:bred:b128", "int4:stochastic:b64", "int8:nearest:b256", "de4:bred:b128",
         "bf16:bred", "e4m3:stochastic"]


def encode_shards(x: torch.Tensor, spec, world: int, step: int = 3):
    """Each rank's (codes, scales) of x sharded on dim 0, with global counters."""
    out = []
    for rank in range(world):
        lay = dim0_layout(x.shape, world, rank)
        rows = lay.local_shape[0]
        start = lay.offset // lay.row_numel if lay.row_numel else 0
        shard = x[start:start + rows]
        out.append((lay, shard, encode(shard, spec, step, Stream(5, 2, 1, lay.offset))))
    return out


@pytest.mark.parametrize("text", SPECS)
def test_aligned_shards_store_the_whole_tensors_codes(text):
    spec = parse_spec(text)
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(1)) * 1e-3
    x[7, 3] = 1.0  # one block with a large absmax
    whole_codes, whole_scales = encode(x, spec, 3, Stream(5, 2, 1))
    for world in (2, 3, 4):
        shards = encode_shards(x, spec, world)
        assert all(lay.aligned(position_block(spec)) for lay, _, _ in shards)
        codes = torch.cat([c for _, _, (c, _) in shards])
        assert torch.equal(codes, whole_codes), f"{text} world {world}"
        if whole_scales is not None:
            assert torch.equal(torch.cat([s for _, _, (_, s) in shards]), whole_scales)
        # and each shard decodes to the whole tensor's values for its elements
        whole = decode(whole_codes, whole_scales, spec, x.numel(), 3, Stream(5, 2, 1))
        for lay, shard, (c, s) in shards:
            part = decode(c, s, spec, shard.numel(), 3, Stream(5, 2, 1, lay.offset))
            assert torch.equal(part, whole[lay.offset:lay.offset + shard.numel()])


def test_offset_changes_the_dither_so_an_unshifted_shard_would_differ():
    """The counters matter: encoding the second half with offset 0 gives other codes."""
    spec = parse_spec("int4:bred:b128")
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    whole, _ = encode(x, spec, 1, Stream(0, 0, 0))
    wrong, _ = encode(x[2:], spec, 1, Stream(0, 0, 0, 0))
    right, _ = encode(x[2:], spec, 1, Stream(0, 0, 0, 512))
    assert torch.equal(right, whole[256:])
    assert not torch.equal(wrong, whole[256:])


def test_layout_rule():
    # rows of 256 = 2 blocks of 128: whole blocks at any world size
    for world in (2, 3, 5):
        for rank in range(world):
            lay = dim0_layout((10, 256), world, rank)
            assert lay.aligned(128) and lay.world_independent(128)
    # rows of 96: world 2 cuts (10, 96) at row 5 = element 480, inside block 3
    lay = dim0_layout((10, 96), 2, 1)
    assert lay.offset == 480 and not lay.aligned(128) and not lay.world_independent(128)
    assert "starts at element 480" in lay.why_unaligned(128)
    # ... but (16, 96) at world 2 cuts at 768 = 6 blocks: aligned here, not at world 3
    assert dim0_layout((16, 96), 2, 1).aligned(128)
    assert not dim0_layout((16, 96), 3, 1).aligned(128)
    # a rank past the last row holds nothing, and nothing is unaligned about that
    empty = dim0_layout((3, 256), 4, 3)
    assert empty.local_numel == 0 and empty.aligned(128)
    # only counters matter for stochastic rounding without scales; nothing for fp32
    assert position_block(parse_spec("bf16:stochastic")) == 1
    assert position_block(parse_spec("fp32")) is None
    assert position_block(parse_spec("bf16")) is None


def test_plan_reports_every_state_with_its_reason():
    rows = plan_shapes([(64, 256), (10, 96 * 50), (96,), (3, 4096)], parse_config("bred-4bit"), ("m", "v"),
                       world_size=2, rank=1, min_quant_numel=4096)
    by = {(r.tensor_id, r.state): r for r in rows}
    assert len(rows) == 8
    assert by[0, "m"].blocks == "global" and by[0, "m"].world_independent and by[0, "m"].reason == ""
    assert by[0, "m"].format.startswith("int4:bred:b128") and by[0, "m"].local_shape == "32x256"
    assert by[0, "m"].local_bytes == 32 * 256 // 2 + 64 * 4
    # 96 * 50 = 4800 per row: 37.5 blocks; rank 1 starts at row 5 = element 24000 = 187.5 blocks
    assert by[1, "v"].blocks == "local" and not by[1, "v"].fp32
    assert "starts at element 24000" in by[1, "v"].reason and "depend on the world size" in by[1, "v"].reason
    assert by[2, "m"].fp32 and "96 elements < min_quant_numel=4096" in by[2, "m"].reason
    assert by[3, "m"].blocks == "global" and by[3, "m"].local_shape == "1x4096"


def test_audit_of_a_plain_model():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    opt = AdamW(model.parameters(), states="nearest-4bit")
    rows = opt.audit({p: n for n, p in model.named_parameters()})
    assert [r.name for r in rows[:2]] == ["0.weight", "0.weight"]
    w = rows[0]
    # the fused CPU path steps it where numba is installed (the `[cpu]` extra), else the reference
    from qstate_cli.kernels import cpu
    path = cpu.PATH if cpu.unavailable_reason("cpu") is None else "reference"
    assert (w.global_shape, w.local_shape, w.path, w.blocks, w.rank, w.world_size) == (
        "128x64", "128x64", path, "global", 0, 1)
    assert rows[2].fp32 and "128 elements < min_quant_numel" in rows[2].reason


def _piece_trace(elements, grads, name="w"):
    from qstate_cli.trace.schema import Trace, TraceTensor

    t = TraceTensor(name, 3, (96, 64), torch.tensor([1, 2]), grads, None, elements)
    return Trace("adamw", {"lr": 1e-3}, 0, 1, grads.shape[0], "fp32", [t])


def test_rank_pieces_join_into_one_trace_and_incomplete_ones_are_refused(tmp_path):
    from qstate_cli.errors import QstateError
    from qstate_cli.trace import load_trace
    from qstate_cli.trace.io import save_trace
    from qstate_cli.trace.schema import recorded_elements

    want = recorded_elements(torch.tensor([1, 2]), 96 * 64)  # elements 2048..6143
    grads = torch.randn(2, want.numel(), generator=torch.Generator().manual_seed(3))
    cut = 3072 - 2048  # rank 1 of (96, 64) at world size 2 starts at element 3072, inside block 1
    save_trace(_piece_trace(want[cut:], grads[:, cut:]), tmp_path / "rank1.pt")
    with pytest.raises(QstateError, match="not each of its 4096 recorded elements once"):
        load_trace(tmp_path)  # rank 0's piece is missing
    save_trace(_piece_trace(want[:cut], grads[:, :cut]), tmp_path / "rank0.pt")
    trace = load_trace(tmp_path)
    (t,) = trace.tensors
    assert not t.partial and t.index == 3 and torch.equal(t.grads, grads)


def _record(path, steps, flush_steps=None, stop_at=None):
    from qstate_cli.trace import Recorder

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held = []
    try:
        with Recorder(opt, path, model=model, blocks_per_tensor=2, flush_steps=flush_steps) as rec:
            for step in range(steps):
                if step == stop_at:
                    raise KeyboardInterrupt
                g = torch.Generator().manual_seed(step)
                loss = model(torch.randn(8, 64, generator=g)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                held.append(rec.buffered)
    except KeyboardInterrupt:
        pass
    return held


def test_streamed_recording_is_bounded_and_equals_the_whole_one(tmp_path):
    import json

    from qstate_cli.trace import load_trace

    _record(tmp_path / "whole.pt", 7)
    held = _record(tmp_path / "stream", 7, flush_steps=3)
    assert max(held) <= 2  # a chunk is written (and dropped from memory) as soon as its 3rd step is captured
    files = sorted(p.name for p in (tmp_path / "stream").iterdir())
    assert files == ["manifest.json", "steps00000001-00000003.pt", "steps00000004-00000006.pt",
                     "steps00000007-00000007.pt"]
    assert json.loads((tmp_path / "stream" / "manifest.json").read_text())["steps"] == 7
    whole, streamed = load_trace(tmp_path / "whole.pt"), load_trace(tmp_path / "stream")
    assert (streamed.step_start, streamed.n_steps) == (1, 7)
    for a, b in zip(whole.tensors, streamed.tensors):
        assert torch.equal(a.grads, b.grads) and torch.equal(a.blocks, b.blocks)
    # an interrupted run keeps what it recorded; a file the manifest does not list is ignored
    _record(tmp_path / "cut", 7, flush_steps=3, stop_at=5)
    (tmp_path / "cut" / "steps00000009-00000009.pt").write_bytes(b"half-written")
    cut = load_trace(tmp_path / "cut")
    assert cut.n_steps == 5 and torch.equal(cut.tensors[0].grads, whole.tensors[0].grads[:5])


def test_a_dim1_shard_and_a_tensor_scale_are_audited_as_they_are_stored():
    """Shard(1) cuts every row at more than one rank: never the same at every world size, and
    checkpoints always in the per-element form; a tensor scale is the whole tensor's (all-reduced)."""
    from qstate_cli.optim.audit import state_row
    from qstate_cli.optim.sharded_state import rows_form
    from qstate_cli.optim.sharding import ShardLayout

    spec = parse_spec("int4:bred:b128")
    whole = ShardLayout((256, 128), (256, 128), 0, True, True, other_dim=True)  # Shard(1) on a 1-rank mesh
    row = state_row("w", 0, "m", whole, spec, 0, "reference", None, 0, 1)
    assert row.blocks == "global" and not row.world_independent and "a dim other than 0 is sharded" in row.reason
    assert not rows_form(spec, whole) and rows_form(spec, ShardLayout((256, 128), (256, 128), 0, True, True))
    te = plan_shapes([(64, 96)], parse_config("te-fp8"), ("m", "v"), world_size=2, rank=1, min_quant_numel=0)
    assert all(r.world_independent and "all-reduced (MAX)" in r.reason for r in te)
