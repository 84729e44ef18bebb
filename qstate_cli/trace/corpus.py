"""The trace corpus: named gradient traces from different models and tasks, recorded on
first use (seeded, on one CPU thread, nothing downloaded) and cached beside the demo trace.

    corpus:NAME      works wherever a trace path does (`qstate diagnose corpus:digits-cnn`,
                     `trace: corpus:tiny-lm` in a suite); `demo` is the demo trace
    qstate trace corpus [--record NAME|all]   lists them (cached or not, size, sha256)

Which 4-bit configuration tracks fp32 best depends on the gradients, so claims are made
across this corpus, not on one trace. The cache file name holds the recipe's settings and
the qstate version (a change to either records anew; a cached file that is not the whole
trace is recorded again); `fingerprint` is the sha256 of the
recorded gradients, the same for the same seed, torch build and CPU kind.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import QstateError
from . import recipes
from ..runtime import cache_dir
from .demo import DEFAULT as DEMO_SETTINGS, cached_demo, check_cache, demo_path
from .partial import cache_problem

PREFIX = "corpus:"
DEMO = "demo"


@dataclass(frozen=True)
class CorpusEntry:
    name: str
    task: str  # what is trained, on what
    steps: int
    record: Callable  # recipes: (out, steps, seed, log) -> summary
    needs: tuple[str, ...] = ()  # optional packages the recipe imports
    seed: int = 0

    @property
    def filename(self) -> str:
        from .. import __version__

        return f"corpus-{self.name}-{self.steps}steps-seed{self.seed}-qstate{__version__}.pt"


ENTRIES: dict[str, CorpusEntry] = {e.name: e for e in (
    CorpusEntry("synthetic-heavy", "heavy-tailed (Student-t 3), non-stationary (g^2 falls 10x, regime changes, "
                "spikes) synthetic gradients, 4 x 2048 elements a decade apart", 3000, recipes.record_synthetic),
    CorpusEntry("tiny-lm", "byte-level transformer (0.14 M params) on the pydoc topics: the demo trace",
                DEMO_SETTINGS.steps, None),
    CorpusEntry("small-lm", "byte-level transformer (0.88 M params, 4 layers, context 128) on the pydoc topics",
                1000, recipes.lm_recipe("small-lm", batch_size=8, lr=1e-3, blocks_per_tensor=1)),
    CorpusEntry("digits-cnn", "2-conv CNN (38 k params) on scikit-learn's 8x8 digits", 2000, recipes.record_digits,
                needs=("sklearn",)),
)}


# sha256 of the gradients as recorded for the committed report (reports/corpus/), with
# torch 2.13.0+cpu on x86_64; another torch build or CPU kind may round differently.
RECORDED_SHA256 = {
    "synthetic-heavy": "fa94563ed32614fae6c46d6ff4f93eb62f9042031ccf78e927e3881adf82c4e3",
    "tiny-lm": "27fd99e85226090479c4fd1b02007eb412275bca70f75aa15e8e6354a58fb127",
    "digits-cnn": "46f40868b12af7b13a5582d4e4e0244af01d9e611d6419b43a0fdae25adc94b5",
    "small-lm": "8f4b3349a12ce3536b7acbe333ea941020fdc1f8d2e0dc21bd32392404070ee2",
}


def entry(name: str) -> CorpusEntry:
    if name not in ENTRIES:
        from ..quant.formats import suggest

        raise QstateError(f"unknown corpus trace {name!r}{suggest(name, ENTRIES)}")
    return ENTRIES[name]


def cached_path(e: CorpusEntry) -> Path:
    """Where the trace of `e` is (or will be) cached; tiny-lm is the demo trace's file."""
    if e.record is None:
        return demo_path(DEMO_SETTINGS)
    return cache_dir() / e.filename


def cached_trace(name: str, log: Callable[[str], None] | None = None) -> Path:
    """The corpus trace `name`, recorded on first use (module docstring)."""
    e = entry(name)
    if e.record is None:
        return cached_demo(log=log)
    path = cached_path(e)
    problem = cache_problem(path, e.steps)
    if problem is not None:
        _check_needs(e)
        check_cache(path, f"corpus trace {name}")  # before the recording, not after it
        if problem:  # a file, but not the whole trace: recorded again (atomically, over it)
            print(f"qstate: the cached corpus trace {path} {problem}: recording it again", file=sys.stderr)
        elif log:
            log(f"recording corpus trace {name} ({e.steps} steps; cached at {path})")
        path.parent.mkdir(parents=True, exist_ok=True)
        e.record(path, e.steps, e.seed, log)
    return path


def resolve(trace, log: Callable[[str], None] | None = None) -> Path:
    """A trace path from what a user wrote: `demo`, `corpus:NAME`, or a path."""
    text = str(trace)
    if text == DEMO:
        return cached_demo(log=log)
    if text.startswith(PREFIX):
        return cached_trace(text[len(PREFIX):], log)
    return Path(trace)


def check_can_make(trace) -> None:
    """Refuse now, before any work, a `demo` or `corpus:NAME` this machine cannot provide: an
    unknown name, or a trace not cached yet whose recipe needs a package that is not
    installed or whose cache folder cannot be written."""
    text = str(trace)
    if text == DEMO:
        path, what = demo_path(DEMO_SETTINGS), "the demo trace"
    elif text.startswith(PREFIX):
        e = entry(text[len(PREFIX):])
        path, what = cached_path(e), f"corpus trace {e.name}"
        if not path.exists():
            _check_needs(e)
    else:
        return
    if not path.exists():
        check_cache(path, what)


def _check_needs(e: CorpusEntry) -> None:
    import importlib.util

    missing = [m for m in e.needs if importlib.util.find_spec(m) is None]
    if missing:
        raise QstateError(f"corpus trace {e.name} needs {', '.join(missing)} (not installed): "
                          f"pip install {' '.join('scikit-learn' if m == 'sklearn' else m for m in missing)}")


def fingerprint(trace) -> str:
    """sha256 of the recorded gradients (tensor order, shapes and bytes): equal for the
    same recipe, seed, torch build and CPU kind."""
    h = hashlib.sha256()
    for t in trace.tensors:
        h.update(f"{t.name}:{tuple(t.grads.shape)}:{t.grads.dtype}".encode())
        h.update(t.grads.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def listing(with_fingerprint: bool = False) -> list[dict]:
    """One row per corpus trace: name, task, steps, whether cached, size, and (with
    `with_fingerprint`) the sha256 and whether it equals the one the report was made from."""
    rows = []
    for e in ENTRIES.values():
        path = cached_path(e)
        row = {"name": f"{PREFIX}{e.name}", "steps": e.steps, "task": e.task, "cached": path.exists(),
               "size_mib": round(path.stat().st_size / 2**20, 1) if path.exists() else None,
               "needs": ", ".join(e.needs) or "-"}
        if with_fingerprint and path.exists():
            from .io import load_trace

            tr = load_trace(path)
            row["recorded_elements"] = tr.recorded_elements
            row["sha256"] = fingerprint(tr)
            known = RECORDED_SHA256.get(e.name)
            row["same_as_report"] = None if known is None else row["sha256"] == known
        rows.append(row)
    return rows
