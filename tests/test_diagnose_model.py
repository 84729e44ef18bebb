"""The staleness model for every format that can stall: its grid windows against the
quantizer, its closed forms against Monte Carlo, and its predictions against replays of
synthetic traces (Gaussian, where it must hold; heavy-tailed and non-stationary, where the
Gaussian variant must warn and the empirical one must still hold)."""

import numpy as np
import pytest
import torch

from qstate_cli import theory
from qstate_cli.diagnose import diagnose
from qstate_cli.diagnose.assumptions import gradient_checks, model_warning
from qstate_cli.diagnose.staleness import gaussian_m, gaussian_v, windows
from qstate_cli.quant import Stream, decode, encode, parse_config, parse_spec
from qstate_cli.trace import synthetic


@pytest.mark.parametrize("spec", ["lin4nz:nearest:b128", "de8u:nearest:b256", "uint4:nearest:b128",
                                  "int4:nearest:b128", "de4:nearest:b128", "bf16:nearest", "e4m3:nearest:b128",
                                  "e2m2:nearest", "bf16:nearest:sqrt"])
def test_windows_are_the_quantizer_rounding_cells(spec):
    """A stored value moved by less than its window keeps its code; by a bit more than the
    window it changes (the block's absmax element held fixed, so the scale does not move)."""
    spec = parse_spec(spec)
    gen = torch.Generator().manual_seed(0)
    n = 2048
    x = torch.rand(n, generator=gen) * 2 + 0.01
    if spec.fmt.signed:
        x = x * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    codes, scales = encode(x, spec, 1, Stream())
    x_hat = decode(codes, scales, spec, n, 1, Stream())  # on the grid
    down, up = windows(spec, x_hat, full=False)
    big = x_hat.abs().view(-1, spec.block or n).amax(1, keepdim=True) if spec.scaled else None
    keep = torch.ones(n, dtype=torch.bool)
    if big is not None:  # leave the block absmax element where it is
        keep = (x_hat.abs().view(-1, spec.block) < big).reshape(-1)
    for side, w in (("up", up), ("down", down)):
        ok = keep & torch.isfinite(w) & (w > 0)
        for f, same in ((0.98, True), (1.02, False)):
            moved = x_hat + (w if side == "up" else -w) * f
            moved = torch.where(ok, moved, x_hat)
            c2, s2 = encode(moved, spec, 1, Stream())
            back = decode(c2, s2, spec, n, 1, Stream())
            changed = (back != x_hat)[ok]
            assert changed.float().mean() == (0.0 if same else 1.0), (side, f, spec)


def test_gaussian_closed_forms_match_monte_carlo():
    """v (chi^2_1 with a level c) and m (normal) under nearest and stochastic rounding,
    asymmetric windows, against 2 M seeded samples."""
    rng = np.random.default_rng(0)
    z = torch.from_numpy(rng.standard_normal(2_000_000))
    s = torch.tensor([1.0, 0.7, 2.0])
    down, up = torch.tensor([0.0008, 0.002, 0.0005]), torch.tensor([0.0012, 0.004, float("inf")])
    beta, c = 0.999, 0.8
    for sr in (False, True):
        p = gaussian_v(sr, beta, c, s, down, up)
        for j in range(3):
            sigma2 = s[j] / c
            d = (1 - beta) * (z * z * sigma2 - s[j])
            if sr:
                gap = torch.where(d > 0, up[j], down[j])
                mc = (1 - d.abs() / gap).clamp(min=0).mean()
            else:
                mc = ((d > -down[j]) & (d < up[j])).double().mean()
            assert float(p[j]) == pytest.approx(float(mc), abs=2e-3), (sr, j)
    m, sigma2 = torch.tensor([0.1, -0.3, 0.0]), torch.tensor([1.0, 0.5, 2.0])
    down, up = torch.tensor([0.01, 0.03, 0.02]), torch.tensor([0.02, 0.01, 0.02])
    for sr in (False, True):
        p = gaussian_m(sr, 0.9, m, sigma2, down, up)
        for j in range(3):
            d = 0.1 * (z * sigma2[j].sqrt() - m[j])
            if sr:
                mc = (1 - d.abs() / torch.where(d > 0, up[j], down[j])).clamp(min=0).mean()
            else:
                mc = ((d > -down[j]) & (d < up[j])).double().mean()
            assert float(p[j]) == pytest.approx(float(mc), abs=2e-3), (sr, j)


