"""Configurations replayed in parallel (`qstate diagnose --config-threads N`,
diagnose/replay.config_threads_for): the same JSON document and final states, bit for bit, as
one configuration after another, through the reference codec and, where numba is
installed, the fused CPU path with its whole-step kernel; the steps do run on several
threads; a bad count is a one-line usage error before any work."""
import threading

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.diagnose import diagnose, replay as replay_mod
from qstate_cli.kernels import cpu
from qstate_cli.quant import parse_config
from test_replay_codec_cpu import bits, comparable, small_trace

CONFIGS = ["nearest-4bit", "sr-4bit", "bred-4bit", "bnb-8bit", "torchao-4bit", "bf16-sr",
           "m=e2m1:bred:b64,v=e4m3:nearest:b32:sqrt:sbf16"]


def _spy_threads(monkeypatch) -> set:
    seen = set()
    real = replay_mod.step_config

    def spy(*a, **kw):
        seen.add(threading.get_ident())
        return real(*a, **kw)

    monkeypatch.setattr(replay_mod, "step_config", spy)
    return seen


@pytest.mark.parametrize("backend", [
    "reference",
    pytest.param("auto", marks=pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None,
                                                  reason="numba is not installed"))])
def test_configurations_in_parallel_give_the_same_records(backend, monkeypatch):
    """10 steps, a reset every 4 and the staleness model at every 3rd step."""
    monkeypatch.setattr(replay_mod, "model_points", lambda n: 4)
    trace = small_trace(10)
    cfgs = [parse_config(c) for c in CONFIGS]
    one, raw_one = diagnose(trace, cfgs, reset="4", backend=backend, keep_states=True, config_threads=1)
    threads = _spy_threads(monkeypatch)
    many, raw_many = diagnose(trace, cfgs, reset="4", backend=backend, keep_states=True, config_threads=3)
    assert len(threads) > 1, "the configurations ran on one thread"
    assert raw_many.config_threads == 3 and raw_one.config_threads == 1
    assert many["meta"]["profile"]["config_threads"] == 3
    assert comparable(one) == comparable(many)
    for name, states in raw_one.final_states.items():
        for s, pieces in states.items():
            for a, b in zip(pieces, raw_many.final_states[name][s]):
                assert torch.equal(bits(a), bits(b)), f"{name} {s}"
    assert list(many["meta"]["profile"]["phases_s"]) == ["gather", "shadow"] + [str(c) for c in cfgs]


def test_more_threads_than_configurations_use_one_per_configuration():
    _, raw = diagnose(small_trace(2), [parse_config("bf16")], backend="reference", config_threads=8)
    assert raw.config_threads == 1


@pytest.mark.parametrize("bad", ["0", "-2", "1.5", "two"])
def test_a_bad_thread_count_is_a_usage_error(bad, tmp_path):
    out = tmp_path / "d.json"
    res = CliRunner().invoke(app, ["diagnose", "demo", "--config-threads", bad, "--json", str(out)])
    assert res.exit_code == 2, res.output
    assert "--config-threads" in res.output and "1 or more" in res.output.splitlines()[-1]
    assert not out.exists()


@pytest.mark.parametrize("backend", [
    "reference",
    pytest.param("auto", marks=pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None,
                                                  reason="numba is not installed"))])
@pytest.mark.parametrize("reset", ["4", "auto"])  # auto: a shadow per period, sigma^2 cached per shadow
def test_each_step_starts_at_the_next_configuration_with_the_same_records(backend, reset, monkeypatch):
    """Step i steps the configurations from the (i mod k)-th (replay.step_order: the first
    place of a step is slower, and --profile charges it to none in particular); the records
    and final states equal those of the configurations in a fixed order."""
    monkeypatch.setattr(replay_mod, "model_points", lambda n: 4)
    trace = small_trace(7)
    cfgs = [parse_config(c) for c in CONFIGS[:3]]
    order = []
    real = replay_mod.step_config
    monkeypatch.setattr(replay_mod, "step_config", lambda c, *a, **kw: order.append(str(c.cfg)) or real(c, *a, **kw))
    rotated, raw_rotated = diagnose(trace, cfgs, reset=reset, backend=backend, keep_states=True)
    names = [str(c) for c in cfgs]
    assert [order[3 * i] for i in range(7)] == [names[i % 3] for i in range(7)]  # each step's first
    assert order[3:6] == names[1:] + names[:1]
    monkeypatch.setattr(replay_mod, "step_order", lambda configs, i: configs)
    fixed, raw_fixed = diagnose(trace, cfgs, reset=reset, backend=backend, keep_states=True)
    assert comparable(rotated) == comparable(fixed)
    for name, states in raw_fixed.final_states.items():
        for s, pieces in states.items():
            for a, b in zip(pieces, raw_rotated.final_states[name][s]):
                assert torch.equal(bits(a), bits(b)), f"{name} {s}"


def test_step_order_rotates():
    assert replay_mod.step_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert replay_mod.step_order(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert replay_mod.step_order([], 3) == []
