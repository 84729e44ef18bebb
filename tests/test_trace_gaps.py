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
