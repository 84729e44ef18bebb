"""The replay's whole-step kernel (kernels/cpu/replay_step.py, diagnose/fused_step.py): whole
replays give the same JSON document and the same final states, bit for bit, with and without
it and through the reference backend, on steps with and without the staleness model, with
resets, over several threads; it runs exactly for the AdamW configurations whose every part
is on the fused CPU path, and any other keeps the separate calls. Skipped without numba."""
import numpy as np
import pytest
import torch

from qstate_cli.diagnose import diagnose, fused_step, replay as replay_mod
from qstate_cli.kernels import cpu
from qstate_cli.kernels.cpu import host, team
from qstate_cli.quant import parse_config
from qstate_cli.trace.schema import Trace, TraceTensor
from test_replay_codec_cpu import bits, comparable, small_trace

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")

FUSED = ["nearest-4bit", "sr-4bit", "bred-4bit", "bnb-8bit", "torchao-4bit", "m=int8:nearest:b64,v=de8u:bred:b32:sbf16",
         "m=e2m1:bred:b64,v=e4m3:nearest:b32:sqrt:sbf16", "bf16-sr", "m=fp16,v=fp16:stochastic:sqrt",  # 16-bit too
         "fp4", "fp8-sr"]  # block-scaled minifloat v: the Gaussian per-element model
# fp32, a state on the reference codec (bf16 under BReD), a 16-bit state beside a 4-bit one
SEPARATE = ["m=fp32,v=de4u:nearest:b128:sqrt", "m=bf16:bred,v=bf16:nearest:sqrt", "m=bf16,v=de4u:nearest:b128"]


def _spy(monkeypatch):
    """Counts the whole-step kernel's steps per configuration: [unruled, ruled (a model step)]."""
    seen = {}
    real = fused_step.step

    def spy(c, sh, g, i, codec_step, ruled=False):
        seen.setdefault(str(c.cfg), [0, 0])[int(ruled)] += 1
        return real(c, sh, g, i, codec_step, ruled)

    monkeypatch.setattr(fused_step, "step", spy)
    return seen


def _replays(monkeypatch, trace, cfgs, reset):
    auto, raw = diagnose(trace, cfgs, reset=reset, backend="auto", keep_states=True)
    with monkeypatch.context() as m:
        m.setattr(fused_step, "fused_step_for", lambda *a: None)
        separate, raw_sep = diagnose(trace, cfgs, reset=reset, backend="auto", keep_states=True)
    return (auto, raw), (separate, raw_sep)


def _same_states(raw_a, raw_b):
    for name, states in raw_b.final_states.items():
        for s, pieces in states.items():
            for a, b in zip(raw_a.final_states[name][s], pieces):
                assert torch.equal(bits(a), bits(b)), f"{name} {s}"


@needs_numba
@pytest.mark.parametrize("reset", ["none", "3"])
def test_replay_records_are_the_same_with_the_whole_step_kernel(reset, monkeypatch):
    """12 steps, the staleness model at every 4th (so both kinds of step run): the documents
    and final states equal those of the separate calls and of the reference backend."""
    monkeypatch.setattr(replay_mod, "model_points", lambda n: 3)
    seen = _spy(monkeypatch)
    trace = small_trace(12)
    cfgs = [parse_config(c) for c in FUSED + SEPARATE]
    (auto, raw), (separate, raw_sep) = _replays(monkeypatch, trace, cfgs, reset)
    assert comparable(auto) == comparable(separate)
    _same_states(raw, raw_sep)
    assert seen == {str(parse_config(c)): [9, 3] for c in FUSED}  # SEPARATE: never
    ref, raw_ref = diagnose(trace, cfgs, reset=reset, backend="reference", keep_states=True)
    assert comparable(auto) == comparable(ref)
    _same_states(raw, raw_ref)
    rows = [r for r in auto["records"] if r.get("stall_rate_predicted_empirical") is not None]
    assert rows, "no record carries the model's prediction"


