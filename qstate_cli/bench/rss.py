"""The peak resident memory of a piece of work on a CPU (Linux), for `qstate bench memory`.

    peak_over(work) = VmHWM after work - VmRSS before it        (bytes, whole process)

Before: gc.collect() and glibc's malloc_trim(0), so memory a previous row freed goes back
to the kernel and cannot hide growth (it would be reused without raising the resident
size); then "5" written to /proc/self/clear_refs resets the high-water mark VmHWM to the
current resident size (Linux >= 4.0), and VmRSS is read. After: VmHWM, which the kernel
raises to the resident size before it unmaps or trims memory, so a temporary freed before
the work returns still counts.

This is the process's resident memory, not an allocator's: other threads allocating
meanwhile count, memory released during the work (another thread's frees, file pages the
kernel reclaims) hides as much growth, memory the allocator keeps after a free (and reuses) counts once, pages
are 4 KiB, and memory allocated but never written counts not at all. torch's CPU
allocator caches nothing, so a step's temporaries do show (docs/bench.md).

`unavailable()` says why this cannot be measured here (not Linux, no /proc, clear_refs not
writable, or a high-water mark that does not reset), or None; it probes once per paths.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys
from typing import Callable

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"
SOURCE = "process-rss"  # the rows' `measured_by` on a CPU
PROBE_BYTES = 32 * 2**20


def _kib(status: str, key: str) -> int:
    with open(status) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"{status} has no {key} line")


@functools.lru_cache(maxsize=None)
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def trim(collect: bool = True) -> None:
    """Unreachable objects collected (a full gc costs ~0.2 s with torch loaded: once per row,
    `collect=False` after it), and the memory glibc keeps after free() returned."""
    if collect:
        gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def reset() -> int:
    """VmHWM reset to the current resident size; returns VmRSS in bytes."""
    with open(CLEAR_REFS, "w") as f:
        f.write("5")
    return _kib(STATUS, "VmRSS") * 1024


def high_water() -> int:
    return _kib(STATUS, "VmHWM") * 1024


def peak_over(work: Callable[[], object], collect: bool = True) -> int:
    """Bytes of resident memory the process reached during work() above where it started
    (collect: a full gc first; tensors are freed by reference counting without one)."""
    trim(collect)
    before = reset()
    work()
    return max(0, high_water() - before)


def unavailable() -> str | None:
    """Why process RSS cannot be measured here, or None (probed once per paths)."""
    return _probe(sys.platform, STATUS, CLEAR_REFS)


@functools.lru_cache(maxsize=None)
def _probe(platform: str, status: str, clear_refs: str) -> str | None:
    if not platform.startswith("linux"):
        return f"process RSS needs Linux's /proc/self/clear_refs (platform {platform})"
    try:
        _kib(status, "VmHWM"), _kib(status, "VmRSS")
        trim()
        buf = b"\x01" * PROBE_BYTES  # written, so resident
        del buf
        trim()
        raised = _kib(status, "VmHWM") - _kib(status, "VmRSS")
        with open(clear_refs, "w") as f:
            f.write("5")
        left = _kib(status, "VmHWM") - _kib(status, "VmRSS")
    except OSError as exc:
        return f"process RSS: {exc.strerror or exc} ({exc.filename or status})"
    if raised * 1024 < PROBE_BYTES // 2:
        return (f"process RSS: a written {PROBE_BYTES >> 20} MiB buffer left VmHWM only {raised} KiB above "
                f"VmRSS once freed, so the high-water mark cannot be trusted here")
    if left * 1024 > PROBE_BYTES // 4:
        return f"process RSS: writing 5 to {clear_refs} did not reset VmHWM ({left} KiB above VmRSS after it)"
    return None
