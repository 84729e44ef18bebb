"""numba's OpenMP team for a small layout's replay: a launch split over threads that spin
between launches, where host.run_parts' pool threads sleep (docs/diagnose.md, "A team that
does not sleep"). No numba at import: team_ready imports it, and the kernels, on first use.

    with team(n):                    # the replay of a small layout (diagnose/replay.py)
        parts = team_parts(numel)    # > 1: launch the kernel's team wrapper over `parts` threads
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from functools import lru_cache

import numpy as np

_TEAM: list[int] = []  # team's counts, innermost last
_OFF: list[str] = []  # why the team was turned off in this process (team_off), if it was
_LOCAL = threading.local()  # .team: the size numba's team of this thread was set to
TEAM_MIN_ELEMENTS = 1 << 13  # a team thread's least share of a launch


@contextmanager
def team(n: int):
    """Inside the block a kernel that has a team launch (team_parts) may split a launch of
    fewer elements than run_parts would over up to n threads of numba's OpenMP team: its
    threads wait for the next launch spinning (libgomp's default, ~4 ms here), where a pool
    thread of run_parts sleeps and a launch paid its wake-up, ~90 us on the 2-core Xeon
    against a ~130 us step of the demo's 24,320 elements. For a small layout's replay, where
    torch runs on one thread and nothing else uses the other cores (diagnose/replay.py)."""
    _TEAM.append(int(n))
    try:
        yield
    finally:
        _TEAM.pop()


def team_parts(numel: int) -> int:
    """Threads of numba's team a launch of numel elements splits over inside `team`: at most
    its count, each thread >= TEAM_MIN_ELEMENTS, 1 where numba's layer is not OpenMP. Where
    more than 1, the calling thread's team is that size (numba's count is per thread; its
    default, every CPU, would wake them all for each launch)."""
    n = min(_TEAM[-1] if _TEAM else 1, int(numel) // TEAM_MIN_ELEMENTS)
    if n < 2 or _OFF or not team_ready(n):
        return 1
    if getattr(_LOCAL, "team", None) != n:
        import numba

        numba.set_num_threads(n)
        _LOCAL.team = n
    return n


@lru_cache(maxsize=None)
def team_ready(n: int) -> bool:
    """numba runs a team of n threads through OpenMP (its threading layer, fixed at the first
    parallel launch: this probe's). Its workqueue layer puts its threads to sleep between
    launches, which is what the team avoids; a numba without any layer raises (False)."""
    try:
        import numba

        from .replay_step_kernel import team_probe

        out = np.zeros(numba.config.NUMBA_NUM_THREADS, np.int64)
        team_probe(out)
        return numba.threading_layer() == "omp" and out.size >= n and bool((out == np.arange(1, out.size + 1)).all())
    except (ImportError, ValueError, RuntimeError):
        return False


def launched(launch) -> bool:
    """launch() (a kernel's team launch: on first use it takes the step's address and compiles
    the wrapper, native.call_compiled), True; or, where this numba's internals are not the ones
    call_compiled is written for and building the launch fails (before anything runs), the
    team off for the process (team_off) and False: the caller steps on its one-thread path
    (the same values)."""
    try:
        return bool(launch())
    except Exception as err:  # noqa: BLE001 - any failure to build the launch: the one-thread path stays
        team_off(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return False


def team_off(why: str) -> None:
    """No team launches in this process from now on (why: kept in _OFF)."""
    _OFF.append(why)
