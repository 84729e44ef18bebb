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

Threads: one range per thread (host.run_parts), and each range runs its whole pipeline,
CHUNK elements at a time (gauss_range): the argument pass, torch's ops on the chunk's rows,
the finishing pass. torch runs on one intra-op thread there (host.torch_aside, the replay of
a large layout on the fused path; elsewhere a single range, torch's threads in each op). One
handoff to the threads per call instead of one per pass (~130 us each on the 2-vCPU Xeon),
and the argument rows stay in the core's L2 between the passes: on the 1 M trace sr-4bit
89-90 -> 95-98 M element-steps/s, bnb-8bit +3%, nearest-4bit +5% (docs/diagnose.md).

Per state and model step (n elements; each chunk of a range):
    v nearest     v_args -> sqrt_, erf_ on 2 rows -> v_finish
    v stochastic  v_args -> sqrt_ on 4 rows, erf_ on 2, exp_ on 2 -> v_finish
    m nearest     (m_sigma -> sqrt_, once per sigma^2) m_args -> erf_ on 2 rows -> m_finish
    m stochastic  (m_sigma -> sqrt_, once per sigma^2) m_args -> erf_ on 3 rows, exp_ on 3 -> m_finish
Rows: 12 (CHUNK + 1) fp32 per thread (Rows), and SIG, G: 2 fp32 per element per layout size
and calling thread (Outputs; replay_model.py's rule).
No numba at import: the kernels are imported on first use.
"""
from __future__ import annotations

import math
import threading
from functools import lru_cache

import numpy as np
import torch

from .host import parts_of, run_parts

RANGE = 4096  # elements per range of run_parts (threads from host.MIN_THREAD_ELEMENTS)
CHUNK = 65536  # elements per chunk of a thread's pipeline: its argument rows stay in its core's L2
_KERNELS: dict = {}
_LOCAL = threading.local()  # .rows: Rows; .outputs: n -> Outputs, the thread's latest layout size only


class Rows:
    """One thread's rows for a chunk of up to CHUNK elements: T [4 (CHUNK + 1)] (sqrt / erf
    arguments), X [3 (CHUNK + 1)] (exp), as torch tensors, their numpy views and W [5 (CHUNK +
    1)] (what the args pass hands the finishing pass: the quotients of its divisions, which
    the two threads of a core wait on together; sr-4bit's 1 M replay, thread seconds per 100
    steps: m_finish 0.156-0.163 -> 0.123-0.126, v_finish 0.087-0.093 -> 0.068-0.069, m_args
    0.087-0.091 -> 0.118-0.122 and v_args 0.066-0.075 -> 0.079-0.087 for the stores: a net
    0.015-0.02 s; chunks of 16 or 32 k elements, to keep the rows in L2, lost more to torch's
    calls). A chunk of cnt elements lays its rows out at a stride of cnt + 1 (cnt elements
    and a slot: replay_gauss_kernel), so torch's ops take exactly its rows."""

    def __init__(self, chunk: int):
        f32 = torch.float32  # whatever torch's default dtype is
        self.chunk = chunk
        self.T, self.X = torch.zeros(4 * (chunk + 1), dtype=f32), torch.zeros(3 * (chunk + 1), dtype=f32)
        self.np = self.T.numpy(), self.X.numpy(), np.zeros(5 * (chunk + 1), np.float32)


class Outputs:
    """The calling thread's rows for a layout of n elements: SIG [n] (sigma), G [n] (the
    result), as torch tensors and their numpy views. SIG stays while the same sigma^2 comes
    again (the replay's: one per step and shadow, for every configuration)."""

    def __init__(self, n: int):
        self.SIG, self.G = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        self.sigma_of, self.sigma_version = None, -1  # the sigma^2 tensor (and its version) SIG holds sigma of
        self.np = self.SIG.numpy(), self.G.numpy()


def _rows() -> Rows:
    rows = getattr(_LOCAL, "rows", None)
    if rows is None or rows.chunk != CHUNK:
        rows = _LOCAL.rows = Rows(CHUNK)
    return rows


def _outputs(n: int) -> Outputs:
    held = _LOCAL.__dict__.setdefault("outputs", {})
    if n not in held:
        held.clear()
        held[n] = Outputs(n)
    return held[n]


def _kernels():
    if not _KERNELS:
        from . import replay_gauss_kernel as k
        _KERNELS.update(v_args=k.v_args, v_finish=k.v_finish, m_sigma=k.m_sigma, m_args=k.m_args,
                        m_finish=k.m_finish)
    return _KERNELS


SQRT, ERF, EXP = torch.Tensor.sqrt_, torch.Tensor.erf_, torch.Tensor.exp_  # torch's own, in place
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


class Job:
    """One masked_gaussian call, ready for gauss_range on any range of its elements: the
    Gaussian's kind ("v" or "m"), sr, the numpy rows it reads (x: s or m, down, up, nominal,
    and m's sigma^2 and SIG) and writes (G), and the constants per band (`constants`)."""

    __slots__ = ("kind", "sr", "x", "down", "up", "nominal", "sigma2", "SIG", "SIG_t", "sigma", "G", "csts", "zero")


def gauss_job(sr: bool, gaussian, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
              nominal: torch.Tensor) -> tuple[Job, torch.Tensor]:
    """(the Job of masked_gaussian's arguments, its result row G: this thread's, valid until
    its next call on a layout of n elements). m's sigma = sqrt(where(sigma^2 > 0, sigma^2, 1))
    is computed once per sigma^2 (the replay's: one per step, for every configuration): by
    this job's ranges (job.sigma), chunk by chunk before m_args reads it. SIG is marked as
    holding it here already: a range that fails raises out of the replay."""
    n = x.numel()
    for t in (x, down, up, nominal) + ((gaussian[2],) if gaussian[0] == "m" else ()):
        if t.device.type != "cpu" or t.numel() != n or not t.is_contiguous() \
                or t.dtype != (torch.bool if t is nominal else torch.float32):
            raise ValueError(f"the fused Gaussian model needs contiguous fp32 CPU tensors of {n} elements "
                             f"and a bool mask (got {t.dtype} {t.device.type} {t.numel()})")  # no bound checks
    out = _outputs(n)
    job = Job()
    job.kind, job.sr = gaussian[0], bool(sr)
    job.x, job.down, job.up, job.nominal = (t.numpy() for t in (x, down, up, nominal))
    job.SIG, job.G = out.np
    job.SIG_t, job.sigma2, job.sigma, job.zero = out.SIG, None, False, False
    beta, arg = gaussian[1], gaussian[2]
    if job.kind == "v":
        job.zero = arg <= 0  # gaussian_v: zeros
        job.csts = {band: constants(beta, arg, band) for band in (True, False)}
        return job, out.G
    job.sigma2 = arg.numpy()
    if out.sigma_of is not arg or out.sigma_version != arg._version:  # sigma once per sigma^2 (replay step)
        job.sigma = True
        out.sigma_of, out.sigma_version = arg, arg._version
    job.csts = {band: constants(beta, 0.0, band) for band in ((True, False) if sr else (False,))}
    return job, out.G


def gauss_range(job: Job, i0: int, i1: int) -> None:
    """G[i0:i1] of the job, CHUNK elements at a time on this thread's rows: the arguments
    (v_args / m_args), torch's sqrt, erf and exp in place on their rows, then the finishing
    pass; a chunk runs again without the band where the finishing pass could not show that
    leaving the band out changes no bit (module docstring). torch's ops are elementwise, so
    a chunk's rows give each element the reference's bits (tests/test_replay_gauss_cpu.py)."""
    if job.zero:
        job.G[i0:i1] = 0.0
        return
    k, rows = _kernels(), _rows()
    T, X = rows.T, rows.X
    Tn, Xn, Wn = rows.np
    sr, x, down, up, nom, G = job.sr, job.x, job.down, job.up, job.nominal, job.G
    for c0 in range(i0, i1, rows.chunk):
        c1 = min(c0 + rows.chunk, i1)
        cnt = c1 - c0
        nn = cnt + 1  # the chunk's rows' stride: cnt elements and a slot
        r = slice(c0, c1)
        if job.sigma:  # sigma = torch's sqrt of where(sigma^2 > 0, sigma^2, 1)
            k["m_sigma"](0, 1, 0, job.sigma2[r], job.SIG[r], cnt, cnt)
            SQRT(job.SIG_t[r])
        for cst in job.csts.values():  # with the band first; without it only where needed
            if job.kind == "v":
                k["v_args"](0, 1, 0, sr, x[r], down[r], up[r], cst, Tn, Xn, Wn, cnt, cnt)
                if sr:
                    SQRT(T[:4 * nn])
                    EXP(X[:2 * nn])
                else:
                    SQRT(T[:2 * nn])
                ERF(T[:2 * nn])
                left = k["v_finish"](0, 1, 0, sr, x[r], nom[r], cst, Tn, Xn, Wn, G[r], cnt, cnt)
            else:
                k["m_args"](0, 1, 0, sr, x[r], down[r], up[r], job.SIG[r], cst, Tn, Xn, Wn, cnt, cnt)
                ERF(T[:(3 if sr else 2) * nn])
                if sr:
                    EXP(X[:3 * nn])
                left = k["m_finish"](0, 1, 0, sr, x[r], job.sigma2[r], nom[r], job.SIG[r], cst, Tn, Xn, Wn, G[r],
                                     cnt, cnt)
            if not left:
                break


def range_parts(n: int) -> int:
    """Threads gauss_range's callers split n elements over: host.parts_of(n) where torch runs
    its ops on one thread (torch_aside: each range's ops then run on its own thread), else 1
    (torch's own threads take each op)."""
    return parts_of(n) if torch.get_num_threads() == 1 else 1


def masked_gaussian(sr: bool, gaussian, s: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
                    nominal: torch.Tensor) -> torch.Tensor:
    """torch.where(nominal, staleness.gaussian_p(sr, gaussian, s, down, up), 0.0), bit for bit
    (module docstring). s, down, up: fp32, nominal: bool, CPU, contiguous, n elements each;
    gaussian: ("v", beta2, c) or ("m", beta1, sigma2 fp32 [n]). The result is this thread's
    row: valid until its next call on a layout of n elements. One range per thread, each
    range its whole pipeline (gauss_range): one handoff to the threads instead of one per pass."""
    job, G = gauss_job(sr, gaussian, s, down, up, nominal)
    n = s.numel()
    run_parts(lambda b0, b1, part: gauss_range(job, b0 * RANGE, min(b1 * RANGE, n)) or 0, n, RANGE, (),
              parts=range_parts(n))
    return G
