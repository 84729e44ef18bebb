"""Parameters that share memory (views of one tensor, each a parameter of its own) are stepped
by the reference one after another (optim/aliasing.py): the fused launches and the together
pass, split over threads, read every parameter before writing any and gave other values."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from qstate_cli.optim import aliasing
from qstate_cli.optim.optimizers import AdamW, Muon

N = 8192  # elements per view; host.MIN_THREAD_ELEMENTS is lowered so each launch splits over two threads


def test_overlapping_finds_every_tensor_that_meets_another():
    base = torch.zeros(100)
    a, b, c = base[0:10], base[10:20], base[20:30]  # touching, not overlapping
    assert aliasing.overlapping([a, b, c, torch.zeros(5)]) == set()
    outer, inner, later = base[0:50], base[5:6], base[8:60]
    assert aliasing.overlapping([later, inner, outer, c]) == {id(outer), id(inner), id(later), id(c)}
    # z meets x, which ends after y: a sweep that only compares neighbours in start order misses z
    x, y, z, w = base[0:40], base[5:8], base[20:25], base[60:70]
    assert aliasing.overlapping([w, z, y, x]) == {id(x), id(y), id(z)}
    even, odd = base[0::2], base[1::2]  # interleaved: their byte spans meet
    assert aliasing.overlapping([even, odd]) == {id(even), id(odd)}
    grid = torch.zeros(4, 6)
    left, right = grid[:, :3], grid[:, 3:]  # strided columns: each span runs across the other's rows
    assert aliasing.byte_span(left) == (grid.data_ptr(), grid.data_ptr() + (3 * 6 + 3) * 4)
    assert aliasing.overlapping([left, right]) == {id(left), id(right)}
    assert aliasing.overlapping([base[3:3], base[0:10]]) == set()  # an empty view meets nothing
    # no address of their own (data_ptr 0, as a DTensor's wrapper gives): not overlapping each other
    assert aliasing.overlapping([torch.empty(10, device="meta"), torch.empty(10, device="meta")]) == set()


def _views(seed: int, n: int, device: str):
    base = torch.randn(3 * n // 2, generator=torch.Generator().manual_seed(seed)).to(device)
    return base, torch.nn.Parameter(base[:n]), torch.nn.Parameter(base[n // 2:])  # overlapping by half


def _run(backend: str, states: str, cls=AdamW, steps: int = 3, move_at: int | None = None, n: int = N,
         device: str = "cpu"):
    """Two disjoint parameters, or (move_at None) two overlapping views from the start; with
    move_at, the second parameter is moved onto the first one's memory before that step."""
    base, p1, p2 = _views(0, n, device)
    if move_at is not None:
        p2 = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(1)).to(device))
    kw = {"weight_decay": 0.1} if issubclass(cls, AdamW) else {}
    opt = cls([p1, p2], lr=1e-2, states=states, backend=backend, min_quant_numel=0, **kw)
    for s in range(steps):
        if s == move_at:
            p2.data = base[n // 2:]
        gen = torch.Generator().manual_seed(10 + s)
        p1.grad, p2.grad = (torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device))
        opt.step()
    return base, opt, (p1, p2)


@pytest.fixture
def threads(monkeypatch) -> bool:
    """Every CPU launch over two threads from 1,024 elements (the race the guard prevents);
    False where numba is missing (only the together run's flat copies step then)."""
    if importlib.util.find_spec("numba") is None:
        return False
    from qstate_cli.kernels.cpu import host
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1024)
    monkeypatch.setattr(host, "threads", lambda: 2)
    return True


@pytest.mark.parametrize("states,cls", [("nearest-4bit", AdamW), ("bnb-8bit", AdamW), ("bf16", AdamW),
                                        ("fp32", AdamW), ("bf16", Muon), ("e4m3", AdamW)],
                         ids=["fused-4bit", "fused-8bit", "together-bf16", "together-fp32", "muon-bf16",
                              "together-flat-e4m3"])
def test_overlapping_parameters_step_as_the_reference_steps_them(threads, states, cls):
    """Each route a group's parameters take (a fused launch, the one-pass together run, its
    flat copies: e4m3's, which read every parameter before writing any, so without the guard
    they differ on every run, not only when the threads race)."""
    if not threads and states != "e4m3":
        pytest.skip("numba is not installed: no fused path to guard")
    ref, _, _ = _run("reference", states, cls)
    got, opt, ps = _run("auto", states, cls)
    assert torch.equal(got, ref)
    assert [opt.path_for(p) for p in ps] == ["reference", "reference"]
    if states != "e4m3":  # the reference steps e4m3 states anyway, and why_reference says that first
        assert all(opt.why_reference(p) == aliasing.OVERLAP_REASON for p in ps)


def test_disjoint_parameters_keep_the_cpu_path(threads):
    if not threads:
        pytest.skip("numba is not installed")
    _, opt, ps = _run("auto", "nearest-4bit", move_at=99)  # never moved: disjoint all along
    assert [opt.path_for(p) for p in ps] == ["cpu-numba", "cpu-numba"]


class CountingAdamW(AdamW):
    """AdamW that counts the parameters the reference steps (base.step's _step_param)."""

    def _step_param(self, group, p, tensor_id):
        self.by_reference = getattr(self, "by_reference", 0) + 1
        super()._step_param(group, p, tensor_id)


@pytest.mark.parametrize("states", ["nearest-4bit", "bf16"])
def test_a_parameter_moved_onto_another_leaves_the_steady_step(threads, states):
    """Two steps on disjoint memory (optim/steady.py records the group's launch or together
    run), then the second parameter's .data becomes a view overlapping the first: the two
    steps after it route again, and the reference steps both parameters in each."""
    if not threads:
        pytest.skip("numba is not installed: nothing is recorded as steady")
    ref, _, _ = _run("reference", states, steps=4, move_at=2)
    got, opt, ps = _run("auto", states, CountingAdamW, steps=4, move_at=2)
    assert torch.equal(got, ref)
    assert opt.path_for(ps[1]) == "reference" and opt.by_reference == 4


@pytest.mark.cuda
@pytest.mark.parametrize("states", ["nearest-4bit", "bnb-8bit"])
def test_overlapping_parameters_on_the_gpu_step_as_the_reference(states):
    """The Triton launch too (scripts/gpu_check.sh's cuda_tests stage): 2**20-element views,
    many blocks in flight, so without the guard the launch reads the overlap while writing it."""
    ref, _, _ = _run("reference", states, n=1 << 20, device="cuda")
    got, opt, ps = _run("auto", states, n=1 << 20, device="cuda")
    assert torch.equal(got, ref)
    assert [opt.path_for(p) for p in ps] == ["reference", "reference"]
