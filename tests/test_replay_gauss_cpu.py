"""The replay's fused Gaussian staleness model (kernels/cpu/replay_gauss.py) against the
reference, torch.where(nominal, staleness.gaussian_p(...), 0.0), bit for bit per element
(NaN included), for Adam's v and m under nearest and stochastic rounding; and the premises it
rests on: torch's CPU sqrt, erf and exp are elementwise (an element's value does not depend
on where it sits), and exp is +0 below replay_gauss.EXP_FLOOR, where the kernels put torch's
value in place of the ~100x slower call.

Inputs: shadows spread over many binades, cells from the format's edges (inf), zero blocks
(0 and NaN cells), windows wider than c (so a = clamp(c - w_lo, 0) = +0: the sqrt(+0)
substitution), huge windows (exp arguments far below the floor, 1e30 clamps), arguments in
exp's subnormal band, subnormal and non-finite shadows and sigma^2,
and a length that is no multiple of any vector width. The kernel tests skip where numba is
not installed."""
import math

import pytest
import torch

from qstate_cli.diagnose.staleness import gaussian_p
from qstate_cli.kernels import cpu

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")

N = 6151  # no multiple of 8 or 16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def cells(seed: int):
    """(s, m, sigma2, down, up, nominal): module docstring."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(N, generator=gen) * torch.exp(4 * torch.randn(N, generator=gen)) * 1e-4
    m = torch.randn(N, generator=gen) * torch.exp(2 * torch.randn(N, generator=gen)) * 1e-3
    sigma2 = s * torch.exp(torch.randn(N, generator=gen))
    width = torch.exp(6 * torch.randn(N, generator=gen))  # cells from far inside to far beyond sigma
    down = s * 1e-3 * width * torch.rand(N, generator=gen)
    up = s * 1e-3 * width * torch.rand(N, generator=gen)
    down[:40], up[40:80] = float("inf"), float("inf")  # the grid's ends
    down[80:100], up[80:100] = 0.0, 0.0  # a zero block: any update moves it
    down[100:110], up[110:120] = float("nan"), float("nan")  # inf * 0 in a zero block
    s[120:130], s[130], s[131], s[132], s[133] = 0.0, float("nan"), float("inf"), -1.0, 1e-41
    sigma2[120:130], sigma2[134], sigma2[135], sigma2[136] = 0.0, float("nan"), float("inf"), 1e-41
    m[137], m[138] = float("nan"), float("inf")
    # exp's subnormal band: -b / 2 in (-104, -87) for the stochastic v at c = 1 (b = 1 + w_hi)
    w = torch.linspace(175.0, 207.0, 64)
    up[200:264] = w * (1 - 0.999) * s[200:264] / 1.0
    # and for m: z = m / sigma in it, the window wide (a, b far below the floor): p is pinned (m_finish)
    sig = sigma2[300:364].clamp(min=0.0).sqrt()
    m[300:364] = sig * torch.linspace(13.3, 14.4, 64) * torch.tensor([1.0, -1.0]).repeat(32)
    down[300:364], up[300:364] = sig * 5, sig * 5
    nominal = torch.rand(N, generator=gen) < 0.9
    return s, m, sigma2, down, up, nominal


GAUSSIANS = [("v", 0.999, 1.0), ("v", 0.999, 0.3), ("v", 0.95, 1e-4), ("v", 0.999, 0.0), ("m", 0.9, None),
             ("m", 0.5, None)]


def reference(sr, g, s, m, sigma2, down, up, nominal):
    arg = sigma2 if g[0] == "m" else g[2]
    x = m if g[0] == "m" else s
    return torch.where(nominal, gaussian_p(sr, (g[0], g[1], arg), x, down, up), 0.0)


def fused(sr, g, s, m, sigma2, down, up, nominal):
    from qstate_cli.kernels.cpu.replay_gauss import masked_gaussian
    arg = sigma2 if g[0] == "m" else g[2]
    x = m if g[0] == "m" else s
    return masked_gaussian(sr, (g[0], g[1], arg), x, down, up, nominal).clone()


def assert_same(got, want, what):
    bad = torch.nonzero(bits(got) != bits(want)).flatten()
    assert bad.numel() == 0, f"{what}: differs at {bad[:5].tolist()}: {got[bad[:5]]} vs {want[bad[:5]]}"


@needs_numba
@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("g", GAUSSIANS, ids=[f"{g[0]}-{g[1]}-{g[2]}" for g in GAUSSIANS])
def test_fused_gaussian_equals_the_reference_bit_for_bit(sr, g):
    for seed in (1, 2):
        args = cells(seed)
        want = reference(sr, g, *args)
        assert_same(fused(sr, g, *args), want, f"{g} sr={sr} seed={seed}")
        if g[0] == "v" and g[2] == 0.0:
            assert not want.any()  # c <= 0: gaussian_v is 0
        else:
            assert (want > 0).sum() > N // 4 and (want == 0).sum() > 100
            assert want.isnan().any() or sr  # the stochastic formula's mask (w > 0) drops NaN cells


@needs_numba
def test_the_inputs_reach_the_substituted_and_the_slow_arguments():
    """The cells do produce what the substitutions are for: a = +0 (torch's sqrt of +0),
    exp arguments below the floor, and some in exp's subnormal band (left out under v's
    stochastic rounding where chi2_1 absorbs them, else computed by torch)."""
    from qstate_cli.kernels.cpu.replay_gauss import EXP_FLOOR
    s, _, _, down, up, _ = cells(1)
    c, scale = 1.0, (1 - 0.999) * s
    w_lo, w_hi = c * down / scale, (c * up / scale).clamp(max=1e30)
    a, b = (c - w_lo).clamp(min=0.0), (c + w_hi).clamp(min=0.0)
    assert (bits(a) == 0).sum() > 100
    assert (-b / 2 < EXP_FLOOR).sum() > 100
    band = (-b / 2 >= EXP_FLOOR) & (-b / 2 < -87.0)
    assert band.sum() > 10 and (torch.exp(-b / 2)[band].abs() < 1.2e-38).all()


def kernel_calls(monkeypatch) -> list:
    """The names of replay_gauss' kernels as they are called from now on (the cells are one
    chunk: a finishing kernel's calls are the passes)."""
    from qstate_cli.kernels.cpu import replay_gauss
    calls = []
    for name, kernel in list(replay_gauss._kernels().items()):
        monkeypatch.setitem(replay_gauss._KERNELS, name,
                            lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    return calls


@needs_numba
def test_the_band_is_left_out_only_where_chi2_1_absorbs_it(monkeypatch):
    """The stochastic v's exp arguments in [floor, EXP_BAND) get +0 in place of torch's
    subnormal value, in one pass, where chi2_1 >= 1/2 takes the product whole (the cells'
    band: chi2_1 = 1); with the band moved up to 0, where chi2_1 is small, v_finish counts
    those arguments and the call computes again without the band: the same bits both ways."""
    from qstate_cli.kernels.cpu import replay_gauss
    calls = kernel_calls(monkeypatch)
    args, g = cells(1), ("v", 0.999, 1.0)
    want = reference(True, g, *args)
    assert_same(fused(True, g, *args), want, "band")
    assert calls.count("v_finish") == 1
    calls.clear()
    try:
        replay_gauss.constants.cache_clear()
        monkeypatch.setattr(replay_gauss, "EXP_BAND", 0.0)
        assert_same(fused(True, g, *args), want, "band up to 0")
    finally:
        replay_gauss.constants.cache_clear()
    assert calls.count("v_finish") == 2


def m_band(z: torch.Tensor, sigma2, down, up, beta: float) -> torch.Tensor:
    """Elements whose stochastic m has an exp argument -x x / 2 in the band [floor, EXP_BAND)."""
    from qstate_cli.kernels.cpu.replay_gauss import EXP_BAND, EXP_FLOOR
    sigma = torch.where(sigma2 > 0, sigma2, 1.0).sqrt()
    lo, hi = down / (1 - beta), up / (1 - beta)
    xs = [-(x * x) / 2 for x in (z / sigma, (z - lo) / sigma, (z + hi) / sigma)]
    return sum(((x >= EXP_FLOOR) & (x < EXP_BAND)).int() for x in xs) > 0


@needs_numba
@pytest.mark.parametrize("beta", [0.9, 0.5])
def test_ms_band_is_left_out_where_p_is_pinned(monkeypatch, beta):
    """The stochastic m's exp arguments in [floor, EXP_BAND) are left out where p comes out
    the same with every band phi at either end of its range: cells()' m band cells (wide
    windows), in one pass. Windows narrow beside sigma put z, a and b all in the far tail,
    p there hangs on the subnormal phis: m_finish counts them and the call computes again
    with torch's exp (so do the random cells: some are such). Where torch's exp is not shown
    below 2**-126 in the band (band_below), no band: one pass. The same bits as the
    reference every way."""
    from qstate_cli.kernels.cpu import replay_gauss
    calls = kernel_calls(monkeypatch)
    g = ("m", beta, None)
    s, m, sigma2, down, up, nominal = cells(1)
    wide = [t[300:364].clone() for t in (s, m, sigma2, down, up, nominal)]
    assert (m_band(wide[1], wide[2], wide[3], wide[4], beta) & wide[5]).sum() > 40
    assert_same(fused(True, g, *wide), reference(True, g, *wide), "wide windows")
    assert calls.count("m_finish") == 1
    narrow = [t.clone() for t in wide]
    narrow[3], narrow[4] = narrow[3] * 1e-4, narrow[4] * 1e-4
    for what, args, passes in [("narrow windows", narrow, 2), ("all cells", cells(1), 2)]:
        calls.clear()
        assert_same(fused(True, g, *args), reference(True, g, *args), what)
        assert calls.count("m_finish") == passes, what
    calls.clear()
    try:  # a build whose exp is not below 2**-126 in the band: no band, torch's exp throughout
        replay_gauss.constants.cache_clear()
        monkeypatch.setattr(replay_gauss, "band_below", lambda: False)
        assert replay_gauss.constants(beta, 0.0, True)[10] == replay_gauss.EXP_FLOOR
        assert_same(fused(True, g, *args), reference(True, g, *args), "no band")
    finally:
        replay_gauss.constants.cache_clear()
    assert calls.count("m_finish") == 1


def test_torch_exp_is_below_the_least_normal_in_the_band():
    """The band's premise on this build: torch.exp(x) is in [0, 2**-126) for every one of the
    2,097,152 fp32 x in [EXP_FLOOR, EXP_BAND); and band_below() says so."""
    from qstate_cli.kernels.cpu.replay_gauss import EXP_BAND, EXP_FLOOR, band_below
    lo = torch.tensor([EXP_BAND], dtype=torch.float32).view(torch.int32).item()
    hi = torch.tensor([EXP_FLOOR], dtype=torch.float32).view(torch.int32).item()  # negative: bits grow with |x|
    x = torch.arange(lo + 1, hi + 1, dtype=torch.int32).view(torch.float32)
    assert x.numel() == 2_097_152 and x.max().item() < EXP_BAND and x.min().item() == EXP_FLOOR
    y = torch.exp(x)
    assert ((y >= 0) & (y < 2.0 ** -126)).all()
    assert band_below()


@needs_numba
def test_sigma_is_kept_for_the_same_sigma2_only(monkeypatch):
    """m's sigma = sqrt(where(sigma2 > 0, sigma2, 1)) is computed once per sigma^2 tensor (the
    replay passes one per step and shadow to every configuration), again after that tensor
    changes in place or for another tensor: each result equals the reference's."""
    calls = kernel_calls(monkeypatch)
    args, g = list(cells(4)), ("m", 0.9, None)
    for what, change, computed in [("first", None, 1), ("again", None, 0), ("in place", "mul_", 1),
                                   ("another tensor", "clone", 1), ("nearest", None, 0)]:
        if change == "mul_":
            args[2].mul_(4.0)
        elif change == "clone":
            args[2] = args[2].clone()
        calls.clear()
        sr = what != "nearest"
        assert_same(fused(sr, g, *args), reference(sr, g, *args), what)
        assert calls.count("m_sigma") == computed, what


@needs_numba
def test_without_the_exp_floor_every_exp_goes_to_torch(monkeypatch):
    """probe() turns the floor off (-inf) where torch's exp is not one value below it: the
    results are the same bits, every exp computed by torch."""
    from qstate_cli.kernels.cpu import replay_gauss
    erf0, sqrt0, low, _ = replay_gauss.probe()
    monkeypatch.setattr(replay_gauss, "probe", lambda: (erf0, sqrt0, low, -math.inf))
    args = cells(3)
    for g in (("v", 0.999, 1.0), ("m", 0.9, None)):
        assert_same(fused(True, g, *args), reference(True, g, *args), f"{g} no floor")


def test_torch_exp_is_zero_below_the_floor():
    """The floor's premise on this build: torch.exp(x) is +0.0 for fp32 x < EXP_FLOOR, on the
    floor's neighbours, every binade's ends down to -inf and 2**20 values spread over them
    (all 1,018,167,296 such values were checked once: docs/cpu.md); and probe() keeps it."""
    from qstate_cli.kernels.cpu.replay_gauss import EXP_FLOOR, probe
    gen = torch.Generator().manual_seed(0)
    floor = torch.tensor([EXP_FLOOR])
    below = [torch.nextafter(floor, torch.tensor([-1e9])), -torch.logspace(2.02, 38.5, 1 << 20),
             -(1e-3 - EXP_FLOOR + torch.rand(1 << 16, generator=gen) * 50)]
    exps = torch.arange(7, 128, dtype=torch.float32)
    below += [-(2 ** exps), -torch.nextafter(2 ** exps, torch.tensor(1e39)), torch.tensor([-3.4028235e38, -math.inf])]
    x = torch.cat(below)
    assert (x < EXP_FLOOR).all()
    assert (bits(torch.exp(x)) == 0).all()
    assert torch.exp(torch.tensor([-100.0])).item() > 0  # above the floor: subnormal, not 0
    assert probe()[2:] == (0.0, EXP_FLOOR)


@pytest.mark.parametrize("op", ["sqrt", "erf", "exp"])
def test_torch_transcendentals_are_elementwise(op):
    """An element's value does not depend on its position: the same bits at every offset
    0..17 (vector tails, alignment), alone, and in place; so one call over a scratch row of
    arguments gives what the reference's own calls give."""
    f = {"sqrt": lambda t: t.abs().sqrt(), "erf": torch.special.erf, "exp": lambda t: torch.exp(t.clamp(max=80))}[op]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20011, generator=gen) * torch.exp(3 * torch.randn(20011, generator=gen))
    x[::13] = 0.0
    x[5], x[6], x[7] = float("nan"), float("inf"), 1e-41
    full = f(x)
    for k in range(1, 18):
        assert torch.equal(bits(f(x[k:])), bits(full[k:])), f"offset {k}"
    alone = torch.stack([f(x[i:i + 1])[0] for i in range(0, 2000)])
    assert torch.equal(bits(alone), bits(full[:2000]))
    inplace = {"sqrt": lambda t: t.abs_().sqrt_(), "erf": torch.Tensor.erf_,
               "exp": lambda t: t.clamp_(max=80).exp_()}[op]
    y = x.clone()
    inplace(y[3:])
    assert torch.equal(bits(y[3:]), bits(full[3:]))


