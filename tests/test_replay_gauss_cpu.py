"""The replay's fused Gaussian staleness model (kernels/cpu/replay_gauss.py) against the
reference, torch.where(nominal, staleness.gaussian_p(...), 0.0), bit for bit per element
(NaN included), for Adam's v and m under nearest and stochastic rounding (fp32_math's
functions on their own: tests/test_fp32_math.py).

Inputs: shadows spread over many binades, cells from the format's edges (inf), zero blocks
(0 and NaN cells), windows wider than c (so a = clamp(c - w_lo, 0) = +0), huge windows (exp
arguments far below its floor, 1e30 clamps), arguments in exp's subnormal band, subnormal
and non-finite shadows and sigma^2, and a length that is no multiple of any vector width. The kernel tests skip where numba is
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
    # and for m: z = m / sigma in it, the window wide (a, b far below the floor)
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
def test_the_inputs_reach_every_branch_of_the_functions():
    """The cells do reach what fp32_math's functions treat apart: a = +0 (sqrt(+0)), exp
    arguments below its floor (-104), in its subnormal band and normal, and erf arguments on both
    sides of 1 and beyond 4 (its tail and its +-1)."""
    from qstate_cli.fp32_math import EXP_LO
    s, m, sigma2, down, up, _ = cells(1)
    c, scale = 1.0, (1 - 0.999) * s
    w_lo, w_hi = c * down / scale, (c * up / scale).clamp(max=1e30)
    a, b = (c - w_lo).clamp(min=0.0), (c + w_hi).clamp(min=0.0)
    assert (bits(a) == 0).sum() > 100
    x = torch.cat([-a / 2, -b / 2])
    assert (x < EXP_LO).sum() > 100 and ((x >= EXP_LO) & (x < -87.4)).sum() > 10 and (x > -80).sum() > 100
    z = torch.cat([(a / 2).sqrt(), (b / 2).sqrt(), m / sigma2.clamp(min=0.0).sqrt() / math.sqrt(2.0)])
    assert (z < 1).sum() > 100 and ((z >= 1) & (z < 4)).sum() > 100 and (z.abs() >= 4).sum() > 100


def kernel_calls(monkeypatch) -> list:
    """The names of replay_gauss' kernels as they are called from now on (one range: a
    kernel's calls are its passes)."""
    from qstate_cli.kernels.cpu import replay_gauss
    calls = []
    for name, kernel in list(replay_gauss._kernels().items()):
        monkeypatch.setitem(replay_gauss._KERNELS, name,
                            lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    return calls


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
def test_fused_gaussian_over_threads(monkeypatch):
    """3 ranges, one per thread (torch on one thread, as in host.torch_aside), the last one
    short: the reference's bits."""
    from qstate_cli.kernels.cpu import host, replay_gauss
    from qstate_cli.runtime import torch_threads
    monkeypatch.setattr(host, "MIN_THREAD_ELEMENTS", 1024)
    monkeypatch.setattr(host, "threads", lambda: 3)
    assert replay_gauss.range_parts(N) == 1 or torch.get_num_threads() == 1
    args = cells(4)
    with torch_threads(1):
        assert replay_gauss.range_parts(N) == 3
        for sr in (False, True):
            for g in (("v", 0.999, 0.5), ("m", 0.9, None), ("m", 0.5, None)):
                assert_same(fused(sr, g, *args), reference(sr, g, *args), f"{g} sr={sr} threads")


@needs_numba
def test_fused_gaussian_on_numbas_team(monkeypatch):
    """A small layout (one run_parts thread, torch on one thread) inside team(2): each pass
    splits over numba's OpenMP team (here from 1,024 elements a thread), m's sigma in the
    same launch where it is new; the reference's bits, for v and m under both roundings."""
    from qstate_cli.kernels.cpu import replay_gauss, team
    from qstate_cli.runtime import torch_threads
    if not team.team_ready(2):
        pytest.skip("numba's threading layer is not OpenMP (or has fewer than 2 threads)")
    monkeypatch.setattr(team, "TEAM_MIN_ELEMENTS", 1024)
    monkeypatch.setattr(team, "_OFF", [])  # a failed launch turns the team off: for this test only
    launches = []
    real = replay_gauss._team_launch
    monkeypatch.setattr(replay_gauss, "_team_launch", lambda job, n_team, n: launches.append(
        (job.kind, job.sigma, n_team)) or real(job, n_team, n))
    one_block = cells(7)  # 2 blocks of replay_gauss.RANGE: one a thread
    three_blocks = [torch.cat([a, b]) for a, b in zip(cells(7), cells(8))]  # 4 blocks, the last of 14 elements
    with torch_threads(1), team.team(2):
        assert replay_gauss.range_parts(2 * N) == 1
        for args in (one_block, three_blocks):
            launches.clear()
            for sr in (False, True):
                for g in (("v", 0.999, 1.0), ("m", 0.9, None), ("m", 0.5, None), ("v", 0.999, 0.0)):
                    assert_same(fused(sr, g, *args), reference(sr, g, *args), f"{g} sr={sr} team {len(args[0])}")
            # c <= 0: zeros, no launch; sigma once for the one sigma^2 tensor
            assert launches == [("v", False, 2), ("m", True, 2), ("m", False, 2), ("v", False, 2), ("m", False, 2),
                                ("m", False, 2)]
    assert team._OFF == []  # every launch ran on the team (a failure would have fallen back to one thread)


def row_cells(seed: int):
    """cells(seed) with two rows' worth of tiny windows (every erf argument of v's a and b and
    of m's a, b and z below 1) and two of huge ones (m's a and b at 4 or more, v's a 0 and b
    beyond 4): rows that skip erf's tail, next to the mixed rows of cells()."""
    from qstate_cli.kernels.cpu.fp32_math_kernel import ROW
    s, m, sigma2, down, up, nominal = cells(seed)
    tiny, huge = slice(16 * ROW, 18 * ROW), slice(18 * ROW, 20 * ROW)
    s[tiny], s[huge] = 1e-3, 1e-3
    sigma2[tiny], sigma2[huge] = 1e-6, 1e-6
    m[tiny], m[huge] = 1e-4, 1e-4  # z = 0.1
    down[tiny], up[tiny] = 1e-12, 1e-12
    down[huge], up[huge] = 1e-2, 1e-2
    return s, m, sigma2, down, up, nominal


@needs_numba
@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "stochastic"])
def test_rows_of_every_kind_and_ranges_of_any_length(sr):
    """The kernels step ROW elements at a time (replay_gauss_kernel.py, "Rows"): rows whose
    erf arguments all lie below 1, all at 4 or more, or on both sides; a range whose last row
    overlaps the row before; ranges shorter than a row (copied into a padded row). Each range
    alone (replay_gauss.gauss_range) writes the reference's bits there and nothing else."""
    from qstate_cli.kernels.cpu import replay_gauss as rg
    from qstate_cli.kernels.cpu.fp32_math_kernel import ROW
    args = row_cells(9)
    s, m, sigma2, down, up, nominal = args
    rows = slice(16 * ROW, 20 * ROW)
    sig = sigma2[rows].sqrt()
    a, b, z = (m[rows] - down[rows] / 0.1) / sig, (m[rows] + up[rows] / 0.1) / sig, m[rows] / sig  # m, beta 0.9
    x = (torch.stack([a, b, z]) / math.sqrt(2)).abs().view(3, 4, ROW)
    assert (x[:, :2] < 1).all() and (x[:2, 2:] >= 4).all()  # m: tiny rows all below 1, huge rows' a, b beyond 4
    w_lo, w_hi = down[rows] / ((1 - 0.999) * s[rows]), up[rows] / ((1 - 0.999) * s[rows])  # v at c = 1
    x = torch.stack([((1 - w_lo).clamp(min=0.0) / 2).sqrt(), ((1 + w_hi) / 2).sqrt()]).view(2, 4, ROW)
    assert (x[:, :2] < 1).all() and (x[0, 2:] < 1).all() and (x[1, 2:] >= 4).all()  # v: huge rows' b beyond 4
    edges = [0, 1, 6, 6 + ROW - 1, 6 + 2 * ROW, 6 + 4 * ROW + 5, 16 * ROW, 20 * ROW, N - 3, N]
    for g in (("v", 0.999, 1.0), ("m", 0.9, None)):
        want = reference(sr, g, *args)
        job, G = rg.gauss_job(sr, (g[0], g[1], sigma2 if g[0] == "m" else g[2]), m if g[0] == "m" else s, down, up,
                              nominal)
        for i0, i1 in zip(edges, edges[1:]):
            G.fill_(-7.0)
            rg.gauss_range(job, i0, i1)
            assert_same(G[i0:i1], want[i0:i1], f"{g} sr={sr} elements {i0}..{i1}")
            assert (G[:i0] == -7.0).all() and (G[i1:] == -7.0).all(), f"{g} sr={sr}: written outside {i0}..{i1}"


