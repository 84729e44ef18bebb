"""The replay's Gaussian staleness model on CPU: diagnose/staleness.gaussian_v / gaussian_m of
a state's cell, masked to the nominal updates as stats.ModelStats sums them,

    G_i = nominal_i ? P_gauss(s_i, down_i, up_i) : 0        (fp32 [n], the same bits)

in a few numba passes over memory with torch's own sqrt, erf and exp in between, instead of
~20-60 torch ops (each its own pass, the boolean ones ~30-40 us on 24k elements).

Why torch keeps the transcendentals: its CPU sqrt, erf and exp are its own vector code, not
the correctly rounded functions (sqrt: 1 ulp off on ~0.5% of values here), so numba cannot
reproduce their bits. They are elementwise, though: the value of an element does not depend
on its position, the tensor's length or alignment (checked for every offset by
tests/test_replay_gauss_cpu.py), so one in-place torch call over a scratch row of
arguments gives each element the bits the reference's own call gives it. The numba passes
(replay_gauss_kernel.py) write those arguments and combine the results, fp32 op for op in
staleness.py's order. The per-tensor constants chi2_1(c), chi2_3(c) of the stochastic v
are torch's too: their arguments take a slot at the end of the rows.

Slow arguments: torch's sqrt takes ~20x its usual time on +0 and its exp ~100x where the
result underflows (x < -104: 27-80 ns per element against 0.3), and the stochastic formulas
meet both all the time (a = clamp(c - w_lo, 0) = 0 wherever the cell is wider than c; b / 2 up
to 5e29). The argument passes write a fast value there instead (1 for sqrt, 0 for exp) and
the finishing passes put torch's own result for those arguments, probed once (`probe`:
sqrt(+0), erf(sqrt(+0)), and exp below EXP_FLOOR, which is +0 for every one of the
1,018,167,296 fp32 values below it on this build, checked once at AVX-512, AVX2 and default
capability). Arguments in exp's subnormal band (-104, -87.3) and subnormal sqrt arguments
stay with torch: their results are not one value. Except the stochastic exp arguments below
EXP_BAND (-88), where exp is in [0, 2**-126) (band_below) and ~30 ns an element:
  - v: exp is only ever subtracted, times a factor below 11.5, from a chi2_1 that is 1,
    which absorbs it whole, so +0 gives the same bits (replay_gauss_kernel.v_finish checks
    chi2_1 >= 1/2 per argument). sr-4bit's v sent 2-15% of its exp arguments there.
  - m: p is monotone in each phi, so p computed with each band phi at either end of its
    range bounds every value torch's exp could give; where both are the same value, p is
    pinned (replay_gauss_kernel.m_finish). sr-4bit's m sent 0.7-1.9% of its exp arguments
    there, on the 1 M trace: 1.8-4.8 ms of torch's exp per 1.5 M arguments against 0.3-0.4.
Where the finishing pass cannot show it, the call runs again with every exp by torch.

torch's ops run on one intra-op thread inside host.torch_aside (the replay of a large layout
on the fused path); host.torch_parts then runs them in pieces on the kernels' threads.

Per state and model step (n elements):
    v nearest     v_args -> sqrt_, erf_ on 2 rows -> v_finish
    v stochastic  v_args -> sqrt_ on 4 rows, erf_ on 2, exp_ on 2 -> v_finish
    m nearest     m_sigma -> sqrt_ on n -> m_args -> erf_ on 2 rows -> m_finish
    m stochastic  m_sigma -> sqrt_ on n -> m_args -> erf_ on 3 rows, exp_ on 3 -> m_finish
Scratch: 9 fp32 per element (and 7 slots), one set per layout size and thread (replay_model.py's rule).
No numba at import: the kernels are imported on first use.
"""
from __future__ import annotations

import math
import threading
from functools import lru_cache

import numpy as np
import torch

from .host import run_parts, torch_parts

CHUNK = 4096  # elements per range of run_parts (threads from host.MIN_THREAD_ELEMENTS)
_KERNELS: dict = {}
_LOCAL = threading.local()  # .scratch: n -> Scratch, the thread's latest layout size only