@needs_numba
def test_whole_step_kernel_over_several_chunks(monkeypatch):
    """Chunks of 512 elements (CHUNK_ELEMENTS is 16,384, more than the test layout's ~7 k
    elements, so elsewhere a call is one chunk): the chunk loop, its rows shifted to each
    chunk's first element (_at), and the model steps' full rows give the reference's records."""
    from qstate_cli.kernels.cpu import replay_step

    monkeypatch.setattr(replay_step, "CHUNK_ELEMENTS", 512)
    monkeypatch.setattr(replay_mod, "model_points", lambda n: 3)
    seen = _spy(monkeypatch)
    made = []
    real = replay_step.FusedAdamStep.__init__

    def spy_init(self, *a, **k):
        real(self, *a, **k)
        made.append(self.chunk * self.unit)

    monkeypatch.setattr(replay_step.FusedAdamStep, "__init__", spy_init)
    trace = small_trace(8)
    cfgs = [parse_config(c) for c in ("nearest-4bit", "bnb-8bit", "bf16-sr")]
    auto, raw = diagnose(trace, cfgs, backend="auto", keep_states=True)
    assert made and set(made) == {512}  # 2 units of 256 (bnb-8bit's block) per chunk
    assert seen == {c: [4, 4] for c in ("nearest-4bit", "bnb-8bit", "bf16-sr")}  # steps of both kinds
    ref, raw_ref = diagnose(trace, cfgs, backend="reference", keep_states=True)
    assert comparable(auto) == comparable(ref)
    _same_states(raw, raw_ref)


@needs_numba
def test_whole_step_kernel_over_several_threads(monkeypatch):
    """Three threads, each its own range of units (the layout's ~7 k elements: 64 per thread
    at least here), give the same documents as the separate calls on one thread."""
    monkeypatch.setattr(replay_mod, "SMALL_LAYOUT", 0)  # else one thread for a small layout
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 64)
    monkeypatch.setattr(replay_mod, "model_points", lambda n: 2)
    seen = _spy(monkeypatch)
    trace = small_trace(8)
    cfgs = [parse_config(c) for c in ("sr-4bit", "bnb-8bit")]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert host.parts_of(4096) == 3
        auto, raw = diagnose(trace, cfgs, backend="auto", keep_states=True)
        torch.set_num_threads(1)
        monkeypatch.setattr(fused_step, "fused_step_for", lambda *a: None)
        separate, raw_sep = diagnose(trace, cfgs, backend="auto", keep_states=True)
    finally:
        torch.set_num_threads(threads)
    assert seen == {"sr-4bit": [6, 2], "bnb-8bit": [6, 2]}  # the model at steps 1 and 5
    assert {**comparable(auto), "env": None} == {**comparable(separate), "env": None}  # env: the thread count
    _same_states(raw, raw_sep)


@needs_numba
def test_a_small_layout_steps_on_numbas_team(monkeypatch):
    """A small layout (torch on one thread) on a 2-thread machine: the whole-step kernel
    splits over numba's OpenMP team (team.py; here from 1,024 elements a thread), on steps
    with and without the model, with resets, and so does the model's pass on bnb-8bit's
    searched code books; the documents and final states equal the reference backend's; the
    replay reports the team's 2 threads."""
    from qstate_cli.kernels.cpu import replay_model, replay_step
    if not team.team_ready(2):
        pytest.skip("numba's threading layer is not OpenMP (or has fewer than 2 threads)")
    monkeypatch.setattr(team, "TEAM_MIN_ELEMENTS", 1024)
    monkeypatch.setattr(replay_mod, "model_points", lambda n: 3)
    teams, models = [], []
    real = replay_step.team_parts
    monkeypatch.setattr(replay_step, "team_parts", lambda n: teams.append(real(n)) or teams[-1])
    monkeypatch.setattr(replay_model, "team_parts", lambda n: models.append(real(n)) or models[-1])
    trace = small_trace(12)
    cfgs = [parse_config(c) for c in ("sr-4bit", "bnb-8bit", "bf16-sr")]
    held = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        auto, raw = diagnose(trace, cfgs, reset="5", backend="auto", keep_states=True)
        ref, raw_ref = diagnose(trace, cfgs, reset="5", backend="reference", keep_states=True)
    finally:
        torch.set_num_threads(held)
    assert teams and set(teams) == {2}
    assert models and set(models) == {2}  # bnb-8bit's de8 and de8u: the others' passes stay on one thread
    assert raw.threads == 2 and raw_ref.threads == 1
    assert {**comparable(auto), "env": None} == {**comparable(ref), "env": None}  # env: the thread count
    _same_states(raw, raw_ref)
    for a, b in zip(raw.configs, raw_ref.configs):
        for s in ("m", "v"):
            for k, v in b.states[s].items():
                assert np.asarray(a.states[s][k]).tobytes() == np.asarray(v).tobytes(), f"{a.cfg} {s} {k}"