@needs_numba
@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "stochastic"])
def test_a_kernels_range_may_start_anywhere_and_be_shorter_than_a_row(sr):
    """The kernels called with their own range [b0 B, min(b1 B, n)) (as run_parts and the team
    call them), not on a slice: short ranges (copied into a padded row and back) and longer
    ones, starting past 0, write the reference's bits there and nothing else."""
    import numpy as np
    from qstate_cli.kernels.cpu import replay_gauss as rg
    from qstate_cli.kernels.cpu import replay_gauss_kernel as k
    from qstate_cli.kernels.cpu.fp32_math_kernel import ROW
    s, m, sigma2, down, up, nominal = args = row_cells(10)
    n = 20 * ROW
    rows = [t[:n].contiguous().numpy() for t in (s, m, sigma2, down, up, nominal)]
    sig = np.empty(n, np.float32)
    k.m_sigma(0, 1, 0, rows[2], sig, n, n)
    for g in (("v", 0.999, 1.0), ("m", 0.9, None)):
        want = reference(sr, g, *args)[:n]
        for b0, b1, B in ((1, 3, 5), (3, 4, 7), (1, 2, ROW + 5), (2, 5, ROW - 1), (9, 12, 2 * ROW), (0, 99, ROW)):
            G = np.full(n, -7.0, np.float32)
            if g[0] == "v":
                kernel = k.v_stochastic if sr else k.v_nearest
                kernel(b0, b1, 0, rows[0], rows[3], rows[4], rows[5], rg.constants(g[1], g[2]), G, B, n)
            else:
                kernel = k.m_stochastic if sr else k.m_nearest
                kernel(b0, b1, 0, rows[1], rows[3], rows[4], rows[2], sig, rows[5], rg.constants(g[1]), G, B, n)
            i0, i1 = b0 * B, min(b1 * B, n)
            got = torch.from_numpy(G)
            assert_same(got[i0:i1], want[i0:i1], f"{g} sr={sr} blocks {b0}..{b1} of {B}")
            assert (got[:i0] == -7.0).all() and (got[i1:] == -7.0).all()


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
    with pytest.raises(ValueError, match="contiguous fp32 CPU tensors"):
        masked_gaussian(False, ("v", 0.999, 1.0), s.view(1, N), down, up, nominal)  # 2-D: the kernels read 1-D rows
    with pytest.raises(ValueError, match="a bool mask"):
        masked_gaussian(False, ("v", 0.999, 1.0), s, down, up, nominal.float())


