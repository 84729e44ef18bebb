"""The replay engine: bit-exact parity with the reference optimizers, drift and stalling
against bounds from the math, statistics identities, the suite hook."""
import math

import numpy as np
import pytest
import torch

from qstate_cli import theory
from qstate_cli.diagnose import diagnose, select_configs
from qstate_cli.diagnose.recommend import observed_period, recommend
from qstate_cli.errors import QstateError
from qstate_cli.optim import SGD, AdamW, Lion, Muon
from qstate_cli.quant import QuantizedState, Stream, parse_config, parse_spec
from qstate_cli.suites import hook_for
from qstate_cli.trace import Recorder, save_trace
from qstate_cli.trace.schema import Trace, TraceTensor


def diagnose_point(params):
    """A suite point of kind diagnose (what `qstate run` calls)."""
    return hook_for("diagnose")(params)


def run_reference(opt_factory, shapes, steps, blocks_per_tensor=None, seed=0, zero_every=0):
    """Step a reference optimizer on random gradients while recording them (every
    `zero_every`-th element's gradient 0, if set)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = opt_factory(params)
    rec = Recorder(opt, None, blocks_per_tensor=blocks_per_tensor)
    with rec:
        for t in range(steps):
            for p in params:
                scale = torch.exp(torch.randn(p.shape, generator=g))  # a spread of magnitudes
                p.grad = torch.randn(p.shape, generator=g) * scale * (1 + 0.1 * t)
                if zero_every:
                    p.grad.view(-1)[::zero_every] = 0.0
            opt.step()
    return params, opt, rec.trace()


def stored(opt, p, name, tensor_id):
    spec = opt.spec_for(opt.param_groups[0], p, name)
    q = QuantizedState.from_tensors(spec, p.shape, Stream(opt.param_groups[0]["seed"], tensor_id, 0 if name == "m" else 1),
                                    opt.state[p][name])
    return q.decode().reshape(-1)


@pytest.mark.parametrize("cfg, reset, blocks", [
    ("bred-4bit", None, None),
    ("sr-4bit", 3, None),
    ("torchao-4bit", None, None),
    ("bf16-sr", None, None),
    ("m=e4m3:bred:b64,v=e2m2:stochastic:b32", None, 1),  # sampled blocks: still the same bits
])
def test_replay_stores_what_the_reference_adamw_stores_bit_for_bit(cfg, reset, blocks):
    shapes = [(5000,), (40, 70), (33,)]  # 3 blocks of 2048 (short last), short blocks, a tiny tensor
    params, opt, trace = run_reference(
        lambda ps: AdamW(ps, lr=1e-2, states=cfg, seed=11, min_quant_numel=0, reset=reset), shapes, 7, blocks)
    assert trace.seed == 11
    doc, raw = diagnose(trace, [parse_config(cfg)], reset=reset or "none", keep_states=True)
    name = str(parse_config(cfg))
    for j, (p, t) in enumerate(zip(params, trace.tensors)):
        idx = t.element_index()
        for s in ("m", "v"):
            ours = raw.final_states[name][s][j]
            ref = stored(opt, p, s, j)[idx]
            mismatch = torch.nonzero(ours.view(torch.int32) != ref.view(torch.int32)).flatten()
            assert mismatch.numel() == 0, f"{t.name} {s}: first mismatches at {mismatch[:5].tolist()}"
    assert {r["state"] for r in doc["records"]} == {"m", "v"}


def test_replay_clamps_a_v_read_back_below_zero_as_the_optimizer_does():
    """A signed grid without a zero code (de8nz) rounds v = 0 stochastically to -l or +l:
    v reads back below 0 about half the time. The optimizer clamps v read back at 0
    (optim/base.py); the replay must too, or its v and m drift from what the optimizer stores."""
    cfg = "m=int4:nearest:b128,v=de8nz:stochastic:b256"
    params, opt, trace = run_reference(lambda ps: AdamW(ps, lr=1e-2, states=cfg, seed=11, min_quant_numel=0),
                                       [(4096,)], 5, zero_every=2)
    assert (stored(opt, params[0], "v", 0) < 0).any()  # the case the clamp is for occurs
    _, raw = diagnose(trace, [parse_config(cfg)], keep_states=True)
    idx = trace.tensors[0].element_index()
    for s in ("m", "v"):  # the replay keeps v as read back and clamped, as the optimizer uses it
        ours, ref = raw.final_states[str(parse_config(cfg))][s][0], stored(opt, params[0], s, 0)[idx]
        ref = ref.clamp(min=0.0) if s == "v" else ref
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), s


@pytest.mark.parametrize("factory", [
    lambda ps: SGD(ps, lr=0.1, momentum=0.9, states="bred-4bit", seed=2, min_quant_numel=0),
    lambda ps: Lion(ps, lr=1e-3, states="sr-4bit", seed=3, min_quant_numel=0),
    lambda ps: Muon(ps, lr=0.02, states="m=e4m3:bred:b128", seed=4, min_quant_numel=0),
], ids=["sgd", "lion", "muon"])
def test_replay_matches_the_reference_momentum_optimizers(factory):
    params, opt, trace = run_reference(factory, [(3000,), (48, 40)], 6)
    cfg = parse_config(opt.param_groups[0]["states"])
    _, raw = diagnose(trace, [cfg], keep_states=True)
    for j, p in enumerate(params):
        assert torch.equal(raw.final_states[str(cfg)]["m"][j], stored(opt, p, "m", j))


def constant_trace(g: torch.Tensor, steps: int, beta1=0.9, beta2=0.999, optimizer="adamw") -> Trace:
    """Every step the same gradient g (1-D, one tensor)."""
    grads = g.float().expand(steps, -1).contiguous()
    t = TraceTensor("w", 0, (g.numel(),), torch.arange(-(-g.numel() // 2048)), grads)
    return Trace(optimizer, {"betas": [beta1, beta2], "eps": 1e-8}, 0, 1, steps, "fp32", [t])


def test_nearest_drifts_like_b_over_1_minus_beta_and_bred_does_not():
    """m starts at 1 (first step: g = 1 / (1 - beta)), then a constant gradient 1 + delta, with (1 - beta)
    delta under half a bf16 spacing (2**-8 at 1): nearest stalls every step, so the stored m
    stays 1 while the fp32 m -> 1 + delta. Per-step bias b = -(1 - beta) delta accumulates
    to E_t = -delta (1 - beta**t) = b (1 - beta**t) / (1 - beta): drift / shadow rms exactly.
    BReD's error is zero-mean: |drift| within 5 standard errors."""
    n, steps, beta, delta = 8192, 60, 0.9, 0.03
    grads = torch.full((steps, n), 1.0 + delta)
    grads[0] = 1.0 / (1 - beta)
    t = TraceTensor("w", 0, (n,), torch.arange(n // 2048), grads)
    trace = Trace("adamw", {"betas": [beta, 0.999]}, 0, 1, steps, "fp32", [t])
    cfgs = [parse_config("m=bf16:nearest,v=fp32"), parse_config("m=bf16:bred,v=fp32")]
    doc, _ = diagnose(trace, cfgs)
    series = {(r["config"], r["state"], r["step"]): r for r in doc["series"]}
    near, bred = str(cfgs[0]), str(cfgs[1])
    shadow = [1.0]
    for _ in range(steps - 1):
        shadow.append(beta * shadow[-1] + (1 - beta) * (1 + delta))
    for step in (2, 10, 30, steps):
        k = step - 1  # steps since m was 1
        expected = -delta * (1 - beta ** k) / shadow[step - 1]
        assert series[(near, "m", step)]["drift"] == pytest.approx(expected, rel=1e-3)
        assert series[(near, "m", step)]["stall_rate"] == 1.0
    rec = {(r["config"], r["state"]): r for r in doc["records"]}
    assert rec[(near, "m")]["drift_final"] == pytest.approx(-delta * (1 - beta ** (steps - 1)) / shadow[-1], rel=1e-3)
    assert rec[(near, "m")]["staleness_max"] == steps - 1
    # BReD: each stored value carries error uniform over one spacing (2**-7 at 1 .. 2), shared
    # by a dither block of 128: n / 128 independent errors of variance <= (2**-7)^2 / 12 each
    # step, EMA-accumulated: var(E) <= s^2 / 12 / (1 - beta^2)
    se = (2 ** -7) / math.sqrt(12 * (1 - beta ** 2)) / math.sqrt(n / 128) / 1.0
    assert abs(rec[(bred, "m")]["drift_final"]) < 5 * se
    assert abs(rec[(bred, "m")]["drift_mean"]) < 5 * se
    assert rec[(bred, "m")]["stall_rate"] < 0.01
    assert abs(rec[(near, "m")]["drift_final"]) > 20 * se  # the contrast is not marginal


def test_aggregate_error_grows_like_d_for_bias_and_sqrt_d_for_noise():
    """m under signed 4-bit codes, one element per 128-block at 8.0 (absmax: delta = 8/7) and
    the rest at 0.34..0.48 delta: nearest rounding stores them all as 0, a coherent bias
    (aggregate error ~ d: slope ~1, drift ~ -mean/rms). BReD's error is zero-mean dither
    noise, one dither per block and step: per block var <= delta^2/12 per step, EMA-
    accumulated to delta^2 / (12 (1 - beta^2)), so over B blocks
    SE(drift) <= delta / sqrt(12 (1 - beta^2) B) / rms(m). It must be within 4 SE of 0,
    nearest's drift beyond it, and BReD's aggregate error grows like sqrt(d) across blocks.
    For v, BReD without the sqrt domain reads back below 0 and is clamped: a positive
    bias, which the drift shows."""
    n, steps, beta = 16384, 60, 0.9
    delta = 8.0 / 7
    gen = torch.Generator().manual_seed(0)
    g = (0.34 + 0.14 * torch.rand(n, generator=gen)) * delta
    g[::128] = 8.0
    trace = constant_trace(g, steps, beta1=beta)
    near, bred = parse_config("m=int4:nearest:b128,v=uint4:nearest:b128"), parse_config("m=int4:bred:b128,v=uint4:bred:b128")
    doc, _ = diagnose(trace, [near, bred])
    rec = {(r["config"], r["state"]): r for r in doc["records"]}
    rms = float(g.pow(2).mean().sqrt()) * (1 - beta ** steps)
    se = delta / math.sqrt(12 * (1 - beta ** 2) * (n // 128)) / rms
    assert abs(rec[(str(bred), "m")]["drift_final"]) < 4 * se
    assert abs(rec[(str(bred), "m")]["drift_mean"]) < 4 * se
    small_mean = float(g[g < 8].sum()) / n
    assert rec[(str(near), "m")]["drift_final"] == pytest.approx(-small_mean / rms, rel=0.02)
    assert rec[(str(near), "m")]["drift_final"] < -4 * se
    assert rec[(str(near), "m")]["dim_slope"] > 0.9
    assert 0.35 < rec[(str(bred), "m")]["dim_slope"] < 0.65
    assert rec[(str(bred), "v")]["drift_final"] > 0.05  # the clamp's cost


@pytest.mark.parametrize("cfg", ["bred-4bit", "bf16"])
def test_a_configurations_numbers_do_not_depend_on_the_configurations_beside_it(cfg):
    """The layout's unit is the largest block of the configurations replayed together (128 for
    either alone, 2048 beside a b2048 one), and tensors of 9000, 2800, 33
    and 6000 elements end between units. Padding, sums per unit and the dimension statistic's
    chunks move with it; a configuration's records must not: its dimension statistic (chunks on
    trace blocks, fp64, over per-tensor RMS from fp32 sums) to 1e-6, its counts exactly, its
    fp32 sums to their rounding."""
    _, _, trace = run_reference(lambda ps: AdamW(ps, lr=1e-2, states="fp32", seed=3), [(9000,), (40, 70), (33,), (6000,)], 8)
    wide = "m=int8:nearest:b2048,v=lin8nz:nearest:b2048"
    alone, _ = diagnose(trace, select_configs([cfg]))
    beside, _ = diagnose(trace, select_configs([cfg, wide]))
    rows = {k: [r for r in beside[k] if r.get("config") == cfg] for k in alone if isinstance(alone[k], list)}
    assert len(alone["dim_scaling"]) == len(rows["dim_scaling"]) >= 2 * 13  # d = 1 .. 4096, m and v
    for a, b in zip(alone["dim_scaling"], rows["dim_scaling"]):
        assert a["d"] == b["d"] and a["rms_sum"] == pytest.approx(b["rms_sum"], rel=1e-6)
    for key in ("records", "series", "histograms", "per_code", "per_tensor"):
        assert len(alone[key]) == len(rows[key]), key
        for a, b in zip(alone[key], rows[key]):
            assert a.keys() == b.keys()
            for k, x in a.items():
                if k == "rank":  # among the configurations replayed: the one field that should differ
                    continue
                if k == "dim_slope":
                    assert x == pytest.approx(b[k], rel=1e-6), (key, k)
                elif isinstance(x, float):
                    assert x == pytest.approx(b[k], rel=1e-4, abs=1e-8), (key, a.get("state"), k)
                else:
                    assert x == b[k], (key, a.get("state"), k)


def test_observed_bf16_stall_rate_follows_the_staleness_model():
    """Gaussian gradients with per-element sigma^2 spread over a binade, beta2 = 0.99: after
    the build-up (~3/(1-beta2) steps) the observed stall rate of a bf16 v matches P_NR and
    P_SR of theory.py; the replay's predicted series is the theory's curve."""
    n, steps, beta2 = 8192, 400, 0.99
    gen = torch.Generator().manual_seed(1)
    sigma = (2.0 ** torch.rand(n, generator=gen)).sqrt()
    grads = torch.randn(steps, n, generator=gen) * sigma
    trace = Trace("adamw", {"betas": [0.9, beta2]}, 0, 1, steps, "fp32",
                  [TraceTensor("w", 0, (n,), torch.arange(n // 2048), grads)])
    doc, _ = diagnose(trace, select_configs(["bf16", "bf16-sr"]))
    for name, rounding in (("bf16", "nearest"), ("bf16-sr", "stochastic")):
        rows = [r for r in doc["series"] if r["config"] == name and r["state"] == "v"]
        tail = [r for r in rows if r["step"] > 300]
        observed = np.mean([r["stall_rate"] for r in tail])
        predicted = float(theory.stall_probability(parse_spec(f"bf16:{rounding}"), beta2))
        se = math.sqrt(predicted * (1 - predicted) / n)  # per-step counts are correlated in time
        assert abs(observed - predicted) < 5 * se + 0.02, (name, observed, predicted)
        curve = theory.stall_curve(parse_spec(f"bf16:{rounding}"), beta2, steps)
        assert [r["stall_rate_predicted"] for r in rows] == pytest.approx(curve.tolist())


def test_statistics_identities_and_nonfinite_gradients():
    n, steps = 4096, 30
    gen = torch.Generator().manual_seed(2)
    grads = torch.randn(steps, n, generator=gen)
    grads[5, 7] = float("nan")
    grads[9, 100:103] = float("inf")
    trace = Trace("adamw", {"betas": [0.9, 0.999]}, 0, 1, steps, "fp32",
                  [TraceTensor("w", 0, (n,), torch.arange(2), grads)])
    doc, _ = diagnose(trace, select_configs(["nearest-4bit", "fp32"]))
    assert doc["meta"]["nonfinite_grads"] == 4
    big = grads.clone()  # step 20's elements all finite but summing past fp32's range, and one more inf
    big[20, :64], big[21, 0] = 3e38, float("-inf")
    trace_big = Trace("adamw", {"betas": [0.9, 0.999]}, 0, 1, steps, "fp32",
                      [TraceTensor("w", 0, (n,), torch.arange(2), big)])
    assert diagnose(trace_big, select_configs(["bf16"]))[0]["meta"]["nonfinite_grads"] == 5
    for r in doc["records"]:
        assert r["nonfinite_grads"] == 4
    for r in doc["series"]:
        if r["config"] == "nearest-4bit":
            assert r["rel_rms_error"] ** 2 == pytest.approx(r["drift"] ** 2 + r["error_var"], rel=1e-6, abs=1e-12)
            assert math.isfinite(r["update_cosine"])
    fp32 = [r for r in doc["records"] if r["config"] == "fp32"]
    assert all(r["rel_rms_error"] == 0 and r["update_cosine"] == pytest.approx(1) and r["stall_rate"] == 0
               for r in fp32)
    keys = {"config", "state", "format", "rounding", "bits", "numel", "steps", "drift_final", "drift_mean",
            "drift_max_abs", "rel_rms_error", "error_var", "dim_slope", "stall_rate", "stall_rate_predicted",
            "staleness_mean", "staleness_p50", "staleness_p90", "staleness_max", "update_cosine",
            "update_rel_error", "nonfinite_grads", "reset_period", "reset_reason"}
    assert keys <= set(doc["records"][0])
    hist = doc["histograms"][0]
    assert hist["metric"] == "staleness" and len(hist["edges"]) == len(hist["counts"]) + 1
    per_code = [r for r in doc["per_code"] if r["config"] == "nearest-4bit" and r["state"] == "m"]
    assert all(abs(r["code_value"] * 7 - round(r["code_value"] * 7)) < 1e-6 for r in per_code)
    # every element-step has a non-zero nominal update (even a zeroed gradient decays m)
    assert sum(r["count"] for r in per_code) == steps * n
    assert {r["tensor"] for r in doc["per_tensor"]} == {"w"}


def test_reset_restarts_the_predicted_build_up_and_stale_values_reset():
    n, steps = 2048, 90
    gen = torch.Generator().manual_seed(3)
    grads = torch.randn(steps, n, generator=gen)
    trace = Trace("adamw", {"betas": [0.9, 0.99]}, 0, 1, steps, "fp32",
                  [TraceTensor("w", 0, (n,), torch.arange(1), grads)])
    doc, _ = diagnose(trace, select_configs(["bf16"]), reset="30")
    pred = [r["stall_rate_predicted"] for r in doc["series"] if r["state"] == "v"]
    assert pred[0] == 0 and pred[30] == 0 and pred[60] == 0 and pred[29] == pytest.approx(pred[59])
    rec = [r for r in doc["records"] if r["state"] == "v"][0]
    assert rec["reset_applied"] == 30 and rec["staleness_max"] <= 30
    auto, _ = diagnose(trace, select_configs(["bf16", "nearest-4bit"]), reset="auto")
    applied = {r["config"]: r["reset_applied"] for r in auto["records"]}
    stand_in = theory.reset_period(parse_spec("e2m2:nearest"), 0.99)  # lin4nz has no model: e2m2's (same width),
    assert applied == {"bf16": theory.reset_period(parse_spec("bf16"), 0.99), "nearest-4bit": stand_in}  # as AdamW's
    assert stand_in == 34


def test_reset_recommendations_explain_themselves():
    bf16 = parse_spec("bf16")
    period, why = recommend(bf16, "v", "adamw", 0.999, np.full(100, 0.5), None)
    assert period is None and "staleness model" in why and "by step 827" in why  # the corpus: no reset (evidence.py)
    period, why = recommend(bf16, "v", "adamw", 0.99, np.full(100, 0.5), None)  # no evidence at this beta2
    assert period == theory.reset_period(bf16, 0.99) and "staleness model" in why
    period, why = recommend(parse_spec("uint4:bred:b128"), "v", "adamw", 0.999, np.zeros(100), None)
    assert period is None and "BReD" in why
    ramp = np.minimum(np.arange(400) / 200, 1.0) * 0.4  # builds up to 0.4 over 200 steps
    period, why = observed_period(ramp, "v")
    assert 170 <= period <= 190 and "builds up" in why
    assert observed_period(np.full(400, 0.3), "v")[0] is None  # high from the start: no build-up
    assert observed_period(np.full(400, 0.001), "v")[0] is None  # negligible
    assert "still building up" in observed_period(np.arange(400) / 400, "v")[1]


def test_select_configs():
    assert [str(c) for c in select_configs()] == ["nearest-4bit", "sr-4bit", "bred-4bit", "bnb-8bit",
                                                    "torchao-4bit", "bf16", "bf16-sr"]
    assert [str(c) for c in select_configs(bits=[8], rounding=["bred", "nr"])] == ["bred-8bit", "nearest-8bit"]
    cfg = select_configs(["bred-4bit", "bf16"], block_size=64)
    assert cfg[0].m.block == 64 and cfg[0].v.block == 64 and cfg[0].v.fmt.name == "lin4nz" and cfg[1].m.block is None
    with pytest.raises(QstateError, match="did you mean bred-4bit"):
        select_configs(["bred4bit"])
    with pytest.raises(QstateError, match="--block-size 4000: the replay needs a power of two from 32 to 2048"):
        select_configs(["bred-4bit"], block_size=4000)


def test_non_power_of_two_blocks_are_refused():
    trace = constant_trace(torch.ones(4096), 3)
    with pytest.raises(QstateError, match="power of two"):
        diagnose(trace, [parse_config("int4:nearest:b96")])


def test_suite_hook(tmp_path):
    trace = constant_trace(torch.linspace(-1, 1, 3000), 12)
    path = save_trace(trace, tmp_path / "t.pt")
    out = diagnose_point({"trace": str(path), "config": "bred-4bit", "bits": [8], "rounding": "nearest",
                          "reset": "auto", "steps_limit": 10})
    assert {"records", "series", "histograms", "per_code", "theory", "per_tensor", "meta"} <= set(out)
    assert {r["config"] for r in out["records"]} == {"bred-4bit", "nearest-8bit"}
    assert {r["steps"] for r in out["records"]} == {10}
    with pytest.raises(QstateError, match="diagnose: unknown parameter 'block'; did you mean block_size"):
        diagnose_point({"trace": str(path), "block": 64})
    with pytest.raises(QstateError, match="needs 'trace'"):
        diagnose_point({"config": ["bf16"]})


def test_unsupported_optimizer_is_a_clear_error():
    trace = constant_trace(torch.ones(100), 2, optimizer="rmsprop")
    with pytest.raises(QstateError, match="optimizer 'rmsprop' is not supported"):
        diagnose(trace, select_configs(["bf16"]))


def test_a_v_stored_as_sqrt_stalls_like_one_fraction_bit_fewer():
    """sqrt(v) changes by dv / (2v): the stall window doubles, i.e. rho of p - 1 bits; checked
    against a seeded simulation of the stored sqrt(v) at steady state."""
    spec = parse_spec("bf16:nearest:sqrt")
    assert theory.stall_probability(spec, 0.999) == pytest.approx(theory.p_stall_nearest(theory.rho(6, 0.999)))
    n, beta = 40_000, 0.99
    gen = torch.Generator().manual_seed(4)
    sigma2 = 4.0 ** torch.rand(n, generator=gen)  # sqrt(v) log-uniform over one binade
    s_hat = sigma2.sqrt().bfloat16().float()  # stored sqrt(v) at its level
    g2 = sigma2 * torch.randn(n, generator=gen) ** 2
    new = (s_hat * s_hat * beta + g2 * (1 - beta)).sqrt().bfloat16().float()
    observed = float((new == s_hat).float().mean())
    assert observed == pytest.approx(float(theory.stall_probability(spec, beta)), abs=0.03)


@pytest.mark.cuda
def test_cuda_replay_equals_the_cpu_replay():
    """The same seed replays the same bits on CPU and GPU: stored states equal, statistics
    equal up to the order of floating-point sums."""
    _, _, trace = run_reference(lambda ps: AdamW(ps, states="bf16", min_quant_numel=0), [(5000,), (40, 70)], 12)
    cfgs = select_configs()
    cpu_doc, cpu = diagnose(trace, cfgs, device="cpu", keep_states=True)
    gpu_doc, gpu = diagnose(trace, cfgs, device="cuda", keep_states=True)
    for name in cpu.final_states:
        for s in ("m", "v"):
            for a, b in zip(cpu.final_states[name][s], gpu.final_states[name][s]):
                assert torch.equal(a, b), (name, s)
    for a, b in zip(cpu_doc["records"], gpu_doc["records"]):
        assert a["stall_rate"] == pytest.approx(b["stall_rate"], abs=1e-12)
        assert a["rel_rms_error"] == pytest.approx(b["rel_rms_error"], rel=1e-4, abs=1e-9)


def test_layout_stream_keys_are_the_hash_stream_keys():
    from qstate_cli.diagnose.layout import Layout
    from qstate_cli.quant import hash as qhash

    trace = constant_trace(torch.ones(5000), 2)
    trace.tensors[0].index = 7
    lay = Layout(trace, 128, "cpu")
    st = lay.stream(seed=12345, state_id=1, counter="block", block=128)
    k1, k2 = st.keys(99)
    ref1, ref2 = qhash.stream_keys(12345, 7, 1, 99)
    orig = torch.arange(k1.numel())  # a full tensor: layout block b is block b
    assert torch.equal(k1 ^ torch.arange(k1.numel()) ^ orig, torch.full_like(k1, ref1))
    assert torch.equal(k2, torch.full_like(k2, ref2))


def test_suite_demo_trace_is_made_once_and_reused(tmp_path, monkeypatch):
    from qstate_cli.trace import demo

    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "DEFAULT", demo.DemoSettings(steps=3))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()  # in a suite "demo" is the built-in trace even where a path says otherwise
    out = diagnose_point({"trace": "demo", "config": "bf16", "profile": True})
    files = list((tmp_path / "cache").glob("demo-tiny-lm-3steps-*.pt"))
    assert len(files) == 1 and {r["steps"] for r in out["records"]} == {3}
    before = files[0].stat().st_mtime_ns
    diagnose_point({"trace": "demo", "config": ["bf16"], "steps_limit": 2})
    assert files[0].stat().st_mtime_ns == before  # reused, not re-made
    theory_only = diagnose_point({"theory": True, "format": "e4m3", "beta2": 0.99})
    assert theory_only["records"] == [] and {r["format"] for r in theory_only["theory"]} == {"e4m3"}


@pytest.mark.parametrize("dtypes", [("fp32",) * 4, ("bf16",) * 4, ("bf16", "fp32", "bf16", "fp32")])
def test_staged_gather_gives_each_rows_gradients(dtypes, monkeypatch):
    """Layout.gradients on CPU stages rows a chunk at a time (3 here, over 8 steps: a short
    last chunk): every row, read in order, backwards and at random, is each recorded piece of
    that row, padding 0, bit for bit; bf16, fp32 and mixed tensors (staged in fp32); a part
    of the layout gathers its own share."""
    from qstate_cli.diagnose import layout as layout_mod
    from test_replay_codec_cpu import small_trace

    monkeypatch.setattr(layout_mod, "STAGE_ROWS", 3)
    trace = small_trace(8)
    for t, d in zip(trace.tensors, dtypes):
        t.grads = t.grads.to(torch.bfloat16 if d == "bf16" else torch.float32)
    for part in (None, (1, 2)):
        lay = layout_mod.Layout(trace, 128, "cpu", part)
        assert lay.stage_k == 3 and lay.valid is not None
        for row in [0, 1, 2, 3, 7, 6, 5, 4, 3, 2, 1, 0] + torch.randperm(8, generator=torch.Generator().manual_seed(1)).tolist():
            want = torch.zeros(lay.n)
            for i, first, count, at in lay.pieces:
                want[at: at + count] = trace.tensors[i].grads[row, first: first + count].float()
            got = lay.gradients(row)
            assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32)), row
            got.fill_(1.0)  # a fresh tensor: the next read of the row is unchanged
            assert torch.equal(lay.gradients(row).view(torch.int32), want.view(torch.int32))
    monkeypatch.setattr(layout_mod, "STAGE_BYTES", 1)  # a row too large to stage two: one row per step
    assert layout_mod.Layout(trace, 128, "cpu").stage_k == 1
    monkeypatch.setattr(layout_mod, "STAGE_BYTES", 4 << 20)
    monkeypatch.setattr(layout_mod, "STAGE_PIECE", 1000)  # pieces of ~1.4 k elements on average: not staged
    assert layout_mod.Layout(trace, 128, "cpu").stage_k == 1


def test_a_note_says_the_small_tensors_are_quantized_as_no_optimizer_keeps_them():
    """The replay quantizes every recorded tensor, while the optimizers keep tensors under
    4096 elements in fp32: a user compared diagnose's 1.0625 B/param with doctor's 1.123."""
    from qstate_cli.trace import synthetic

    trace = synthetic.gaussian(1000, 5)  # one tensor of 1000 elements
    doc, _ = diagnose(trace, [parse_config("nearest-4bit")], device="cpu")
    assert ("1 of 1 tensors hold under 4096 elements (100.0% of the recorded ones): the replay quantizes them too"
            in " ".join(doc["meta"]["notes"]))
    doc, _ = diagnose(synthetic.gaussian(8192, 5), [parse_config("nearest-4bit")], device="cpu")
    assert not any("under 4096" in n for n in doc["meta"]["notes"])
    doc, _ = diagnose(trace, [parse_config("fp32")], device="cpu")  # nothing quantized: nothing to say
    assert not any("under 4096" in n for n in doc["meta"]["notes"])


def test_a_steps_limit_beyond_the_trace_is_said():
    from qstate_cli.trace import synthetic

    doc, _ = diagnose(synthetic.gaussian(1000, 5), [parse_config("fp32")], steps_limit=1000, device="cpu")
    assert "--steps-limit 1000: the trace holds 5 steps, all replayed" in doc["meta"]["notes"]
    assert doc["meta"]["steps"] == 5


def test_the_gaussian_model_follows_the_optimizer_class_not_its_name(monkeypatch):
    """diagnose's Adam-only parts (the Gaussian model, theory's v curve, reset advice) read
    the class's `adam_moments`: a new optimizer with Adam's moments sets it, nothing else."""
    from qstate_cli.diagnose.recommend import adam_moments as recommends_adam
    from qstate_cli.diagnose.recursions import adam_moments, recursion_for
    from qstate_cli.optim import Lion

    assert adam_moments("adamw") and adam_moments("adam") and not adam_moments("lion")
    assert not recursion_for("lion", {}).adam_moments and recursion_for("adam", {}).adam_moments
    monkeypatch.setattr(Lion, "adam_moments", True)
    assert recommends_adam("lion") and recursion_for("lion", {}).adam_moments
