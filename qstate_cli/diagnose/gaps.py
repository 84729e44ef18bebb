"""Steps at which a recorded tensor had no gradient (the trace's `absent` rows, schema.py):
the replay skips them for that tensor, as the optimizer did.

A parameter whose `.grad` is None at a step (an MoE expert, a branch used on some steps
only) is not stepped by torch's optimizers or qstate's: its m, v, stored codes and step
count stay as they were, and it is not updated. The Recorder writes a zero row there and
lists the row in the tensor's `absent` rows. A replay of such a trace, for the fp32 shadow
and every configuration alike:

- keeps, per tensor, the number of its own steps since its last reset (the optimizer's
  per-parameter `since_reset`), and steps each tensor with the bias corrections of that
  count: the tensors present at a step are grouped by count, and the rule runs on each
  group's elements only (index_select, then index_copy back: about one pass over the layout
  per step however the counts spread; 64 tensors x 4,096 elements, 300 steps, each tensor
  absent at half the steps independently, one configuration on one CPU thread: 3.9 s, where
  the whole rule once per distinct count took 15.3 s and the trace without absent rows,
  on the fused path, 1.6-2.4 s). Every replayed rule (AdamW, Adam, Lion, SGD and
  Muon's momentum, which the replay takes before Newton-Schulz) is elementwise, as every
  replay rule must be (it gets a trace's sampled blocks as one flat vector: optim/base.py
  `replay_step`), so a group's elements get the bits the rule gives them over the whole
  layout (tested);
- resets each tensor on its own schedule, as optim/reset.py's ResetPolicy does per
  parameter (should_reset(step, since): since >= the period, checked before each of the
  tensor's own steps): a tensor present at a step with `period` own steps since its last
  reset has its states zeroed there, its stored codes and scales cleared (read as never
  written) and its count restarted; an absent tensor is never reset at its absent step
  (the optimizer does not see it). The statistics see such a reset at those elements only
  (StateStats.on_reset with positions: a code that was not zero changed at that step);
- at a tensor's absent step, holds its states (the values read back, bit for bit) and its
  stored codes and scales (the pieces of a tensor span whole quantization blocks: the
  layout pads each tensor to whole units, layout.py; a state with one scale for the whole
  layout keeps that scale's new value), and gives it a zero update, in the configuration
  and the shadow alike. So the code-stall and staleness statistics see no code change
  there, and no nominal update (its new value is its old one): an absent element-step
  counts as an element without a nominal update that step;
- leaves the absent rows out of the gradient checks (GradientStats with `gaps`): the zero
  share, kurtosis and E[g^2] trend count only the steps each tensor had a gradient;
- runs on the reference rule (Recursion.step) with each state's codec (the fused CPU codec
  where it covers the state): the fused rule and the whole-step kernel (fused_step.py) step
  every element at every step, so they are not used for such a trace. A trace without
  absent rows replays exactly as before (the global schedule below is then every tensor's).

What still follows the replay's global step, not each tensor's own:

- the random streams of stochastic rounding and BReD are keyed by the global step (the
  trace row's optimizer step), as in every replay; qstate's optimizer keys them by the
  parameter's own step count (base.py `step`), so for a tensor that missed steps it draws
  other bits than the optimizer did (nearest rounding and fp32 states match bit for bit);
- the Gaussian staleness model's build-up, c_t = 1 - beta2^(t-1) (step.gaussian_arg),
  counts the shadow's global steps since the global reset schedule (every `period` replayed
  steps), not each tensor's own count.
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
        self.n, self.unit = layout.n, layout.unit
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

    def _spans(self, tensors: tuple, whole: bool, per: int = 1) -> torch.Tensor:
        """int64 positions (per = 1) or storage items (per elements each) of these tensors'
        pieces: their recorded elements, or (whole) their pieces rounded up to whole units."""
        key = (tensors, whole, per)
        idx = self._index.get(key)
        if idx is None:
            spans = []
            for j in tensors:
                for at, count in self.pieces.get(j, ()):
                    end = at + (-(-count // self.unit) * self.unit if whole else count)
                    spans.append(torch.arange(at // per, end // per))
            idx = torch.cat(spans).to(self.device) if spans else torch.zeros(0, dtype=torch.int64,
                                                                               device=self.device)
            self._index[key] = idx
        return idx

    def index(self, tensors: tuple) -> torch.Tensor:
        """int64 positions of these tensors' recorded elements in the layout (part), cached."""
        return self._spans(tensors, False)

    def absent_at(self, i: int) -> tuple:
        """The tensors absent at replay step i."""
        return tuple(np.flatnonzero(self.absent[i]).tolist())

    def missing(self, i: int) -> torch.Tensor | None:
        """Positions of the tensors absent at replay step i (None: none is)."""
        row = self.absent[i]
        return self.index(self.absent_at(i)) if row.any() else None

    def present_counts(self, n_steps: int) -> np.ndarray:
        """Per tensor, at how many of the first n_steps replay steps it had a gradient."""
        return n_steps - self.absent[:n_steps].sum(0)

    def due(self, i: int, counts: np.ndarray, period: int | None) -> tuple:
        """The tensors that reset before replay step i (module docstring): present at i with
        `period` of their own steps since their last reset; their counts restarted here."""
        if period is None:
            return ()
        hit = ~self.absent[i] & (counts >= period)
        counts[hit] = 0
        return tuple(np.flatnonzero(hit).tolist())

    def step(self, rule, g: torch.Tensor, x: dict, counts: np.ndarray, i: int):
        """(direction, new states) of step i with every tensor at its own count (`counts`,
        advanced here for the tensors present); an absent tensor's states held, its direction 0.
        The rule runs on each count's elements only (module docstring: the rules are elementwise)."""
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
            u_k, new_k = rule(g.index_select(0, idx), {s: v.index_select(0, idx) for s, v in x.items()}, k,
                              {s: k == 1 for s in x})
            u.index_copy_(0, idx, u_k)
            for s in new:
                new[s].index_copy_(0, idx, new_k[s])
        return u, new

    def hold(self, i: int, x_hat: torch.Tensor, before: torch.Tensor) -> None:
        """x_hat (a state just stored) back to `before` at the tensors absent at step i."""
        idx = self.missing(i)
        if idx is not None and idx.numel():
            x_hat.index_copy_(0, idx, before.index_select(0, idx))

    # ---- a quantized state's storage over some tensors' pieces --------------------------
    def _storage(self, q, tensors: tuple) -> list:
        """(field, item indices) of q's codes and per-block scales over these tensors' whole
        units (a piece spans whole units, and a unit whole quantization blocks: layout.py);
        a scale shared by the whole layout (a tensor scale) is left out."""
        out = []
        for name in ("codes", "scales"):
            t = getattr(q, name)
            if t is None or not t.numel():
                continue
            if name == "scales" and (q.spec.tensor_scale or t.numel() == 1):
                continue
            per = self.n // t.numel()  # elements per item: 2 for packed 4-bit codes, a block for scales
            if per < 1 or self.n % t.numel() or self.unit % per:
                raise AssertionError(f"{name}: {per} elements per item do not divide the unit {self.unit}")
            out.append((name, self._spans(tensors, True, per)))
        return out

    def save(self, i: int, q) -> list | None:
        """q's codes and scales at the tensors absent at step i, before q stores step i."""
        tensors = self.absent_at(i)
        if not tensors:
            return None
        return [(name, idx, getattr(q, name).index_select(0, idx)) for name, idx in self._storage(q, tensors)]

    def restore(self, q, saved: list | None) -> None:
        """The saved codes and scales back into q (just stored): the absent tensors' storage
        as the optimizer kept it, so the statistics read their codes unchanged."""
        for name, idx, value in saved or ():
            getattr(q, name).index_copy_(0, idx, value)

    def clear(self, q, tensors: tuple) -> None:
        """q's codes and scales over these tensors' pieces back to never-written storage
        (all zero bits, as QuantizedState.reset leaves the whole state)."""
        for name, idx in self._storage(q, tensors):
            getattr(q, name).index_fill_(0, idx, 0)


def absent_counts(trace, n_steps: int) -> dict[str, int]:
    """Per tensor with absent rows among the first n_steps: how many."""
    out = {}
    for t in trace.tensors:
        k = sum(1 for r in t.absent_rows if r < n_steps)
        if k:
            out[t.name] = k
    return out