class Scratch:
    """One thread's rows for a layout of n elements: T [4 (n + 1)] (sqrt / erf arguments),
    X [3 (n + 1)] (exp), each row n elements and a slot (replay_gauss_kernel), SIG [n]
    (sigma), G [n] (the result), as torch tensors and their numpy views. SIG stays while the
    same sigma^2 comes again (the replay's: one per step and shadow, for every configuration)."""

    def __init__(self, n: int):
        f32 = torch.float32  # whatever torch's default dtype is
        self.T, self.X = torch.zeros(4 * (n + 1), dtype=f32), torch.zeros(3 * (n + 1), dtype=f32)
        self.SIG, self.G = torch.empty(n, dtype=f32), torch.empty(n, dtype=f32)
        self.sigma_of, self.sigma_version = None, -1  # the sigma^2 tensor (and its version) SIG holds sigma of
        self.np = tuple(t.numpy() for t in (self.T, self.X, self.SIG, self.G))


def _scratch(n: int) -> Scratch:
    held = _LOCAL.__dict__.setdefault("scratch", {})
    if n not in held:
        held.clear()
        held[n] = Scratch(n)
    return held[n]


def _kernels():
    if not _KERNELS:
        from . import replay_gauss_kernel as k
        _KERNELS.update(v_args=k.v_args, v_finish=k.v_finish, m_sigma=k.m_sigma, m_args=k.m_args,
                        m_finish=k.m_finish)
    return _KERNELS


SQRT, ERF, EXP = torch.Tensor.sqrt_, torch.Tensor.erf_, torch.Tensor.exp_  # torch's own, in place (host.torch_parts)
EXP_FLOOR = -104.0  # below it torch's fp32 exp is +0 (it underflows; tests/test_replay_gauss_cpu.py)


@lru_cache(maxsize=None)
def probe() -> tuple[float, float, float, float]:
    """(erf(sqrt(+0)), sqrt(+0), exp(x < floor), floor): torch's values where its sqrt and exp
    take ~20-100x their usual time, so the kernels put these constants there instead of asking
    torch. torch's functions are elementwise: its value at +0 is the same in any tensor. exp is
    one value below EXP_FLOOR on every sample probed here, ends and -inf included; where it is
    not (another build), floor is -inf and every exp goes to torch."""
    f32 = torch.float32
    zero = torch.zeros(1, dtype=f32)
    below = torch.cat([torch.tensor([-float("inf"), -3.4e38, -1e30, -1e4, -105.0, -104.5], dtype=f32),
                       torch.nextafter(torch.tensor([EXP_FLOOR], dtype=f32), torch.tensor([-1e9], dtype=f32)),
                       -torch.logspace(math.log10(-EXP_FLOOR) + 1e-6, 38, 4093, dtype=f32)])
    low = torch.exp(below)
    bits = low.view(torch.int32)
    floor = EXP_FLOOR if bool((bits == bits[0]).all()) else -math.inf
    return zero.sqrt().erf().item(), zero.sqrt().item(), low[0].item(), floor


EXP_BAND = -88.0  # torch's fp32 exp below it is < 2**-126 (band_below): left out where it cannot change a bit


@lru_cache(maxsize=None)
def band_below() -> bool:
    """torch's exp is in [0, 2**-126) on the band [EXP_FLOOR, EXP_BAND) (v_finish and m_finish
    rest on it): its ends and 4093 values between, probed once (every one of its 2,097,152 fp32
    values was checked on this build: tests/test_replay_gauss_cpu.py)."""
    band = torch.cat([torch.linspace(EXP_FLOOR, EXP_BAND, 4095, dtype=torch.float32)[:-1],
                      torch.nextafter(torch.tensor([EXP_BAND]), torch.tensor([-1e9]))])
    low = torch.exp(band)
    return bool(((low >= 0) & (low < 2.0 ** -126)).all())


