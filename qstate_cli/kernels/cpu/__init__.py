"""The CPU path: the fused optimizer steps and the state codec compiled with numba.

    codec.py     numba helpers: bit casts, the hash, bf16 casts, decode/encode of one block
    rounding.py  one element's code, a numba overload that picks the layout's branch-free
                 function in Python (layout.py: the layout tuple's columns and constants)
    native.py    numba intrinsics: fp32 bit casts, 32-bit shifts, arrays without reference counts, a kernel
                 called by its address (the team launches), the vector width (wide_features)
    pairs.py     the 4-bit encoder by code bytes (two elements per byte, AdamW: m and v at once)
    search.py    the floor code of a code book (bucketed search, or a scan of <= 16 entries),
                 shared with the replay kernel; host.search_table prepares its buckets
    book_rows.py a searched code book's rounding a row at a time, in stages (bnb-8bit's de8)
    members.py   a multi-tensor launch's members: the ones a range of blocks meets, their own
                 blocks in it, a state's arrays at the table's addresses (host.MemberTable)
    adamw.py     fused AdamW/Adam step (two states)
    lion.py, sgd.py, muon.py   one-state steps (Muon: the momentum update; Newton-Schulz in torch)
    host.py      a launch's table (each tensor's addresses, first block, stream keys; cached
                 per set of addresses), layout arrays, the thread split (no numba)
    replay.py    `qstate diagnose`'s fused state codec (diagnose/codec.FUSED["cpu"]; no numba
                 until used), its kernel in replay_kernel.py: one compilation for every layout
    replay_stats.py  the replay's integer statistics (stalls, code changes, per-code counts) on
                 the fused codec's codes, a snapshot's staleness histogram and dimension sums,
                 the gradients' statistics; kernels in replay_stats_kernel.py (no numba until used)
    replay_model.py  the replay's staleness model (diagnose/staleness.predict's per-element part:
                 empirical P(stall), nominal mask, the shadow's cells), kernel in replay_model_kernel.py;
                 thresholds.py: its rounding to the nearest code-book entry as a threshold search
    replay_gauss.py  the model's Gaussian P(stall) of m and v (staleness.gaussian_m / gaussian_v),
                 kernels in replay_gauss_kernel.py, with fp32_math_kernel.py: fp32_math's sqrt,
                 erf and exp (and exp_tail) in numba, the same bits as the torch reference
    replay_rule.py   the replay's AdamW/Adam rule and UpdateStats' per-unit sums in one pass each,
                 bit for bit the torch ops (diagnose/codec.replay_rule), kernels in replay_rule_kernel.py
    replay_step.py   one AdamW configuration's whole replay step (the rule, both states'
                 codec and statistics, the update's sums) in one numba call per thread, from the
                 kernels above (diagnose/fused_step.py), kernel in replay_step_kernel.py
    elementwise.py  encode and decode of unscaled 16-bit minifloat states (bf16, fp16) laid end
                 to end, where optim/small.py steps them together; kernels in elementwise_kernel.py
    team.py      numba's OpenMP team for a small layout's replay (threads that spin between launches)
    compiling.py numba's compilations reported to runtime.COMPILES (seconds, the first-use notice)
    locator.py   numba's disk cache of these kernels filed by source version, not checkout path
    torch_sum.py torch's CPU sum in torch's own order of additions (the statistics' per-unit and
                 per-step sums, a sum to one value split over torch's threads), probed against
                 torch once per process; kernel in torch_sum_kernel.py

The same spec as the Triton kernels (quant/, optim/rules.py), bit for bit, for the same
formats (launch.why_not_covered) and the block-scaled 4- and 8-bit minifloats, which no
Triton kernel takes (e4m3, e5m2, e2m1, e2m2: `minifloats=True`; tests/test_kernels_cpu_minifloat.py),
on fp32 and bf16 parameters and gradients. One pass per
quantization block (decode -> update -> absmax -> encode in an L1-resident row), parallel
over contiguous block ranges on torch.get_num_threads() threads (host.run_members: one
kernel call per launch steps all its tensors, and the ranges cross tensors).

Each kernel is compiled per state layout (`kernel_for(lay..., block)`: format kind, bits,
signedness, rounding, sqrt, scale dtype, code-book shape and block size are constants of
the compiled code, as the Triton kernels' tl.constexpr), so its per-block loops are
branch-free and packed (16 fp32 lanes per op on an AVX-512 host, 8 on AVX2:
native.wide_features). numba is optional (`pip install 'qstate-cli[cpu]'`) and
imported on first use only: this package's __init__ and host.py never import it. Compiled
code is cached on disk (`cache=True`; numba caches these closures too, keyed by their
constants), so only the first call with a new layout and dtype on a machine pays the
compile (docs/cpu.md states the cost). The cache lives in
`<NUMBA_CACHE_DIR or cache_dir()/numba>/<sha256 of this folder's sources and fp32_math.py>`:
numba invalidates a cached kernel only when its own file changes, not when an inlined
helper in codec.py does, so a folder per source version keeps an edited checkout from
loading stale kernels; a version's folder unused for 30 days goes when another version
starts (cache_in_use).

Three ways to call a helper (docs/cpu.md, "Compile time: LLVM's inlining"):
- `@njit(inline="always")`: numba copies the helper's IR into each call site, so LLVM
  optimizes it in its caller's context (the caller's stack rows cannot alias its arguments,
  so loops over them pack without runtime checks). numba's copy grows with the square of a
  large helper's size, at every level of nesting: most of a first use's compile time.
  Used for per-element helpers and for the optimizer kernels' block codec (codec.py,
  pairs.py, book_rows.py, adamw._update ...), which ran 4-10% slower the other way.
- `@njit(forceinline=True)`: compiled once per signature as a function of its own, which
  LLVM inlines into every caller. Used for the replay's and the 16-bit states' row
  helpers (replay_*_kernel.py, torch_sum_kernel.py, elementwise_kernel.py), measured at the
  same speed (except replay_kernel.round_book16, which ran 4% slower that way).
- a plain `@njit` function, called once per chunk or row: replay_model_kernel.chunk_windows
  and torch_sum_kernel.row_sum (a call costs nothing measurable there).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
import re
import shutil
import time
from pathlib import Path

import torch

from ...runtime import cache_dir

PATH = "cpu-numba"  # what optimizer rows and path_for() call this path
# kernel module (the optimizers' `kernel` attribute) -> (module here, launch function)
LAUNCHERS = {"adamw": ("adamw", "adamw_step"), "lion": ("lion", "lion_step"), "sgd": ("sgd", "sgd_step"),
             "muon": ("muon", "muon_momentum_step")}
_import_error: list = []


def unavailable_reason(device) -> str | None:
    """None if the CPU path can step tensors on `device`, else why not."""
    if torch.device(device).type != "cpu":
        return f"the CPU path steps CPU tensors only (got {torch.device(device).type})"
    if not _import_error:
        try:
            import numba  # noqa: F401
            _import_error.append(None)
        except Exception as exc:  # noqa: BLE001 - any import failure means no CPU path
            _import_error.append(f"numba is not importable ({type(exc).__name__}: {exc}); "
                                 f"pip install 'qstate-cli[cpu]'")
    return _import_error[0]


def covers(kernel: str | None) -> bool:
    """Whether the CPU path has this optimizer's kernel."""
    return kernel in LAUNCHERS


