"""numba's compilations reported to runtime.COMPILES: their seconds (the replay profile leaves
them out of its throughput, diagnose/run.profile) and a one-time notice when the first one
starts, which the CLI prints on stderr. A first use of a qstate version on a machine compiles
its kernels for minutes (docs/cpu.md states the cost; later processes load them from numba's
disk cache in well under a second, and a cache hit is no compilation). numba broadcasts a
"numba:compile" event around each compilation of a dispatcher, nested where a kernel's
compilation compiles the functions it calls; its compiler lock runs them one at a time, and
is held too while a kernel loads from the disk cache ("numba:compiler_lock": COMPILES.held).
Imports numba: codec.py installs the listener before any kernel compiles."""
from __future__ import annotations

import numba
from numba.core import event

from ...runtime import COMPILES


def notice() -> str:
    return ("qstate: compiling the CPU kernels for this machine: the first use of this qstate version "
            f"here takes minutes, later runs load them from {numba.config.CACHE_DIR}")


class _Reporter(event.Listener):
    def on_start(self, ev):
        COMPILES.begin(notice())

    def on_end(self, ev):
        COMPILES.end()


class _Holder(event.Listener):
    """numba's compiler lock: held to compile and to load a compiled kernel from the cache."""

    def on_start(self, ev):
        COMPILES.enter()

    def on_end(self, ev):
        COMPILES.leave()


_REPORTER: list = []


def install() -> None:
    """Report numba's compilations, and its compiler lock's holds, to runtime.COMPILES from
    now on (once per process)."""
    if not _REPORTER:
        _REPORTER.extend([_Reporter(), _Holder()])
        event.register("numba:compile", _REPORTER[0])
        event.register("numba:compiler_lock", _REPORTER[1])
