"""Steps at which a parameter had no gradient (.grad None): recorded as `absent` rows, and
replayed as the optimizer ran them (skipped: states and step count held); frozen parameters
not recorded; the trace digest."""
from __future__ import annotations

import torch

from qstate_cli.diagnose.run import diagnose
from qstate_cli.quant.config import parse_config
from qstate_cli.trace import Recorder, load_trace
from qstate_cli.trace.schema import digest


def _loop(path, steps=12, seed=0, frozen=False):
    torch.manual_seed(seed)
    m = torch.nn.ModuleDict(dict(a=torch.nn.Linear(32, 64), expert=torch.nn.Linear(64, 64)))
    if frozen:
        m["a"].bias.requires_grad_(False)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.99))
    with Recorder(opt, path, model=m, blocks_per_tensor=None, steps=steps):
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            h = m["a"](torch.randn(8, 32))
            if s % 3 != 1:  # the expert: used on 2 of every 3 steps
                h = m["expert"](h)
            h.pow(2).mean().backward()
            opt.step()
    return m, opt


def test_absent_rows_recorded_and_replayed_as_skipped(tmp_path):
    path = tmp_path / "gaps.pt"
    m, opt = _loop(path)
    trace = load_trace(path)
    by = {t.name: t for t in trace.tensors}
    assert by["expert.weight"].absent_rows == [1, 4, 7, 10]
    assert by["a.weight"].absent is None
    assert int(opt.state[m["expert"].weight]["step"]) == 8
    doc, raw = diagnose(trace, [parse_config("fp32")], device="cpu", keep_states=True)
    assert doc["meta"]["absent_steps"] == {"expert.weight": 4, "expert.bias": 4}
    assert any("expert.weight: no gradient at 4 of 12" in n for n in doc["meta"]["notes"])
    final = raw.final_states["fp32"]
    for j, t in enumerate(trace.tensors):
        p = dict(m.named_parameters())[t.name]
        st = opt.state[p]
        torch.testing.assert_close(final["m"][j], st["exp_avg"].reshape(-1), rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(final["v"][j], st["exp_avg_sq"].reshape(-1), rtol=1e-5, atol=1e-10)
    # the same trace replayed as if the rows were real zero gradients decays m and v 4 more times
    for t in trace.tensors:
        t.absent = None
    _, zero = diagnose(trace, [parse_config("fp32")], device="cpu", keep_states=True)
    j = [t.name for t in trace.tensors].index("expert.weight")
    assert not torch.allclose(zero.final_states["fp32"]["v"][j], final["v"][j], rtol=1e-3)


def test_absent_rows_survive_save_load_and_quantized_replay(tmp_path):
    path = tmp_path / "gaps.pt"
    _loop(path)
    trace = load_trace(path)
    doc, _ = diagnose(trace, [parse_config("nearest-4bit"), parse_config("bred-4bit")], device="cpu")
    assert doc["meta"]["absent_steps"]["expert.bias"] == 4
    assert all(r["trace_digest"] == doc["meta"]["trace_digest"] and r["seed"] == trace.seed
               for r in doc["records"])


def test_frozen_parameters_not_recorded(tmp_path, capsys):
    path = tmp_path / "frozen.pt"
    _loop(path, frozen=True)
    names = [t.name for t in load_trace(path).tensors]
    assert "a.bias" not in names and "a.weight" in names
    assert "not recording 1 frozen parameter(s)" in capsys.readouterr().err


def test_digest_ignores_meta_and_follows_the_gradients(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    _loop(a, seed=3)
    _loop(b, seed=3)
    ta, tb = load_trace(a), load_trace(b)
    ta.meta["created"], tb.meta["created"] = "then", "now"
    assert digest(ta) == digest(tb)
    tb.meta["argv"] = ["other"]
    from qstate_cli.trace.io import save_trace

    save_trace(tb, b)
    assert a.read_bytes() != b.read_bytes()
    assert digest(load_trace(b)) == digest(ta)
    g = tb.tensors[0].grads.clone()
    g[3, 5] += 1e-3
    tb.tensors[0].grads = g
    assert digest(tb) != digest(ta)


def test_absent_rows_of_streamed_files_join(tmp_path):
    whole, streamed = tmp_path / "whole.pt", tmp_path / "dir"
    _loop(whole, seed=1)
    torch.manual_seed(1)
    m = torch.nn.ModuleDict(dict(a=torch.nn.Linear(32, 64), expert=torch.nn.Linear(64, 64)))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.99))
    with Recorder(opt, streamed, model=m, blocks_per_tensor=None, steps=12, flush_steps=5):
        for s in range(12):
            opt.zero_grad(set_to_none=True)
            h = m["a"](torch.randn(8, 32))
            if s % 3 != 1:
                h = m["expert"](h)
            h.pow(2).mean().backward()
            opt.step()
    a, b = load_trace(whole), load_trace(streamed)
    assert [t.absent_rows for t in b.tensors] == [t.absent_rows for t in a.tensors]
    assert digest(a) == digest(b)