@needs_numba
def test_a_team_that_cannot_be_built_leaves_the_one_thread_path(monkeypatch):
    """Where the first team launch fails (a numba whose internals native.call_compiled does
    not know: here compiled_address raises), the team is off for the process and the replay
    steps on one thread, with the reference backend's documents."""
    from qstate_cli.kernels.cpu import native
    if not team.team_ready(2):
        pytest.skip("numba's threading layer is not OpenMP (or has fewer than 2 threads)")

    def broken(*a):
        raise AttributeError("no such internal")

    monkeypatch.setattr(team, "TEAM_MIN_ELEMENTS", 1024)
    monkeypatch.setattr(native, "compiled_address", broken)
    trace, cfgs = small_trace(6), [parse_config(c) for c in ("nearest-4bit", "bnb-8bit")]
    held = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        auto, raw = diagnose(trace, cfgs, backend="auto", keep_states=True)
        assert team._OFF and "no such internal" in team._OFF[0]
        assert team.team_parts(1 << 20) == 1 and raw.threads == 1
    finally:
        team._OFF.clear()
        torch.set_num_threads(held)
    ref, raw_ref = diagnose(trace, cfgs, backend="reference", keep_states=True)
    assert comparable(auto) == comparable(ref)
    _same_states(raw, raw_ref)