@lru_cache(maxsize=256)  # read-only (the kernels never write it); one (beta, c) per state and replay
def constants(beta: float, c: float = 0.0, band: bool = True) -> np.ndarray:
    """fp32 [11] (replay_gauss_kernel.columns): 1 - beta, c, 1e30, pi, sqrt 2, sqrt(2 pi), each
    Python scalar as torch takes it (fp32); then probe()'s; then where the stochastic exp
    arguments start to be left out (replay_gauss_kernel.v_finish, m_finish): EXP_BAND with
    band, where exp is +0 below the floor and below 2**-126 in the band, else the floor."""
    erf0, sqrt0, low, floor = probe()
    edge = EXP_BAND if band and floor > -math.inf and low == 0.0 and band_below() else floor
    return np.array([1 - beta, c, 1e30, math.pi, math.sqrt(2.0), math.sqrt(2 * math.pi), erf0, sqrt0, low, floor,
                     edge], np.float32)


def masked_gaussian(sr: bool, gaussian, s: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
                    nominal: torch.Tensor) -> torch.Tensor:
    """torch.where(nominal, staleness.gaussian_p(sr, gaussian, s, down, up), 0.0), bit for bit
    (module docstring). s, down, up: fp32, nominal: bool, CPU, contiguous, n elements each;
    gaussian: ("v", beta2, c) or ("m", beta1, sigma2 fp32 [n]). The result is this thread's
    scratch row: valid until its next call on a layout of n elements."""
    n = s.numel()
    for t in (s, down, up, nominal) + ((gaussian[2],) if gaussian[0] == "m" else ()):
        if t.device.type != "cpu" or t.numel() != n or not t.is_contiguous() \
                or t.dtype != (torch.bool if t is nominal else torch.float32):
            raise ValueError(f"the fused Gaussian model needs contiguous fp32 CPU tensors of {n} elements "
                             f"and a bool mask (got {t.dtype} {t.device.type} {t.numel()})")  # no bound checks
    k, sc, n1 = _kernels(), _scratch(n), n + 1  # n1: the rows' stride (replay_gauss_kernel)
    T, X, SIG, G = sc.np
    kind, beta, arg = gaussian
    a = [x.numpy() for x in (s, down, up, nominal)]
    if kind == "v":
        if arg <= 0:  # gaussian_v: zeros
            sc.G.zero_()
            return sc.G
        for band in (True, False):  # without the band where it was not shown to leave the bits alone
            cst = constants(beta, arg, band)
            run_parts(k["v_args"], n, CHUNK, (sr, a[0], a[1], a[2], cst, T, X, CHUNK, n))
            if sr:
                torch_parts(SQRT, sc.T)
                torch_parts(EXP, sc.X[:2 * n1])
            else:
                torch_parts(SQRT, sc.T[:2 * n1])
            torch_parts(ERF, sc.T[:2 * n1])
            if not run_parts(k["v_finish"], n, CHUNK, (sr, a[0], a[1], a[2], a[3], cst, T, X, G, CHUNK, n)):
                break
        return sc.G
    sigma2 = arg.numpy()
    if sc.sigma_of is not arg or sc.sigma_version != arg._version:  # sigma once per sigma^2 (replay step)
        run_parts(k["m_sigma"], n, CHUNK, (sigma2, SIG, CHUNK, n))
        torch_parts(SQRT, sc.SIG)
        sc.sigma_of, sc.sigma_version = arg, arg._version
    for band in (True, False) if sr else (False,):  # without the band where m_finish could not pin p down
        cst = constants(beta, 0.0, band)
        run_parts(k["m_args"], n, CHUNK, (sr, a[0], a[1], a[2], SIG, cst, T, X, CHUNK, n))
        torch_parts(ERF, sc.T[:(3 if sr else 2) * n1])
        if sr:
            torch_parts(EXP, sc.X)
        if not run_parts(k["m_finish"], n, CHUNK, (sr, a[0], sigma2, a[1], a[2], a[3], SIG, cst, T, X, G, CHUNK, n)):
            break
    return sc.G