COMPILED_IN = Path(__file__).parents[2] / "fp32_math.py"  # outside this folder, compiled into its kernels
# fp32 NaNs of both signs, quiet and signalling, with and without payloads (bf16_nan)
NAN_PATTERNS = (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA5A5A5)


@functools.lru_cache(maxsize=None)
def bf16_nan() -> int | None:
    """The bf16 bits torch's CPU cast gives every fp32 NaN, which the kernels store for a NaN
    in a bf16 parameter (codec.f32_to_bf16_bits): 0xFFFF from torch's vectorized cast (AVX2,
    AVX-512), 0x7FC0 from its scalar one (ATEN_CPU_CAPABILITY=default), whatever the NaN's
    sign and payload; None where NaNs cast to more than one pattern (then a bf16 parameter
    takes the reference: optim/fused.why_reference). Probed on a row of one and of 67 elements (a vector
    loop and its remainder); the numba cache's folder depends on it (numba_cache_dir: the
    kernels compile it in)."""
    import numpy as np

    nans = torch.from_numpy(np.array(NAN_PATTERNS, np.uint32).view(np.int32)).view(torch.float32)
    seen = set()
    for row in (nans[:1], nans, nans.repeat(10)[:67]):
        seen |= set((row.to(torch.bfloat16).view(torch.int16).int() & 0xFFFF).tolist())
        copied = torch.empty(row.numel(), dtype=torch.bfloat16).copy_(row)
        seen |= set((copied.view(torch.int16).int() & 0xFFFF).tolist())
    return seen.pop() if len(seen) == 1 else None


