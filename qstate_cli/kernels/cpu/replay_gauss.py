"""The replay's Gaussian staleness model on CPU: diagnose/staleness.gaussian_v / gaussian_m of
a state's cell, masked to the nominal updates as stats.ModelStats sums them,

    G_i = nominal_i ? P_gauss(s_i, down_i, up_i) : 0        (fp32 [n], the same bits)

in one numba pass over memory (replay_gauss_kernel.v_gauss, m_gauss) instead of ~60-150 torch
ops, each its own pass. The sqrt, erf and exp are fp32_math's, which staleness.py takes on
CPU: IEEE basic operations only, so numba gives torch's bits (fp32_math_kernel.py).
Until 2026-12-05 the model took torch's own (MKL's) sqrt, erf and exp, in passes around
torch's calls on scratch rows, with their slow arguments (sqrt(+0), exp's underflow)
worked around; on AMD those run MKL's generic code (docs/diagnose.md, "Replay throughput").

Threads: one range per thread (host.run_parts); replay_model.StalenessModel.sums runs each
thread's range of its pass, this model (gauss_range) and the sums in one handoff. A small
layout (one run_parts thread, inside team.team) splits each pass over numba's team instead
(_team_launch): on the demo's 24,320 elements at one thread sr-4bit's m and v took ~200 and
~140 us a model step while the other core waited.
Per state and model step: v: one pass; m: m_sigma once per sigma^2 (the replay's: one per
step, for every configuration), then one pass. Rows: SIG, G: 2 fp32 per element per layout
size and calling thread (Outputs; replay_model.py's rule).
No numba at import: the kernels are imported on first use.
"""
from __future__ import annotations

import math
import threading
from functools import lru_cache

import numpy as np
import torch

from .host import parts_of, run_parts
from .team import launched, team_parts

RANGE = 4096  # elements per range of run_parts (threads from host.MIN_THREAD_ELEMENTS)
_KERNELS: dict = {}
_LOCAL = threading.local()  # .outputs: n -> Outputs, the thread's latest layout size only


class Outputs:
    """The calling thread's rows for a layout of n elements: SIG [n] (sigma), G [n] (the
    result), as torch tensors and their numpy views. SIG stays while the same sigma^2 comes
    again (the replay's: one per step and shadow, for every configuration)."""

    def __init__(self, n: int):
        self.SIG, self.G = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        self.sigma_of, self.sigma_version = None, -1  # the sigma^2 tensor (and its version) SIG holds sigma of
        self.np = self.SIG.numpy(), self.G.numpy()


def _outputs(n: int) -> Outputs:
    held = _LOCAL.__dict__.setdefault("outputs", {})
    if n not in held:
        held.clear()
        held[n] = Outputs(n)
    return held[n]


def _kernels():
    if not _KERNELS:
        from . import replay_gauss_kernel as k
        _KERNELS.update(v_nearest=k.v_nearest, v_stochastic=k.v_stochastic, m_sigma=k.m_sigma,
                        m_nearest=k.m_nearest, m_stochastic=k.m_stochastic, v_team=k.v_team, m_team=k.m_team)
    return _KERNELS


@lru_cache(maxsize=256)  # read-only (the kernels never write it); one (beta, c) per state and replay
def constants(beta: float, c: float = 0.0) -> np.ndarray:
    """fp32 [6] (replay_gauss_kernel.columns): 1 - beta, c, 1e30, pi, sqrt 2, sqrt(2 pi), each
    Python scalar as torch takes it (fp32)."""
    return np.array([1 - beta, c, 1e30, math.pi, math.sqrt(2.0), math.sqrt(2 * math.pi)], np.float32)


class Job:
    """One masked_gaussian call, ready for gauss_range on any range of its elements: the
    Gaussian's kind ("v" or "m"), sr, the numpy rows it reads (x: s or m, down, up, nominal,
    and m's sigma^2 and SIG) and writes (G), and its constants (`constants`)."""

    __slots__ = ("kind", "sr", "x", "down", "up", "nominal", "sigma2", "SIG", "sigma", "G", "cst", "zero")


