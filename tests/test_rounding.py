"""Statistical properties of the roundings, with bounds derived from the math.

Grid: int8 blocks whose absmax is 127, so delta = 127 / 127 = 1 and errors are in
units of one quantization step. Bounds are 5 standard errors (false-failure rate ~6e-7
per check; all samples are seeded, so the tests are deterministic).
"""
import math

import pytest
import torch

from qstate_cli.quant import Stream, decode, encode, parse_spec

B = 32
NBLOCKS = 20_000


def unit_grid_blocks(fill: torch.Tensor) -> torch.Tensor:
    """[NBLOCKS, B] blocks, element 0 = 127 (absmax -> delta = 1), others = fill."""
    x = fill.reshape(NBLOCKS, B - 1)
    return torch.cat([torch.full((NBLOCKS, 1), 127.0), x], dim=1).reshape(-1)


def errors(x, text, step=1, stream=Stream(11, 0, 0)):
    spec = parse_spec(text)
    s, sc = encode(x, spec, step, stream)
    return (decode(s, sc, spec, x.numel(), step, stream) - x).view(NBLOCKS, B)[:, 1:]


@pytest.mark.parametrize("position", [0.0, 0.25, 0.5, 0.9])
def test_bred_error_is_uniform_zero_mean_var_twelfth_whatever_the_input(position):
    x = unit_grid_blocks(torch.full((NBLOCKS * (B - 1),), 3.0 + position))
    e = errors(x, f"int8:bred:b{B}")
    one_per_block = e[:, 0].double()  # independent draws (one dither per block)
    n = one_per_block.numel()
    # mean 0, sd of the mean sqrt(1/12 / n); variance 1/12, sd of the variance sqrt(1/180 / n)
    assert abs(one_per_block.mean()) < 5 * math.sqrt(1 / 12 / n)
    assert abs(one_per_block.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    assert one_per_block.abs().max() <= 0.5 + 1e-5
    # uniform: each quarter of (-1/2, 1/2] holds 1/4 of the draws (binomial sd)
    counts = torch.histc(one_per_block.float(), bins=4, min=-0.5, max=0.5)
    assert torch.all((counts / n - 0.25).abs() < 5 * math.sqrt(0.25 * 0.75 / n))


def test_bred_error_is_uncorrelated_with_the_input():
    g = torch.Generator().manual_seed(0)
    x = unit_grid_blocks(torch.rand(NBLOCKS * (B - 1), generator=g) * 200 - 100)
    e = errors(x, f"int8:bred:b{B}")[:, 0].double()
    xin = x.view(NBLOCKS, B)[:, 1].double()
    r = torch.corrcoef(torch.stack([e, xin]))[0, 1]
    assert abs(r) < 5 / math.sqrt(NBLOCKS)


def test_nearest_error_depends_on_the_input():
    # the contrast: nearest has a fixed, input-determined error (bias) at each position
    x = unit_grid_blocks(torch.full((NBLOCKS * (B - 1),), 3.25))
    e = errors(x, f"int8:nearest:b{B}")
    assert torch.all(e == -0.25)


@pytest.mark.parametrize("frac", [0.1, 0.5, 0.8])
def test_stochastic_rounding_is_unbiased_with_bernoulli_variance(frac):
    x = unit_grid_blocks(torch.full((NBLOCKS * (B - 1),), 5.0 + frac))
    e = errors(x, f"int8:stochastic:b{B}").double().reshape(-1)  # independent per element
    n = e.numel()
    p = frac
    assert abs(e.mean()) < 5 * math.sqrt(p * (1 - p) / n)
    var = e.var()
    assert abs(var - p * (1 - p)) < 5 * math.sqrt(p * (1 - p) * (1 - 3 * p * (1 - p)) / n) + 1e-3


def test_stochastic_rounding_on_a_code_book_is_unbiased():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(200_000, generator=g) * 0.9
    x[::128] = 1.0  # absmax 1 in every block: values are in code-book units
    spec = parse_spec("de4:stochastic:b128")
    errs = []
    for step in range(1, 6):
        s, sc = encode(x, spec, step, Stream())
        errs.append(decode(s, sc, spec, x.numel(), step, Stream()) - x)
    e = torch.stack(errs).double()
    # per element the error has sd <= max gap / 2 (0.225 for de4); the mean over all is ~0
    assert abs(e.mean()) < 5 * 0.1125 / math.sqrt(e.numel())


def test_dither_differs_across_blocks_steps_and_states():
    x = unit_grid_blocks(torch.full((NBLOCKS * (B - 1),), 3.5))
    e1 = errors(x, f"int8:bred:b{B}", step=1)[:, 0]
    e2 = errors(x, f"int8:bred:b{B}", step=2)[:, 0]
    e3 = errors(x, f"int8:bred:b{B}", step=1, stream=Stream(11, 0, 1))[:, 0]
    assert (e1[1:] == e1[:-1]).float().mean() < 0.01  # blocks differ
    assert (e1 == e2).float().mean() < 0.01  # steps differ
    assert (e1 == e3).float().mean() < 0.01  # states differ
    # within a block the dither is shared: the error is the same for equal inputs
    e_all = errors(x, f"int8:bred:b{B}", step=1)
    assert torch.all(e_all == e_all[:, :1])


def test_same_seed_replays_identical_codes():
    x = torch.randn(10_000)
    spec = parse_spec("int4:bred:b128")
    a = encode(x, spec, 17, Stream(5, 1, 0))
    b = encode(x, spec, 17, Stream(5, 1, 0))
    c = encode(x, spec, 17, Stream(6, 1, 0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def ema_run(text, steps=1000, beta=0.999, x0=1.0, target=2.0):
    """Store an EMA in `text` with constant input `target`; return stored values."""
    spec = parse_spec(text)
    n = 4096
    x_hat = torch.full((n,), x0)
    stored = []
    for t in range(1, steps + 1):
        x = x_hat * beta + torch.full((n,), target) * (1 - beta)
        s, sc = encode(x, spec, t, Stream(1, 0, 0))
        x_hat = decode(s, sc, spec, n, t, Stream(1, 0, 0))
        stored.append(x_hat.clone())
    return torch.stack(stored)


def test_nearest_rounding_stalls_an_ema_whose_updates_are_under_half_a_step():
    # bf16 spacing at 1.0 is 2**-7; each update (1-beta)(2 - 1) = 1e-3 < 2**-8: never moves
    stored = ema_run("bf16:nearest")
    assert torch.all(stored == 1.0)


@pytest.mark.parametrize("rounding", ["stochastic", "bred"])
def test_unbiased_roundings_track_the_fp32_ema(rounding):
    stored = ema_run(f"bf16:{rounding}")
    fp32 = 2.0 - (1.0 - 0.0) * 0.999 ** 1000  # exact EMA after 1000 steps
    final = stored[-1].double()
    # E_t = beta E_{t-1} + e_t: stationary sd <= spacing * sqrt(1/4 / (1 - beta^2)) (per-step
    # error variance <= spacing^2/4); independent streams: every element (SR), every block (BReD)
    spacing = 2.0 ** -7
    streams = final.numel() if rounding == "stochastic" else final.numel() // 128
    sd = spacing * math.sqrt(0.25 / (1 - 0.999 ** 2))
    assert abs(final.mean() - fp32) < 5 * sd / math.sqrt(streams)
    assert final.mean() > 1.5  # it moved, unlike nearest
