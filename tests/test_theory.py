"""The staleness model against closed-form cases and a seeded simulation."""
import math

import numpy as np
import pytest
import torch

from qstate_cli import theory
from qstate_cli.quant import Stream, decode, encode, parse_spec


def test_chi2_cdf_closed_form():
    # P(|N(0,1)| <= 1) = erf(1/sqrt 2) = 0.6827; F(0) = 0
    assert theory.chi2_cdf(1.0) == pytest.approx(0.682689, abs=1e-6)
    assert theory.chi2_cdf(0.0) == 0.0 and theory.chi2_cdf(-3.0) == 0.0


def test_rho_closed_form():
    assert theory.rho(7, 0.999) == pytest.approx(2 ** -7 * math.log(2) / 0.002)


def test_nearest_stall_probability_cases():
    # rho < 1: the window (1 - rho, 1 + rho); rho >= 1 the window starts at 0
    r = 0.25
    assert theory.p_stall_nearest(r) == pytest.approx(theory.chi2_cdf(1.25) - theory.chi2_cdf(0.75))
    assert theory.p_stall_nearest(3.0) == pytest.approx(theory.chi2_cdf(4.0))
    assert theory.p_stall_nearest(0.0) == 0.0
    # build-up: at c -> 0 nothing stalls; monotone in c for rho >= 1
    c = np.linspace(1e-4, 1, 50)
    p = theory.p_stall_nearest(2.7, c)
    assert p[0] < 0.05 and np.all(np.diff(p) >= 0)


def test_stochastic_stall_probability_matches_a_monte_carlo_estimate():
    rng = np.random.default_rng(0)
    z = rng.standard_normal(2_000_000) ** 2
    for r, c in [(0.3, 1.0), (2.7, 1.0), (2.7, 0.2), (43.3, 0.05)]:
        mc = np.maximum(0, 1 - np.abs(z / c - 1) / (2 * r)).mean()
        se = np.maximum(0, 1 - np.abs(z / c - 1) / (2 * r)).std() / math.sqrt(z.size)
        assert abs(theory.p_stall_stochastic(r, c) - mc) < 5 * se + 1e-4


def test_stochastic_stall_probability_equals_the_exact_integral():
    """P_SR = E_z[max(0, 1 - |z/c - 1| / (2 rho))], z ~ chi^2_1, by scipy's adaptive quadrature
    (split at the tent's kinks): the trapezoid sum agrees to 2e-5 (np.gradient's end weight
    had it 1.6e-4 high at bf16's rho, so bf16-sr's period read 776 for 777)."""
    from scipy import integrate, stats

    for r, c in [(theory.rho(7, 0.999), 1.0), (theory.rho(3, 0.999), 1.0), (theory.rho(2, 0.999), 1.0),
                 (theory.rho(7, 0.999), 0.3), (0.34, 1.0)]:
        tent = lambda z: max(0.0, 1.0 - abs(z / c - 1.0) / (2.0 * r)) * stats.chi2.pdf(z, 1)
        lo, hi = max(0.0, c * (1 - 2 * r)), c * (1 + 2 * r)
        exact = sum(integrate.quad(tent, a, b, limit=200, points=[c] if a < c < b else None)[0]
                    for a, b in ((lo, c), (c, hi)) if b > a)
        assert abs(theory.p_stall_stochastic(r, c) - exact) < 2e-5, (r, c)


def test_stochastic_stall_probability_sums_only_the_band_but_equals_the_whole_quadrature():
    """The band c (1 - 2 rho) < z < c (1 + 2 rho) holds every non-zero term of the tent: the
    sum over it equals the dense sum over all of _S (to rounding), for narrow and wide bands,
    levels at 0, tiny, at the grid's end and beyond it; shapes and scalars kept."""
    w = theory._half_normal_weights()
    c = np.array([0.0, 1e-12, 1e-4, 0.05, 0.3, 0.999, 1.0, 7.5, 144.0, 400.0])
    for r in (1e-3, 0.05, 0.34, 2.7, 43.3, 173.0):
        dense = np.maximum(0.0, 1.0 - np.abs(theory._S[None, :] ** 2 / np.where(c > 0, c, 1)[:, None] - 1.0)
                           / (2.0 * r)) @ w
        dense[c == 0] = 0.0
        got = theory.p_stall_stochastic(r, c.reshape(2, 5))
        assert got.shape == (2, 5)
        np.testing.assert_allclose(got.reshape(-1), dense, rtol=1e-12, atol=1e-15)
        assert theory.p_stall_stochastic(r, 0.3) == pytest.approx(dense[4], rel=1e-12)


def test_bred_never_stalls_and_int_formats_have_no_model():
    assert theory.stall_probability(parse_spec("bf16:bred"), 0.999) == 0.0
    assert theory.stall_probability(parse_spec("int4:nearest"), 0.999) is None
    assert theory.reset_period(parse_spec("int4:nearest"), 0.999) is None


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_predicted_stall_rate_matches_a_seeded_bf16_simulation(rounding):
    """Gaussian gradients, v at steady state sigma^2, levels spread log-uniformly over a
    binade (the model averages the relative spacing over a binade)."""
    n, steps, beta = 20_000, 60, 0.999
    g = torch.Generator().manual_seed(0)
    sigma2 = 2.0 ** torch.rand(n, generator=g)
    spec = parse_spec(f"bf16:{rounding}")
    s, sc = encode(sigma2, spec, 1, Stream())
    v_hat = decode(s, sc, spec, n, 1, Stream())
    stalls = 0
    for t in range(2, steps + 2):
        grad2 = sigma2 * torch.randn(n, generator=g) ** 2
        v = v_hat * beta + grad2 * (1 - beta)
        s, sc = encode(v, spec, t, Stream())
        new = decode(s, sc, spec, n, t, Stream())
        stalls += int((new == v_hat).sum())
        v_hat = new
    observed = stalls / (n * steps)
    predicted = float(theory.stall_probability(spec, beta))
    se = math.sqrt(predicted * (1 - predicted) / n)  # per-coordinate correlation: count n, not n*steps
    assert abs(observed - predicted) < 5 * se + 0.01


def test_reset_period_reaches_the_buildup_fraction():
    spec = parse_spec("bf16:nearest")
    T = theory.reset_period(spec, 0.999)
    steady = theory.stall_probability(spec, 0.999, 1.0)
    at = lambda t: float(theory.stall_probability(spec, 0.999, theory.buildup_level(t, 0.999)))
    assert at(T) >= theory.BUILDUP * steady > at(T - 1)
    # within a factor of 1.5 of the paper's ~1000 steps for bf16 at beta2 = 0.999
    assert 650 <= T <= 1500


def test_stall_curve_restarts_after_each_reset():
    curve = theory.stall_curve(parse_spec("bf16:nearest"), 0.999, 600, reset_period=200)
    assert curve[0] == 0.0 and curve[200] == 0.0 and curve[400] == 0.0
    assert curve[199] == pytest.approx(curve[399]) and curve[199] > 0.3