def gauss_job(sr: bool, gaussian, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
              nominal: torch.Tensor) -> tuple[Job, torch.Tensor]:
    """(the Job of masked_gaussian's arguments, its result row G: this thread's, valid until
    its next call on a layout of n elements). m's sigma = sqrt(where(sigma^2 > 0, sigma^2, 1))
    is computed once per sigma^2 (the replay's: one per step, for every configuration): by
    this job's ranges (job.sigma), each range before m_gauss reads it. SIG is marked as
    holding it here already: a range that fails raises out of the replay."""
    n = x.numel()
    for t in (x, down, up, nominal) + ((gaussian[2],) if gaussian[0] == "m" else ()):
        if t.device.type != "cpu" or t.numel() != n or not t.is_contiguous() or t.dim() != 1 \
                or t.dtype != (torch.bool if t is nominal else torch.float32):
            raise ValueError(f"the fused Gaussian model needs contiguous fp32 CPU tensors of {n} elements "
                             f"and a bool mask (got {t.dtype} {t.device.type} {t.numel()})")  # no bound checks
    out = _outputs(n)
    job = Job()
    job.kind, job.sr = gaussian[0], bool(sr)
    job.x, job.down, job.up, job.nominal = (t.numpy() for t in (x, down, up, nominal))
    job.SIG, job.G = out.np
    job.sigma2, job.sigma, job.zero = None, False, False
    beta, arg = gaussian[1], gaussian[2]
    if job.kind == "v":
        job.zero = arg <= 0  # gaussian_v: zeros
        job.cst = constants(beta, arg)
        return job, out.G
    job.sigma2 = arg.numpy()
    if out.sigma_of is not arg or out.sigma_version != arg._version:  # sigma once per sigma^2 (replay step)
        job.sigma = True
        out.sigma_of, out.sigma_version = arg, arg._version
    job.cst = constants(beta)
    return job, out.G


def gauss_range(job: Job, i0: int, i1: int) -> None:
    """G[i0:i1] of the job: m's sigma there first where this sigma^2 is new (m_sigma), then
    the model's pass (v_gauss or m_gauss, one kernel per rounding)."""
    if job.zero:
        job.G[i0:i1] = 0.0
        return
    k, cnt, r = _kernels(), i1 - i0, slice(i0, i1)
    rounding = "stochastic" if job.sr else "nearest"
    if job.kind == "v":
        k["v_" + rounding](0, 1, 0, job.x[r], job.down[r], job.up[r], job.nominal[r], job.cst, job.G[r], cnt, cnt)
        return
    if job.sigma:
        k["m_sigma"](0, 1, 0, job.sigma2[r], job.SIG[r], cnt, cnt)
    k["m_" + rounding](0, 1, 0, job.x[r], job.down[r], job.up[r], job.sigma2[r], job.SIG[r], job.nominal[r],
                       job.cst, job.G[r], cnt, cnt)


def range_parts(n: int) -> int:
    """Threads gauss_range's callers split n elements over: host.parts_of(n) where torch runs
    on one thread (inside host.torch_aside, where the kernels take the cores), else 1 (then
    replay_model.StalenessModel.sums takes predict's way)."""
    return parts_of(n) if torch.get_num_threads() == 1 else 1


def masked_gaussian(sr: bool, gaussian, s: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
                    nominal: torch.Tensor) -> torch.Tensor:
    """torch.where(nominal, staleness.gaussian_p(sr, gaussian, s, down, up), 0.0), bit for bit
    (module docstring). s, down, up: fp32, nominal: bool, CPU, contiguous, n elements each;
    gaussian: ("v", beta2, c) or ("m", beta1, sigma2 fp32 [n]). The result is this thread's
    row: valid until its next call on a layout of n elements. One range per thread (gauss_range)."""
    job, G = gauss_job(sr, gaussian, s, down, up, nominal)
    n = s.numel()
    parts = range_parts(n)
    team = team_parts(n) if parts == 1 and not job.zero else 1  # a small layout: numba's team (team.py)
    if not (team > 1 and launched(lambda: _team_launch(job, team, n))):
        run_parts(lambda b0, b1, part: gauss_range(job, b0 * RANGE, min(b1 * RANGE, n)) or 0, n, RANGE, (),
                  parts=parts)
    return G


_ADDRESS: dict = {}  # kernel name -> the address of its code for the full rows' types (native.compiled_address):
# one set of types (gauss_job admits 1-D contiguous fp32 / bool rows only; constants' fp32 [6]; int64 counts)


def _team_launch(job: Job, team: int, n: int) -> bool:
    """The job's kernels over `team` threads of numba's team, RANGE-element blocks split into
    contiguous ranges (the same values as gauss_range over the whole row), each kernel called
    by its address, taken on first use."""
    k = _kernels()
    rounding = "stochastic" if job.sr else "nearest"
    nblocks = -(-n // RANGE)
    if job.kind == "v":
        args = (job.x, job.down, job.up, job.nominal, job.cst, job.G, RANGE, n)
        k["v_team"](_address("v_" + rounding, args), team, nblocks, *args)
        return True
    args = (job.x, job.down, job.up, job.sigma2, job.SIG, job.nominal, job.cst, job.G, RANGE, n)
    k["m_team"](_address("m_sigma", (job.sigma2, job.SIG, RANGE, n)), _address("m_" + rounding, args),
                bool(job.sigma), team, nblocks, *args)
    return True


def _address(name: str, args: tuple) -> int:
    if name not in _ADDRESS:
        from .native import compiled_address
        _ADDRESS[name] = compiled_address(_kernels()[name], (0, 0, 0) + args)
    return _ADDRESS[name]