# ---- review fixes: per-tensor resets, held codes, gradient checks, versions, grouped rule ----

import numpy as np
import pytest

from qstate_cli.diagnose import gaps as gaps_mod
from qstate_cli.diagnose.stats import StateStats, stored_code
from qstate_cli.optim import AdamW
from qstate_cli.trace.schema import PLAIN_VERSION, SCHEMA_VERSION, Trace, TraceTensor, from_dict

from test_diagnose import stored


def _qstate_run(cfg, reset, steps=14, absent=(0, 3, 4, 9)):
    """qstate's AdamW over two tensors, the second without a gradient at `absent` steps."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(5000,), (40, 70)]]
    opt = AdamW(params, lr=1e-2, states=cfg, seed=11, min_quant_numel=0, reset=reset)
    rec = Recorder(opt, None, blocks_per_tensor=None)
    with rec:
        for t in range(steps):
            for k, p in enumerate(params):
                p.grad = None if k == 1 and t in absent else torch.randn(p.shape, generator=g) * (1 + 0.1 * t)
            opt.step()
    return params, opt, rec.trace()


@pytest.mark.parametrize("cfg, reset", [("nearest-4bit", 5), ("fp32", 5), ("nearest-4bit", 3), ("fp32", None)])
def test_each_tensor_resets_on_its_own_count_as_the_optimizer(cfg, reset):
    params, opt, trace = _qstate_run(cfg, reset)
    assert trace.tensors[1].absent_rows == [0, 3, 4, 9]
    _, raw = diagnose(trace, [parse_config(cfg)], reset=reset or "none", keep_states=True, device="cpu")
    name = str(parse_config(cfg))
    for j, (p, t) in enumerate(zip(params, trace.tensors)):
        for s in ("m", "v"):
            ours = raw.final_states[name][s][j]
            ref = stored(opt, p, s, j)[t.element_index()]
            ref = ref.clamp(min=0) if s == "v" else ref
            assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), (t.name, s)


def test_a_held_tensor_keeps_its_codes_and_a_reset_is_its_own(monkeypatch):
    """The statistics read the stored codes: at an absent step a held tensor's are the ones
    it had (no re-encode of its old value, which moves BReD's codes); a per-tensor reset
    marks only that tensor's codes changed."""
    _, _, trace = _qstate_run("bred-4bit", 5)
    seen, resets = [0, 0], []
    observe, on_reset, gaps_step = StateStats.observe, StateStats.on_reset, gaps_mod.Gaps.step
    where = {}

    def step(self, rule, g, x, counts, i):
        where["gaps"] = self
        return gaps_step(self, rule, g, x, counts, i)

    def spy(self, i, x, prev, new, shadow, sx2, storage):
        idx = where["gaps"].missing(i)
        if idx is not None and i > 0:
            code = stored_code(storage, self.spec, self.layout.n).index_select(0, idx)
            seen[0] += int((code != self.prev_code.to(torch.int32).index_select(0, idx)).sum())
            seen[1] += idx.numel()
        return observe(self, i, x, prev, new, shadow, sx2, storage)

    def spy_reset(self, i, positions=None):
        resets.append((i, None if positions is None else positions.numel()))
        return on_reset(self, i, positions)

    monkeypatch.setattr(gaps_mod.Gaps, "step", step)
    monkeypatch.setattr(StateStats, "observe", spy)
    monkeypatch.setattr(StateStats, "on_reset", spy_reset)
    diagnose(trace, [parse_config("bred-4bit")], reset=5, device="cpu")
    assert seen[1] > 0 and seen[0] == 0
    # tensor 0 (5000 elements) resets before replay steps 5 and 10 (i = 5, 10); tensor 1
    # (2800, absent at 0, 3, 4, 9) after 5 own steps: before replay step 8 (i = 8); per state
    assert sorted(set(resets)) == [(5, 5000), (8, 2800), (10, 5000)]


def _gauss_trace(absent: bool, steps=40, n=4096, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = []
    for j in range(T):
        gr = torch.randn(steps, n, generator=g)
        rows = None
        if absent and j % 2:
            mask = torch.rand(steps, generator=g) < 0.5
            gr[mask] = 0
            rows = torch.nonzero(mask).flatten()
        ts.append(TraceTensor(f"e{j}", j, (n,), torch.arange(n // 2048), gr, absent=rows))
    return Trace("adamw", {"betas": [0.9, 0.999], "eps": 1e-8}, 0, 1, steps, "fp32", ts)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_gradient_checks_leave_absent_rows_out(backend):
    doc, raw = diagnose(_gauss_trace(True), [parse_config("nearest-4bit")], device="cpu", backend=backend)
    assert raw.gradients["present"].max() == 4096 * 4 and raw.gradients["present"].min() >= 4096 * 2
    checks = doc["meta"]["gradient_checks"]
    assert checks["grad_zero_share"] == 0.0
    assert 2.5 < checks["grad_kurtosis_pooled"] < 3.5
    assert 0.5 < checks["grad_g2_trend"] < 2.0
    assert not any("exactly 0" in f for f in checks["failed"])
    _, plain = diagnose(_gauss_trace(False), [parse_config("nearest-4bit")], device="cpu", backend=backend)
    assert "present" not in plain.gradients  # no absent rows: as before


def test_schema_version_2_only_with_absent_rows(tmp_path):
    from qstate_cli.trace.io import save_trace

    assert (PLAIN_VERSION, SCHEMA_VERSION) == (1, 2)
    plain, gappy = _gauss_trace(False, steps=6), _gauss_trace(True, steps=6)
    assert plain.to_dict()["schema_version"] == 1 and gappy.to_dict()["schema_version"] == 2
    for t in (plain, gappy):
        save_trace(t, tmp_path / "t.pt")
        back = load_trace(tmp_path / "t.pt")
        assert [x.absent_rows for x in back.tensors] == [x.absent_rows for x in t.tensors]
    obj = gappy.to_dict()
    obj["schema_version"] = 1  # what the first qstate recording absent rows wrote: still read
    assert [x.absent_rows for x in from_dict(obj, "v1").tensors] == [x.absent_rows for x in gappy.tensors]


def _old_step(rule, absent_row, g, x, counts, index):
    """Gaps.step before the grouped rule: the whole layout once per distinct count."""
    present = ~absent_row
    counts += present
    groups = {}
    for j in np.flatnonzero(present).tolist():
        groups.setdefault(int(counts[j]), []).append(j)
    u = torch.zeros_like(g)
    new = {s: v.clone() for s, v in x.items()}
    for k, tensors in groups.items():
        idx = index(tuple(tensors))
        u_k, new_k = rule(g, x, k, {s: k == 1 for s in x})
        u.index_copy_(0, idx, u_k.index_select(0, idx))
        for s in new:
            new[s].index_copy_(0, idx, new_k[s].index_select(0, idx))
    return u, new


@pytest.mark.parametrize("optimizer, hp", [("adamw", {"betas": [0.9, 0.999], "eps": 1e-8}),
                                           ("lion", {"betas": [0.9, 0.99]}),
                                           ("sgd", {"momentum": 0.9, "nesterov": True}),
                                           ("muon", {"momentum": 0.95, "nesterov": True})])
def test_grouped_rule_gives_the_whole_layouts_bits(optimizer, hp):
    from qstate_cli.diagnose.layout import Layout
    from qstate_cli.diagnose.recursions import recursion_for

    trace = _gauss_trace(True, steps=12, n=2048 * 3, T=6)
    trace.optimizer, trace.hparams = optimizer, hp
    rec = recursion_for(optimizer, hp)
    layout = Layout(trace, 128, "cpu")
    gaps = gaps_mod.Gaps.of(trace, layout, trace.n_steps)
    gaps.absent[5, :] = [True, False, False, True, False, False]  # counts spread over several groups
    gen = torch.Generator().manual_seed(1)
    x_new = {s: torch.randn(layout.n, generator=gen).abs() for s in rec.states}
    x_old = {s: v.clone() for s, v in x_new.items()}
    c_new, c_old = gaps.counts(), gaps.counts()
    for i in range(trace.n_steps):
        g = layout.gradients(i)
        u1, x_new = gaps.step(rec.step, g, x_new, c_new, i)
        u0, x_old = _old_step(rec.step, gaps.absent[i], g, x_old, c_old, gaps.index)
        assert torch.equal(u1.view(torch.int32), u0.view(torch.int32))
        for s in rec.states:
            assert torch.equal(x_new[s].view(torch.int32), x_old[s].view(torch.int32))