@needs_numba
@pytest.mark.parametrize("chunk", [65536, 1000, 64])
def test_fused_gaussian_over_threads(monkeypatch, chunk):
    """3 ranges, one per thread (torch on one thread, as in host.torch_aside), each its own
    pipeline over chunks of `chunk` elements (the last one short, the band computed again per
    chunk): the reference's bits."""
    from qstate_cli.kernels.cpu import host, replay_gauss
    from qstate_cli.runtime import torch_threads
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1024)
    monkeypatch.setattr(host, "threads", lambda: 3)
    monkeypatch.setattr(replay_gauss, "CHUNK", chunk)
    assert replay_gauss.range_parts(N) == 1 or torch.get_num_threads() == 1
    args = cells(4)
    with torch_threads(1):
        assert replay_gauss.range_parts(N) == 3
        for sr in (False, True):
            for g in (("v", 0.999, 0.5), ("m", 0.9, None), ("m", 0.5, None)):
                assert_same(fused(sr, g, *args), reference(sr, g, *args), f"{g} sr={sr} threads")


@needs_numba
def test_threads_of_one_process_get_their_own_scratch():
    """Replays side by side in one process (tests/test_diagnose_split.py runs ranks as threads)
    each write their own rows: every result equals the lone one."""
    import threading
    jobs = [cells(seed) for seed in (5, 6)]
    g = ("v", 0.999, 1.0)
    want = [reference(True, g, *job) for job in jobs]
    bad, start = [], threading.Barrier(2)

    def run(k):
        start.wait()
        for _ in range(20):
            if not torch.equal(bits(fused(True, g, *jobs[k])), bits(want[k])):
                bad.append(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


@needs_numba
def test_fused_gaussian_refuses_what_it_cannot_read():
    from qstate_cli.kernels.cpu.replay_gauss import masked_gaussian
    s, m, sigma2, down, up, nominal = cells(1)
    with pytest.raises(ValueError, match="contiguous fp32 CPU tensors"):
        masked_gaussian(False, ("v", 0.999, 1.0), s.double(), down, up, nominal)
    with pytest.raises(ValueError, match="contiguous fp32 CPU tensors"):
        masked_gaussian(False, ("m", 0.9, sigma2[:-1]), m, down, up, nominal)
    with pytest.raises(ValueError, match="contiguous fp32 CPU tensors"):
        masked_gaussian(False, ("v", 0.999, 1.0), s, torch.zeros(2 * N)[::2], up, nominal)  # strided
    with pytest.raises(ValueError, match="a bool mask"):
        masked_gaussian(False, ("v", 0.999, 1.0), s, down, up, nominal.float())
