"""A subclass that rewrites `update` is stepped by its own rule on every path (optim/rule_traits.py).

Its parent's class attributes describe the parent's rule: AdamW's fused kernel is AdamW's
step, and its `elementwise` lets the tensors it steps be laid end to end (optim/small.py),
cut into chunks (optim/chunked.py) or sharded. A rule that normalises the gradient by its
tensor's mean is none of these, so the default backend must give it, bit for bit, what the
per-tensor reference gives."""
from __future__ import annotations

import pytest
import torch

from qstate_cli.optim import fused, rule_traits
from qstate_cli.optim.optimizers import SGD, Adam, AdamW, Lion, Muon


class MeanNormed(AdamW):
    """AdamW on g / mean|g| over the tensor: not elementwise, and not AdamW's kernel."""

    def update(self, group, p32, g, x_hat, since_reset, first):
        return super().update(group, p32, g / (g.abs().mean() + 1e-12), x_hat, since_reset, first)


class Clipped(AdamW):
    """AdamW on g clipped to [-1, 1]: rewritten, but elementwise, and it says so."""

    elementwise = True

    def update(self, group, p32, g, x_hat, since_reset, first):
        return super().update(group, p32, g.clamp(-1.0, 1.0), x_hat, since_reset, first)


class RowNormedMuon(Muon):
    """Muon with a rewritten `update` and Muon's update_flat (the per-tensor rule no longer)."""

    def update(self, group, p32, g, x_hat, since_reset, first):
        return super().update(group, p32, g / (g.abs().mean() + 1e-12), x_hat, since_reset, first)


def test_the_traits_count_beside_the_rule_they_describe():
    table = {cls.__name__: (rule_traits.elementwise(cls), rule_traits.flat_rule(cls), rule_traits.kernel_is_rule(cls))
             for cls in (AdamW, Adam, Lion, SGD, Muon, MeanNormed, Clipped, RowNormedMuon)}
    assert table == {
        "AdamW": (True, True, True), "Adam": (True, True, True), "Lion": (True, True, True),
        "SGD": (True, True, True), "Muon": (False, True, True),
        "MeanNormed": (False, False, False), "Clipped": (True, True, False), "RowNormedMuon": (False, False, False),
    }


def test_the_fused_paths_leave_a_rewritten_rule_to_the_reference():
    p = torch.nn.Parameter(torch.randn(8192))
    p.grad = torch.randn_like(p)
    for cls in (MeanNormed, Clipped):
        opt = cls([p], states="nearest-4bit")
        why = fused.why_reference(opt, opt.param_groups[0], p, on_cpu=True)
        assert why == f"{cls.__name__} rewrites `update`: AdamW's kernel is not its rule"
    opt = AdamW([p], states="nearest-4bit")
    assert fused.why_reference(opt, opt.param_groups[0], p, on_cpu=True) is None


def _steps(cls, backend: str, states: str, sizes, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    opt = cls(ps, lr=1e-2, states=states, backend=backend)
    for step in range(steps):
        for i, p in enumerate(ps):
            p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (i - step)
        opt.step()
    return [p.detach().clone() for p in ps] + [t.clone() for st in opt.state.values() for t in st.values()
                                                  if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("cls", [MeanNormed, Clipped, RowNormedMuon], ids=lambda c: c.__name__)
@pytest.mark.parametrize("states,sizes", [("fp32", (64, 96, 128)), ("bf16", (64, 96)), ("nearest-4bit", (8192, 4096))],
                         ids=["fp32-small", "bf16", "nearest-4bit"])
def test_a_rewritten_rule_steps_as_the_reference(cls, states, sizes):
    """fp32 and bf16 states: stepped together on any CPU (optim/small.py); 4-bit: the fused CPU
    path where numba runs."""
    if cls is RowNormedMuon:
        sizes = tuple((n // 32, 32) for n in sizes)
    got, want = _steps(cls, "auto", states, sizes), _steps(cls, "reference", states, sizes)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
