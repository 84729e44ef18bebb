"""Where the work runs: the device, out-of-memory, memory release, CPU threads, timers.

One definition of each, used by every engine (bench, diagnose, train, trace):

    resolve_device("auto" | "cpu" | "cuda" | "cuda:N" | torch.device) -> torch.device
        auto: CUDA when present, else the CPU; CUDA asked for where there is none is a
        usage error (QstateError, exit 2)
    is_oom(exc) -> bool
        torch's OutOfMemoryError (CUDA), a RuntimeError whose message says "out of memory"
        (CUDA, MPS) or "can't allocate memory" (the CPU allocator), and Python's MemoryError
    free_memory(device)
        a garbage-collector pass, and on CUDA the caching allocator's unused blocks
    torch_threads(n)
        torch's intra-op CPU threads set to n inside a `with` block (None: unchanged)
    Timer(device, sync)
        wall seconds per named phase, summed over calls; sync=True on CUDA synchronizes
        around each phase so a phase is charged for the GPU work it queued; and the seconds
        of kernel compilation that ended inside each phase (COMPILES)
    COMPILES
        this process's kernel compilations (the CPU path's numba kernels report theirs):
        seconds, count, a notice when the first one starts, and one more for each later
        burst of compilations still running after LATER_NOTICE_S (another kernel family)
    Workers(n)
        fn(item) for every item of a list on n threads (this one among them), returning
        when all are done: independent pieces of work in one step of a loop
    cache_dir()
        qstate's cache folder: $QSTATE_CACHE, else $XDG_CACHE_HOME/qstate, else ~/.cache/qstate;
        made 0700, and refused when another user owns it or group or others may write in it

The benchmark clock (repetitions, CUDA events, L2 flush) is bench/timing.py: a timer of
phases and a measurement of a step's time are different things.
"""
from __future__ import annotations

import gc
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from .errors import QstateError

OOM_MESSAGES = ("out of memory", "can't allocate memory")


