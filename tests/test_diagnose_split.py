"""The element split of the replay (diagnose/distributed.py, merge.py) in one process.

N "ranks" are threads that share a barrier in place of torch.distributed's collectives
(all_gather_object, all_reduce MAX), so any N runs in seconds: each replays its unit
range and the merged Replay must equal the one-process replay, stored states bit for bit
(random bits keyed on global indices, a tensor scale's absmax all-reduced) and every row
of the result to 1e-9 relative (counts exactly). The real torchrun run is
tests/test_diagnose_distributed.py.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from diagnose_rows import ROWS, assert_rows_close

from qstate_cli.diagnose.layout import Layout, split_units
from qstate_cli.diagnose.replay import ReplayOptions, replay
from qstate_cli.diagnose.run import with_block_size
from qstate_cli.diagnose.summary import build
from qstate_cli.optim import AdamW
from qstate_cli.quant import parse_config
from qstate_cli.trace import Recorder


class ThreadSplit:
    """distributed.Split's interface over threads: rank `rank` of `size`."""

    def __init__(self, rank: int, size: int, shared: dict, mode: str = "elements"):
        self.rank, self.size, self.mode, self.shared = rank, size, mode, shared

    def _exchange(self, obj) -> list:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = obj
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    def all_gather(self, obj) -> list:
        return self._exchange(obj)

    def max_(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(x)).amax(0)

    def elements(self) -> "ThreadSplit":
        return ThreadSplit(self.rank, self.size, self.shared)


def split_replay(trace, configs, ranks: int, mode="elements", **kw):
    """Every thread's Replay (they must all be the same)."""
    shared = {"slots": [None] * ranks, "barrier": threading.Barrier(ranks, timeout=120)}
    with ThreadPoolExecutor(ranks) as pool:
        futures = [pool.submit(replay, trace, ReplayOptions(configs, split=ThreadSplit(r, ranks, shared, mode), **kw))
                   for r in range(ranks)]
        return [f.result() for f in futures]


@pytest.fixture(scope="module")
def trace():
    """7 AdamW steps on three tensors: 5000 elements (a short last block), 40 x 70, 33."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(5000,), (40, 70), (33,)]]
    opt = AdamW(params, lr=1e-2, seed=5, min_quant_numel=0)
    rec = Recorder(opt, None, blocks_per_tensor=None)
    with rec:
        for t in range(7):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g))
            p.grad[:3] = 0.0  # a few dead elements
            opt.step()
    return rec.trace()


def assert_same_replay(one, parts):
    rows = build(one)
    for raw in parts:
        got = build(raw)
        for key in (*ROWS, "gradient_checks"):
            assert_rows_close(rows[key], got[key], key)
        for cfg, states in one.final_states.items():
            for s, tensors in states.items():
                for x, y in zip(tensors, raw.final_states[cfg][s]):
                    assert torch.equal(x, y), (cfg, s)  # stored states bit for bit
        assert raw.nonfinite_grads == one.nonfinite_grads


def test_split_units_is_contiguous_in_rank_order():
    assert split_units(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert split_units(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]  # more ranks than units: some empty
    assert [b - a for a, b in split_units(63, 5)] == [12, 13, 12, 13, 13]


def test_a_part_holds_its_units_and_their_recorded_elements(trace):
    whole = Layout(trace, 128, "cpu")
    parts = [Layout(trace, 128, "cpu", (r, 3)) for r in range(3)]
    assert [p.units for p in parts] == split_units(whole.total_units, 3)
    assert sum(p.n_valid for p in parts) == whole.n_valid
    assert torch.equal(torch.cat([p.element_index for p in parts]), whole.element_index)
    assert torch.equal(torch.cat([p.unit_tensor for p in parts]), whole.unit_tensor)
    for row in (0, 6):
        assert torch.equal(torch.cat([p.gradients(row) for p in parts]), whole.gradients(row))


@pytest.mark.parametrize("ranks", [2, 3])
def test_element_split_equals_one_process(trace, ranks):
    """Stochastic rounding, BReD and a tensor-scaled format (te-fp8), resets every 3 steps."""
    configs = [parse_config(c) for c in ("bred-4bit", "sr-4bit", "te-fp8", "bnb-8bit")]
    kw = dict(reset="3", keep_states=True)
    one = replay(trace, ReplayOptions(configs, **kw))
    assert_same_replay(one, split_replay(trace, configs, ranks, **kw))


def test_more_ranks_than_units(trace):
    """Blocks of 2048: six units for eight ranks, two of them replay nothing but still join
    the tensor scale's all-reduce."""
    configs = [with_block_size(parse_config(c), 2048) for c in ("bred-4bit", "te-fp8")]
    assert Layout(trace, 2048, "cpu").total_units == 6
    one = replay(trace, ReplayOptions(configs, keep_states=True))
    assert_same_replay(one, split_replay(trace, configs, 8, keep_states=True))


def test_configuration_split_equals_one_process(trace):
    configs = [parse_config(c) for c in ("bred-4bit", "nearest-4bit", "te-fp8")]
    one = replay(trace, ReplayOptions(configs, keep_states=True))
    assert_same_replay(one, split_replay(trace, configs, 2, mode="configs", keep_states=True))


def test_auto_splits_elements_on_large_traces_and_configurations_on_small_ones():
    from qstate_cli.diagnose.distributed import AUTO_ELEMENTS_PER_RANK, auto_mode

    assert auto_mode(24_320, 7, 2) == "configs"                      # the demo trace: 12,160 per rank
    assert auto_mode(162_560, 7, 2) == "elements"                    # small-lm: 81,280 per rank
    assert auto_mode(2 * AUTO_ELEMENTS_PER_RANK, 7, 2) == "elements"
    assert auto_mode(2 * AUTO_ELEMENTS_PER_RANK - 1, 7, 2) == "configs"
    assert auto_mode(24_320, 1, 2) == "elements"                     # one configuration: only elements split


@pytest.mark.parametrize("ranks", [2, 3])
def test_element_split_with_absent_rows_equals_one_process(trace, ranks):
    """A trace whose tensors lack a gradient at some steps (gaps.py): each rank holds its
    pieces, resets each tensor on its own count, keeps the held codes; the gradient checks'
    per-step counts of elements with a gradient add up across the ranks."""
    from dataclasses import replace

    rows = {1: [0, 3, 4], 2: [2, 5]}
    tensors = []
    for j, t in enumerate(trace.tensors):
        grads = t.grads.clone()
        grads[rows.get(j, [])] = 0
        tensors.append(replace(t, grads=grads, absent=torch.tensor(rows[j]) if j in rows else None))
    gappy = replace(trace, tensors=tensors)
    configs = [parse_config(c) for c in ("bred-4bit", "nearest-4bit", "te-fp8", "bnb-8bit")]
    kw = dict(reset="3", keep_states=True)
    one = replay(gappy, ReplayOptions(configs, **kw))
    assert "present" in one.gradients
    assert_same_replay(one, split_replay(gappy, configs, ranks, **kw))