def _wide_trace(steps: int, seed: int = 9) -> Trace:
    """Two tensors, ~74 k recorded elements (one partly recorded): a sum to one value over
    the layout splits over 2 threads (torch_sum.GRAIN = 32768)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for i, (shape, blocks) in enumerate([((50000,), list(range(25))), ((30000,), list(range(0, 15, 2)))]):
        t = TraceTensor(f"w{i}", i, shape, torch.tensor(blocks), torch.zeros(0))
        n = t.element_index().numel()
        t.grads = torch.randn(steps, n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
        tensors.append(t)
    return Trace("adamw", {"betas": [0.9, 0.999], "eps": 1e-8, "lr": 1e-3, "weight_decay": 0.0}, 77, 1, steps,
                 "fp32", tensors)


@needs_numba
def test_torch_runs_aside_while_the_kernels_keep_the_threads(monkeypatch):
    """A layout on which torch keeps 2 threads, every configuration on the fused path: inside
    the loop torch's own ops run on one thread (fused_step.torch_aside), the kernels on two,
    and the Gaussian model in two ranges, torch's ops in each; sums to one value of more
    than GRAIN values keep torch's order at 2 threads, so the document and the final states
    equal the reference backend's at 2 threads, also with two configurations stepped side by
    side. Afterwards torch has its 2 threads back."""
    import threading
    from qstate_cli.kernels.cpu import replay_gauss
    monkeypatch.setattr(replay_mod, "SMALL_LAYOUT", 0)  # else one thread for a small layout
    monkeypatch.setattr(replay_mod, "model_points", lambda n: 2)
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1 << 14)  # the layout's ~80 k elements over 2 threads
    seen = []
    real = replay_gauss.gauss_range

    def spy(job, i0, i1):
        seen.append((torch.get_num_threads(), host.threads(), threading.current_thread().name))
        return real(job, i0, i1)

    monkeypatch.setattr(replay_gauss, "gauss_range", spy)
    trace = _wide_trace(6)
    cfgs = [parse_config(c) for c in ("nearest-4bit", "sr-4bit")]
    held = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        auto, raw = diagnose(trace, cfgs, backend="auto", keep_states=True)
        assert torch.get_num_threads() == 2
        both, raw_both = diagnose(trace, cfgs, backend="auto", keep_states=True, config_threads=2)  # side by side
        ref, raw_ref = diagnose(trace, cfgs, backend="reference", keep_states=True)
    finally:
        torch.set_num_threads(held)
    assert {(torch_n, kernels_n) for torch_n, kernels_n, _ in seen} == {(1, 2)}
    assert len({name for _, _, name in seen}) >= 2  # the Gaussian model's ranges, torch's ops in them: two threads
    assert raw.threads == raw_ref.threads == 2
    assert comparable(auto) == comparable(ref)
    _same_states(raw, raw_ref)
    assert comparable(both) == comparable(ref)
    _same_states(raw_both, raw_ref)
    for a, b in zip(raw.configs, raw_ref.configs):  # the sums themselves (the document rounds them)
        for s in ("m", "v"):
            for k in ("empirical", "gaussian", "nominal"):
                assert a.models[s][k].tobytes() == b.models[s][k].tobytes(), f"{a.cfg} {s} {k}"
    for k, v in raw_ref.gradients.items():
        assert np.asarray(raw.gradients[k]).tobytes() == np.asarray(v).tobytes(), k


@needs_numba
def test_configurations_off_the_fused_path_keep_the_separate_calls(monkeypatch):
    """No whole-step kernel for an fp32 state, a state on the reference codec, a 16-bit state
    beside a block-scaled one, an optimizer other than AdamW, --backend reference, or where
    torch's sum order is unknown; the kernel's own check refuses such states too."""
    from qstate_cli.kernels.cpu import replay_step, torch_sum
    made = []
    real = fused_step.fused_step_for
    monkeypatch.setattr(fused_step, "fused_step_for", lambda *a: made.append(real(*a)) or made[-1])
    diagnose(small_trace(3), [parse_config(c) for c in SEPARATE], backend="auto")
    diagnose(small_trace(3), [parse_config("sr-4bit")], backend="reference")
    diagnose(small_trace(3, optimizer="lion"), [parse_config("sr-4bit")], backend="auto")
    assert made and all(m is None for m in made)
    monkeypatch.setattr(torch_sum, "lanes", lambda: None)
    assert replay_step.why_not([], [], 8, 8) == "torch's sum order was not found (torch_sum.lanes)"
    made.clear()
    diagnose(small_trace(3), [parse_config("sr-4bit")], backend="auto")
    assert made == [None]


@needs_numba
@pytest.mark.parametrize("threads", [1, 3])
def test_a_replay_without_state_statistics_keeps_the_update_records(threads, monkeypatch):
    """ReplayOptions(state_stats=False), as validate.py replays a reset's candidates: the
    whole-step kernel (and the separate calls of a configuration off it) store the states
    without counting them; the update's records and the final states are the same bits as
    with every statistic on, and the states' series stay 0 where they are not."""
    from qstate_cli.diagnose.replay import ReplayOptions, replay
    monkeypatch.setattr(replay_mod, "SMALL_LAYOUT", 0)
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 64)
    seen = _spy(monkeypatch)
    trace = small_trace(8)
    cfgs = [parse_config(c) for c in ("sr-4bit", "bnb-8bit", "bf16-sr", "m=bf16,v=de4u:nearest:b128")]
    held = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        raws = [replay(trace, ReplayOptions(cfgs, reset="3", device="cpu", models=False, state_stats=on,
                                            keep_states=True)) for on in (True, False)]
    finally:
        torch.set_num_threads(held)
    assert seen == {"sr-4bit": [16, 0], "bnb-8bit": [16, 0], "bf16-sr": [16, 0]}  # both replays; the last: separate
    full, light = raws
    _same_states(full, light)
    for a, b in zip(full.configs, light.configs):
        assert a.update.keys() == b.update.keys()
        for k in a.update:
            assert torch.equal(torch.as_tensor(a.update[k]), torch.as_tensor(b.update[k])), (str(a.cfg), k)
        for s in ("m", "v"):
            assert (a.states[s]["err2_sum"] > 0).all() and (a.states[s]["nominal"] > 0).any()
            assert not b.states[s]["err2_sum"].any() and not b.states[s]["nominal"].any(), (str(b.cfg), s)