def numba_cache_dir() -> Path:
    """Where compiled kernels are cached: one folder per version of this folder's sources
    (a sha256 of them), under NUMBA_CACHE_DIR if set, else under cache_dir()/numba (codec.py
    points numba there before any kernel is compiled). Under NUMBA_CACHE_DIR too: numba
    checks only a kernel's own file, so an edited inlined helper (rounding.py, pairs.py,
    codec.py) would otherwise load the kernel compiled before the edit. The digest also reads
    qstate_cli/fp32_math.py, whose constants the kernels compile in (fp32_math_kernel.py),
    and torch's bf16 NaN (bf16_nan: another torch build or ATEN_CPU_CAPABILITY may cast NaN
    to other bits)."""
    sources = sorted(Path(__file__).parent.glob("*.py")) + [COMPILED_IN]
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in sources)
                            + f"bf16 NaN {bf16_nan()}".encode()).hexdigest()[:16]
    root = Path(os.environ["NUMBA_CACHE_DIR"]) if os.environ.get("NUMBA_CACHE_DIR") else cache_dir() / "numba"
    return root / digest


USED = ".qstate-used"  # touched in a version's folder by each process that compiles or loads there
UNUSED_DAYS = 30  # a version's folder unused this long is removed when another version starts


def cache_in_use(now: float | None = None) -> Path:
    """numba_cache_dir(), marked as used now; other versions' folders beside it that no
    process has used for UNUSED_DAYS days are removed (8-42 MB each: every upgrade or edit of
    these sources makes a new one). Only folders named like a digest are candidates, and under
    NUMBA_CACHE_DIR, which may be shared, only those holding the mark; under qstate's own
    cache a folder from before the mark counts as used when it was last written. A cache that
    cannot be written is left as it is."""
    folder = numba_cache_dir()
    now = time.time() if now is None else now
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / USED).touch()
        os.utime(folder / USED, (now, now))
    except OSError:
        return folder
    ours = not os.environ.get("NUMBA_CACHE_DIR")
    for other in folder.parent.iterdir():
        if other == folder or not re.fullmatch(r"[0-9a-f]{16}", other.name) or not other.is_dir():
            continue
        mark = other / USED
        try:
            used = mark.stat().st_mtime if mark.exists() else (other.stat().st_mtime if ours else None)
        except OSError:
            continue
        if used is not None and now - used > UNUSED_DAYS * 86400:
            shutil.rmtree(other, ignore_errors=True)
    return folder


def launcher(kernel: str):
    """The launch function of the CPU path for kernel `kernel` (imports numba)."""
    module, name = LAUNCHERS[kernel]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