@pytest.mark.parametrize("g", [g for g in GAUSSIANS if g[2] != 0.0], ids=lambda g: f"{g[0]}-{g[1]}-{g[2]}")
def test_the_tail_floor_moves_p_by_no_more_than_what_it_drops(g, monkeypatch):
    """The stochastic formulas take their tail factors as +0 below e^-80 (fp32_math.exp_tail).
    Against the model with exp's every value (exp32 there), p moves by at most the dropped
    terms, bounded from the formulas, plus 2 ulps of p (a margin for the roundings, not
    derived): m:
    sigma (da - dz) / lo and sigma (dz - db) / hi, each phi dropped <= e^-80 / sqrt(2 pi);
    v: (f3c - f3a) / w_lo and (f3b - f3c) / w_hi, each F3 term dropped <= sqrt(2 x / pi) e^-80
    with x <= 208 (exp is +0 from -104 on). And no bit moves where no tail argument lies in
    [-104, -80) (the cells put some there for m, and for v at c = 1)."""
    from qstate_cli import fp32_math as F
    for seed in (1, 2):
        s, m, sigma2, down, up, nominal = args = cells(seed)
        floored = reference(True, g, *args)
        monkeypatch.setattr(F, "exp_tail", F.exp32)
        exact = reference(True, g, *args)
        monkeypatch.undo()
        fine = ~(floored.isnan() | exact.isnan())
        assert torch.equal(floored.isnan(), exact.isnan())
        drop = math.exp(-80.0)
        if g[0] == "m":
            sigma = sigma2.clamp(min=0.0).sqrt().double()
            lo, hi = (down / (1 - g[1])).clamp(max=1e30).double(), (up / (1 - g[1])).clamp(max=1e30).double()
            bound = 2 * drop / math.sqrt(2 * math.pi) * sigma * (1 / lo.abs() + 1 / hi.abs())
            tails = [-(x / sigma) ** 2 / 2 for x in (m - lo, m + hi, m.double())]  # phi's at a, b, z
        else:
            scale = (1 - g[1]) * s
            w_lo = (g[2] * down / scale).clamp(max=1e30).double()
            w_hi = (g[2] * up / scale).clamp(max=1e30).double()
            bound = 2 * math.sqrt(2 * 208 / math.pi) * drop * (1 / w_lo.abs() + 1 / w_hi.abs())
            tails = [-(g[2] - w_lo).clamp(min=0.0) / 2, -(g[2] + w_hi) / 2]  # chi2_3's at a, b
        bound = bound.nan_to_num(nan=math.inf) + 2 * torch.finfo(torch.float32).eps * floored.abs().double()
        moved = (floored.double() - exact.double()).abs()
        assert (moved[fine] <= bound[fine]).all(), f"{g} seed {seed}: {moved[fine].max()}"
        touched = torch.zeros_like(nominal)
        for t in tails:  # the band, a little wider: these are fp64, the formulas' arguments fp32
            touched |= (t >= -104.5) & (t < -79.9)
        assert touched.any() or g[0] == "v" and g[2] != 1.0  # the cells reach the band for m and v at c = 1
        assert not ((bits(floored) != bits(exact)) & ~touched).any()