def test_model_warning_names_the_failed_assumptions():
    grad = {"g2_sum": np.r_[np.full(10, 11.0), np.full(80, 3.0), np.full(10, 1.0)], "zeros": np.zeros(100),
            "kurtosis": np.full(50, 9.5), "n": 50}
    checks = gradient_checks(grad, 100)
    smooth = np.convolve(grad["g2_sum"], np.ones(2) / 2, mode="valid")  # the trend's share divided out
    assert checks["grad_kurtosis"] == pytest.approx(9.5 * np.mean(smooth) ** 2 / np.mean(smooth ** 2))
    assert checks["grad_g2_trend"] == pytest.approx(1 / 11)
    assert len(checks["failed"]) == 2 and "fell 11.0x" in checks["failed"][1]
    warn = model_warning(0.70, 0.96, 0.95, checks)
    assert "+26.0 points" in warn and f"kurtosis {checks['grad_kurtosis']:.1f}" in warn and "95.0%" in warn
    assert model_warning(0.70, 0.74, 0.75, checks) is None  # within 5 points
    assert model_warning(None, 0.9, None, checks) is None


def _v_only(name: str):
    """The configuration's v beside an fp32 m: v's statistics are the same (test_diagnose_stalls)
    at a fraction of the cost."""
    return parse_config(f"m=fp32,v={parse_config(name).v}")


def test_gaussian_trace_at_the_issue_size():
    """8192 x 3000, beta2 = 0.999, N(0, 1): nearest-4bit's v codes freeze; bf16's v stalls
    95-99% late; the Gaussian model holds on average, the empirical one late; no warning."""
    trace = synthetic.gaussian(8192, 3000, beta2=0.999)
    near, bf16 = _v_only("nearest-4bit"), _v_only("bf16")
    doc, _ = diagnose(trace, [near, bf16])
    v = {r["config"]: r for r in doc["records"] if r["state"] == "v"}
    n4, bf = v[str(near)], v[str(bf16)]
    assert n4["code_stall_rate_late"] >= 0.95 and n4["stall_rate_late"] < 0.01
    assert 0.95 <= bf["stall_rate_late"] <= 0.99
    assert abs(bf["stall_rate_predicted"] - bf["stall_rate"]) < 0.03
    assert abs(bf["stall_rate_predicted_empirical_late"] - bf["stall_rate_late"]) < 0.03
    assert bf["stall_rate_predicted"] == pytest.approx(
        float(np.mean(theory.stall_curve(parse_spec("bf16"), 0.999, 3000))))
    # the block-scaled grid has a model now, and it holds
    assert abs(n4["stall_rate_predicted_late"] - n4["code_stall_rate_late"]) < 0.03
    assert abs(n4["stall_rate_predicted_empirical_late"] - n4["code_stall_rate_late"]) < 0.03
    assert n4["model_warning"] is None and bf["model_warning"] is None
    checks = doc["meta"]["gradient_checks"]
    assert abs(checks["grad_kurtosis"] - 3) < 0.2 and abs(checks["grad_g2_trend"] - 1) < 0.1 and not checks["failed"]


def test_kurtosis_check_tells_a_falling_variance_and_a_mean_from_heavy_tails():
    """A Gaussian whose variance falls 10x has a pooled kurtosis of 3 E[s^4]/E[s^2]^2 = 4.2:
    the trend is flagged, not the tails. A constant gradient (uncentred ratio 1) is flagged
    as far from zero mean; Student-t(3) stays flagged heavy."""
    falling = synthetic.heavy_tailed(4096, 600, df=1e6, decay=10)  # Gaussian, sigma^2 = 10^(-t/T)
    checks = diagnose(falling, [_v_only("bf16")])[0]["meta"]["gradient_checks"]
    assert abs(checks["grad_kurtosis"] - 3) < 0.15, checks
    assert [f for f in checks["failed"] if "kurtosis" in f] == [] and "fell" in checks["failed"][0]
    gen = torch.Generator().manual_seed(1)
    biased = synthetic._trace(0.01 + 0.001 * torch.randn(600, 4096, generator=gen), 0.9, 0.999)
    checks = diagnose(biased, [_v_only("bf16")])[0]["meta"]["gradient_checks"]
    assert checks["grad_kurtosis"] < 1.1 and "far from zero mean" in checks["failed"][0]
    heavy = synthetic.heavy_tailed(4096, 600, df=3, decay=1)
    checks = diagnose(heavy, [_v_only("bf16")])[0]["meta"]["gradient_checks"]
    assert checks["grad_kurtosis"] > 4 and "heavy tails" in checks["failed"][0]


