"""Steps at which a recorded tensor had no gradient (the trace's `absent` rows, schema.py):
the replay skips them for that tensor, as the optimizer did.

A parameter whose `.grad` is None at a step (an MoE expert, a branch used on some steps
only) is not stepped by torch's optimizers or qstate's: its m, v and step count stay as
they were, and it is not updated. The Recorder writes a zero row there and lists the row
in the tensor's `absent` rows. A replay of such a trace, for the fp32 shadow and every
configuration alike:

- keeps, per tensor, the number of its own steps since the last reset (the optimizer's
  per-parameter step count), and steps each tensor with the bias corrections of that count:
  the rule runs once per distinct count among the tensors present at the step, each run's
  results kept at those tensors' positions (one run where every tensor has the same count);
- at a tensor's absent step, holds its states (the values read back, bit for bit) and gives
  it a zero update in the configuration and the shadow alike;
- runs on the reference rule (Recursion.step) with each state's codec (the fused CPU codec
  where it covers the state): the fused rule and the whole-step kernel (fused_step.py) step
  every element at every step, so they are not used for such a trace. A trace without
  absent rows replays exactly as before.

Resets follow the replay's global schedule (every N replayed steps) and zero every
tensor's count. The random streams of stochastic rounding and BReD are keyed by the global
step, as in every replay (an optimizer keying them by a skipped parameter's own count draws
other bits for it). The gradient statistics (the zero fraction of `gradient_checks`) still
count the absent rows' zeros; diagnose's meta says how many rows each tensor lacked.
"""
from __future__ import annotations

import numpy as np
import torch

from .layout import Layout


class Gaps:
    """The absent rows of a replay (module docstring) over `layout` (a part's pieces)."""

    def __init__(self, absent: np.ndarray, layout: Layout):
        self.absent = absent  # bool [n_steps, n_tensors]
        self.n_tensors = absent.shape[1]
        self.pieces: dict[int, list[tuple[int, int]]] = {}
        for i, _, count, at in layout.pieces:
            self.pieces.setdefault(i, []).append((at, count))
        self.device = layout.device
        self._index: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def of(trace, layout: Layout, n_steps: int) -> "Gaps | None":
        """The gaps of the first n_steps rows of `trace`, or None where no tensor lacks a row."""
        absent = np.zeros((n_steps, len(trace.tensors)), dtype=bool)
        for j, t in enumerate(trace.tensors):
            rows = [r for r in t.absent_rows if r < n_steps]
            absent[rows, j] = True
        return Gaps(absent, layout) if absent.any() else None

    def counts(self) -> np.ndarray:
        """A fresh per-tensor step count (an owner's: the shadow's or a configuration's)."""
        return np.zeros(self.n_tensors, dtype=np.int64)

    def index(self, tensors: tuple) -> torch.Tensor:
        """int64 positions of these tensors' recorded elements in the layout (part), cached."""
        idx = self._index.get(tensors)
        if idx is None:
            spans = [torch.arange(at, at + count) for j in tensors for at, count in self.pieces.get(j, ())]
            idx = torch.cat(spans).to(self.device) if spans else torch.zeros(0, dtype=torch.int64,
                                                                               device=self.device)
            self._index[tensors] = idx
        return idx

    def missing(self, i: int) -> torch.Tensor | None:
        """Positions of the tensors absent at replay step i (None: none is)."""
        row = self.absent[i]
        return self.index(tuple(np.flatnonzero(row).tolist())) if row.any() else None

    def step(self, rule, g: torch.Tensor, x: dict, counts: np.ndarray, i: int):
        """(direction, new states) of step i with every tensor at its own count (`counts`,
        advanced here for the tensors present); an absent tensor's states held, its direction 0."""
        present = ~self.absent[i]
        counts += present
        groups: dict[int, list[int]] = {}
        for j in np.flatnonzero(present).tolist():
            groups.setdefault(int(counts[j]), []).append(j)
        if len(groups) == 1 and present.all():
            (k,) = groups
            return rule(g, x, k, {s: k == 1 for s in x})
        u = torch.zeros_like(g)
        new = {s: v.clone() for s, v in x.items()}
        for k, tensors in groups.items():
            idx = self.index(tuple(tensors))
            if not idx.numel():
                continue
            u_k, new_k = rule(g, x, k, {s: k == 1 for s in x})
            u.index_copy_(0, idx, u_k.index_select(0, idx))
            for s in new:
                new[s].index_copy_(0, idx, new_k[s].index_select(0, idx))
        return u, new

    def hold(self, i: int, x_hat: torch.Tensor, before: torch.Tensor) -> None:
        """x_hat (a state just stored) back to `before` at the tensors absent at step i."""
        idx = self.missing(i)
        if idx is not None and idx.numel():
            x_hat.index_copy_(0, idx, before.index_select(0, idx))


def absent_counts(trace, n_steps: int) -> dict[str, int]:
    """Per tensor with absent rows among the first n_steps: how many."""
    out = {}
    for t in trace.tensors:
        k = sum(1 for r in t.absent_rows if r < n_steps)
        if k:
            out[t.name] = k
    return out