def resolve_device(name: str | torch.device | None = "auto", here: bool = True) -> torch.device:
    """The device `name` means here (see module docstring); here=False checks the name only
    (CUDA asked for where there is none is not an error: a suite checked on a laptop)."""
    if isinstance(name, torch.device):
        name = str(name)
    text = (name or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if here and not torch.cuda.is_available():
            raise QstateError(f"--device {text}: CUDA is not available here (use --device cpu or auto)")
        return torch.device(text)
    raise QstateError(f"unknown device {name!r}: use auto, cpu or cuda[:N]")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size under torch.distributed; (0, 1) without it."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_oom(exc: BaseException) -> bool:
    """True when `exc` says memory ran out (see module docstring)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in OOM_MESSAGES)


def free_memory(device: torch.device | str | None = None) -> None:
    """Release what can be released: unreachable objects, and CUDA's cached blocks."""
    gc.collect()
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def torch_threads(n: int | None):
    """torch's intra-op CPU threads set to `n` inside the block, restored after (None:
    leave them). Small ops run fastest on one thread: each op is then tens of
    microseconds, and more threads only add a fork/join barrier per op, which on a busy
    machine waits for a descheduled thread (measured: 1.8 vs 43 steps/s, bench train)."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class CompileNotice(UserWarning):
    """A first use on this machine is compiling the CPU kernels (minutes, once): what a
    script that steps a qstate optimizer sees on stderr; the CLI prints the text instead."""


class CompileClock:
    """Kernel compilations in this process: `seconds` of wall time (outermost compilations
    only: compiling a kernel compiles the functions it calls inside it) and their `count`.
    A compiler reports each compilation by `begin()` and `end()` (kernels/cpu/compiling.py
    for numba, whose compiler lock runs one at a time). The first `begin()` calls
    `notice(text)`: the CLI prints it on stderr, since a first use on a machine compiles for
    minutes; else it is a CompileNotice warning (stderr). Each kernel family (a preset,
    format or replay path) compiles on its first use, ~40-50 s each on a first use here, so
    a later burst of compilations (one starting QUIET_S or more after the last one ended: a
    training script's second preset, say) says so too, once per burst, when a compilation
    of it is still running LATER_NOTICE_S after the burst's first began (LATER_TEXT; from a
    timer thread, one pending per burst at a time: a timer that finds no compilation running
    lets the burst's next begin() arm the next): a short compile says nothing, a long one is
    not a silent pause. The CLI's notice (cli/output.say) prints through the same rich
    console as its progress bars, which prints it above a live bar from any thread.

    `held`: wall seconds inside the compiler (outermost `enter()` .. `leave()`, numba's
    compiler lock), which holds the compilations and also the loads of compiled kernels from
    the disk cache: `held - seconds` is the loading, ~0.15 s in a process that replays
    (the first call of each kernel), which the replay profile leaves out of its rates too."""

    LATER_NOTICE_S = 2.0  # a later burst still compiling after this long says so
    QUIET_S = 5.0  # compilations closer than this to the last one's end are one burst
    LATER_TEXT = ("qstate: compiling more CPU kernels (a kernel family this process has not used yet: another "
                  "preset, format or replay path); about a minute each on a first use here, not a hang")

    def __init__(self, clock: Callable[[], float] | None = None, timer: Callable | None = None):
        """`clock` (seconds; time.perf_counter, looked up at each call) and `timer`
        (threading.Timer's signature) are the wall clock and the notice's timer; a test gives fakes."""
        self.notice: Callable[[str], None] | None = None
        self._clock = clock or (lambda: time.perf_counter())
        self._timer = timer or (lambda *args: threading.Timer(*args))
        self._compiles, self._holds = _Outermost(self._clock), _Outermost(self._clock)
        self._told = False
        self._lock = threading.Lock()
        self._last_end = -float("inf")  # when the last outermost compilation ended (perf_counter)
        self._burst, self._burst_told = 0, False
        self._armed = 0  # the burst whose timer is pending (0: none): one timer at a time

    seconds = property(lambda self: self._compiles.seconds)
    count = property(lambda self: self._compiles.count)
    held = property(lambda self: self._holds.seconds)

    def enter(self) -> None:
        """The compiler is entered (to compile, or to load a compiled kernel)."""
        with self._lock:
            self._holds.open()

    def leave(self) -> None:
        with self._lock:
            self._holds.close()

    def begin(self, text: str) -> None:
        with self._lock:
            if not self._compiles.open():
                return
            tell, self._told = not self._told, True
            if tell or self._clock() - self._last_end >= self.QUIET_S:  # a new burst
                self._burst, self._burst_told = self._burst + 1, tell
            burst = self._burst
            arm = not self._burst_told and self._armed != burst
            if arm:
                self._armed = burst
        if tell:
            self._tell(text)
        elif arm:
            timer = self._timer(self.LATER_NOTICE_S, self._later, (burst,))
            timer.daemon = True
            timer.start()

    def _later(self, burst: int) -> None:
        """LATER_NOTICE_S after a compilation of a later burst began: say so if one still runs
        (else the burst's next begin() arms the next timer: one pending at a time)."""
        with self._lock:
            if self._armed == burst:
                self._armed = 0
            if burst != self._burst or self._burst_told or self._compiles._depth == 0:
                return
            self._burst_told = True
        self._tell(self.LATER_TEXT)

    def _tell(self, text: str) -> None:
        if self.notice is not None:
            self.notice(text)
        else:  # a training script: a warning that a filter can silence
            import warnings
            warnings.warn_explicit(text, CompileNotice, "qstate", 0)  # no source line: deep inside numba

    def end(self) -> None:
        with self._lock:
            self._compiles.close()
            if self._compiles._depth == 0:
                self._last_end = self._clock()


class _Outermost:
    """Wall `seconds` and `count` of the outermost of nested open() .. close() intervals."""

    def __init__(self, clock: Callable[[], float]):
        self.seconds, self.count, self._depth, self._t0 = 0.0, 0, 0, 0.0
        self._clock = clock

    def open(self) -> bool:
        """Returns whether this interval is an outermost one."""
        self._depth += 1
        if self._depth == 1:
            self._t0 = self._clock()
        return self._depth == 1

    def close(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.seconds += self._clock() - self._t0
            self.count += 1


COMPILES = CompileClock()


class Timer:
    """Wall seconds per named phase, summed over calls:

        timer = Timer(device, sync=False)
        with timer("gather"): ...
        timer.totals   # {"gather": 1.25, ...}
        timer.seconds  # their sum

    On CUDA without sync a phase is the host time of queuing its work (cheap, inexact);
    with sync=True the device is synchronized before and after each phase, so the phase
    holds exactly the GPU work it queued. On a CPU the two are the same."""

    def __init__(self, device: torch.device | str = "cpu", sync: bool = False):
        self.device = torch.device(device)
        self.sync = bool(sync) and self.device.type == "cuda"
        self.totals: dict[str, float] = {}
        self.compiled: dict[str, float] = {}  # seconds of COMPILES that ended inside each phase
        self.loaded: dict[str, float] = {}  # and of its loads (COMPILES.held less its compilations)
        self.calls: dict[str, int] = {}  # calls of each phase
        self.first: dict[str, float] = {}  # its first call's seconds, less what that call compiled or loaded
        self._lock = threading.Lock()  # threads may time one phase side by side (validate.py's runs)

    @property
    def exact(self) -> bool:
        """Whether each phase's time is exact (synchronized, or on a CPU)."""
        return self.sync or self.device.type != "cuda"

    @property
    def seconds(self) -> float:
        return sum(self.totals.values())

    @contextmanager
    def __call__(self, name: str):
        if self.sync:
            torch.cuda.synchronize(self.device)
        t0, c0, h0 = time.perf_counter(), COMPILES.seconds, COMPILES.held
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize(self.device)
            took = time.perf_counter() - t0
            compiled, loaded = COMPILES.seconds - c0, (COMPILES.held - h0) - (COMPILES.seconds - c0)
            with self._lock:
                self.totals[name] = self.totals.get(name, 0.0) + took
                if compiled > 0:
                    self.compiled[name] = self.compiled.get(name, 0.0) + compiled
                if loaded > 0:
                    self.loaded[name] = self.loaded.get(name, 0.0) + loaded
                if name not in self.calls:
                    self.first[name] = max(0.0, took - max(0.0, compiled) - max(0.0, loaded))
                self.calls[name] = self.calls.get(name, 0) + 1

    @property
    def setup(self) -> dict[str, float]:
        """Per phase called more than once, the seconds its first call took beyond the mean of
        its other calls (each less what it compiled and loaded), where positive: the one-time
        work a process or a loop does in its first call (imports, probes, starting threads,
        first touches of new buffers). The replay's profile leaves it out of its rates, as it
        does compiling and loading (diagnose/run.profile)."""
        out = {}
        for name, n in self.calls.items():
            if n < 2:
                continue
            rest = self.totals[name] - self.compiled.get(name, 0.0) - self.loaded.get(name, 0.0) - self.first[name]
            extra = self.first[name] - max(0.0, rest) / (n - 1)
            if extra > 0:
                out[name] = extra
        return out


class StepClock(Timer):
    """A loop's steps timed whole, as one Timer phase ("step"): each step's wall seconds and
    how much of them the process held numba's compiler (COMPILES: compiling, or loading from
    the disk cache), counted once however many threads worked inside the step (Timer's
    phases each count what happened while they were open, so phases that run side by side
    count it again):

        clock = StepClock()
        for ...:
            with clock(): ...
        clock.compiled_s, clock.loaded_s   # in all
        clock.setup_s                      # the first step beyond the mean of the others (Timer.setup)

    setup_s, each step less what it held: the loop's one-time work (imports, probes,
    starting threads). A profile leaves all three out of the loop's wall and CPU seconds."""

    STEP = "step"

    def __call__(self):
        return super().__call__(self.STEP)

    @property
    def compiled_s(self) -> float:
        return self.compiled.get(self.STEP, 0.0)

    @property
    def loaded_s(self) -> float:
        return self.loaded.get(self.STEP, 0.0)

    @property
    def setup_s(self) -> float:
        return self.setup.get(self.STEP, 0.0)


class Workers:
    """Run independent calls on n threads, this thread one of them:

        with Workers(2) as workers:
            for step in ...:
                workers.each(fn, items)   # fn(item) once per item, in any order; returns when all are done

    Each of the n threads takes the next item not yet taken until none is left, so a slow
    item does not hold the others back. An exception in any call is raised by `each`,
    after every thread has stopped. The calls must not share anything they write; they
    run in parallel only where they release the GIL (numba's nogil kernels, torch ops).
    n = 1 (or a single item) calls fn on this thread, in order, with no pool."""

    def __init__(self, n: int):
        self.n = max(1, int(n))
        self._pool = ThreadPoolExecutor(self.n - 1, thread_name_prefix="qstate-worker") if self.n > 1 else None

    def each(self, fn: Callable, items: list) -> None:
        if self._pool is None or len(items) < 2:
            for item in items:
                fn(item)
            return
        taken, lock = [0], threading.Lock()

        def drain():
            while True:
                with lock:
                    k = taken[0]
                    taken[0] += 1
                if k >= len(items):
                    return
                fn(items[k])

        helpers = [self._pool.submit(drain) for _ in range(min(self.n, len(items)) - 1)]
        try:
            drain()
        finally:
            errors = [f.exception() for f in helpers]  # waits for each helper to stop
        for exc in errors:
            if exc is not None:
                raise exc

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def cache_dir() -> Path:
    """qstate's cache folder (demo and corpus traces, compiled CPU kernels): $QSTATE_CACHE,
    else $XDG_CACHE_HOME/qstate, else ~/.cache/qstate; always an absolute path (a relative
    $QSTATE_CACHE is read from the working folder now, so a later chdir does not move it;
    a relative $XDG_CACHE_HOME is ignored, as the XDG spec says).

    The folder holds pickles that numba loads (its compiled kernels: loading one runs code)
    and traces that are replayed, so whoever can write in it runs code as us. It is made
    mode 0700 when missing; one that another user owns (QSTATE_CACHE naming a shared folder
    such as /tmp) is refused (QstateError); one of ours that group or others may write in
    (made by an older qstate under umask 002) loses their write permission (chmod go-w);
    an existing 0755 folder of ours is fine. One that cannot be made (a file, /proc) is
    returned as it is: its writer says why it cannot write there (docs/errors.md)."""
    if os.environ.get("QSTATE_CACHE"):
        folder = Path(os.path.abspath(os.path.expanduser(os.environ["QSTATE_CACHE"])))
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        folder = Path(xdg if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "qstate"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(folder)
    except OSError:
        return folder
    if info.st_uid != os.geteuid():
        raise QstateError(f"cache {folder}: owned by another user (uid {info.st_uid}); the cache holds compiled code "
                          f"that qstate loads: set QSTATE_CACHE to a folder of your own")
    if info.st_mode & 0o022:  # ours (an older qstate made it under umask 002): group and others lose write
        try:
            os.chmod(folder, info.st_mode & 0o7755)
        except OSError as exc:
            raise QstateError(f"cache {folder}: group or others may write in it (mode {info.st_mode & 0o7777:o}) "
                              f"and chmod go-w failed ({exc.strerror}); the cache holds compiled code that qstate "
                              f"loads: set QSTATE_CACHE to a folder of your own") from None
    return folder