def test_heavy_tailed_non_stationary_trace_warns_and_the_empirical_model_holds():
    trace = synthetic.heavy_tailed(4096, 1500, df=3, decay=10, beta2=0.999)
    doc, _ = diagnose(trace, [_v_only("bf16")])
    bf = [r for r in doc["records"] if r["state"] == "v"][0]
    assert bf["model_warning"] is not None and "kurtosis" in bf["model_warning"] and "fell" in bf["model_warning"]
    assert bf["code_stall_rate_late"] - bf["stall_rate_predicted_late"] > 0.05
    assert abs(bf["stall_rate_predicted_empirical_late"] - bf["code_stall_rate_late"]) < 0.05


def test_every_quantized_adam_state_gets_both_predictions():
    trace = synthetic.gaussian(2048, 60, beta2=0.99, seed=3)
    names = ["nearest-4bit", "sr-4bit", "bred-4bit", "bnb-8bit", "torchao-4bit", "bf16", "bf16-sr", "fp8", "fp4-sr",
             "fp32"]
    doc, _ = diagnose(trace, [parse_config(n) for n in names])
    for r in doc["records"]:
        if r["config"] == "fp32":
            assert r["stall_rate_predicted"] is None and r["stall_rate_predicted_empirical"] is None
            continue
        assert r["stall_rate_predicted"] is not None and r["stall_rate_predicted_empirical"] is not None, r
        if r["rounding"] == "bred":
            assert r["stall_rate_predicted"] == 0 and r["stall_rate_predicted_empirical"] == 0
    series = [r for r in doc["series"] if r["config"] == "sr-4bit" and r["state"] == "m"]
    assert any(r["stall_rate_predicted_empirical"] is not None for r in series)


def test_warning_names_the_block_scale_when_both_models_overstate_stalls():
    """Both models hold a block's scale; at beta2 = 0.95 the absmax moves codes often, so the
    observed code stall rate sits well under both: the warning says so (it blamed the
    'position on the grid'). Block-scaled fp4 v gets the per-element model, not the
    unscaled paper curve."""
    checks = {"failed": [], "grad_kurtosis": 3.0, "grad_g2_trend": 1.0, "grad_zero_share": 0.0}
    warn = model_warning(0.761, 0.614, 0.756, checks, block_scaled=True)
    assert "block's absmax moves" in warn and "about 14 points are codes the scale moved" in warn
    assert "position on the grid" not in model_warning(0.761, 0.614, 0.756, checks, block_scaled=True)
    assert "position on the grid" in model_warning(0.761, 0.614, 0.756, checks, block_scaled=False)
    trace = synthetic.gaussian(2048, 200, beta2=0.95, seed=2)
    doc, _ = diagnose(trace, [_v_only("fp4")])
    v = [r for r in doc["records"] if r["state"] == "v"][0]
    unscaled_curve = float(np.mean(theory.stall_curve(parse_spec("e2m2:nearest"), 0.95, 200)))
    assert v["stall_rate_predicted"] is not None and v["stall_rate_predicted"] != pytest.approx(unscaled_curve)


def test_a_few_large_falling_elements_do_not_make_steady_gaussians_light_tailed():
    """4096 steady N(0, 1) elements beside 64 elements 30x larger whose sigma falls 100x: the
    summed g^2's trend is theirs; dividing the steady elements' kurtosis (3) by it read 1.3,
    'light tails'. The light-tail flag needs the pooled kurtosis under 2 as well."""
    gen = torch.Generator().manual_seed(4)
    steps = 400
    steady = torch.randn(steps, 4096, generator=gen)
    falling = 30 * torch.randn(steps, 64, generator=gen) * (100 ** (-torch.arange(steps) / steps))[:, None]
    trace = synthetic._trace(torch.cat([steady, falling], 1), 0.9, 0.999)
    checks = diagnose(trace, [_v_only("bf16")])[0]["meta"]["gradient_checks"]
    assert abs(checks["grad_kurtosis_pooled"] - 3) < 0.3
    assert not any("light tails" in f for f in checks["failed"]), checks["failed"]
