"""`qstate trace demo` and `qstate trace info`: a trace from a real (tiny) run, and a summary.

The demo trains the byte-level tiny LM (models/tiny_lm.py, the stdlib's pydoc topics) with
torch.optim.AdamW (fp32 states, betas 0.9/0.999, as most runs use) on one CPU thread and
records its gradients: by default 2000 steps (~30-60 s; long enough for bf16 stalling at
beta2 = 0.999, which builds up over ~1000 steps, to level off), one 2048-element block of
every tensor, bf16 gradients (~95 MiB).
"""
from __future__ import annotations

import math
import sys
import time
from typing import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import tiny_lm
from ..runtime import cache_dir, torch_threads
from .partial import cache_problem
from .recorder import Recorder
from .schema import BLOCK, Trace, digest


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 2000
    model: str = "tiny-lm"
    batch_size: int = 16
    lr: float = 3e-3
    blocks_per_tensor: int = 1
    grad_dtype: str = "bf16"
    seed: int = 0


DEFAULT = DemoSettings()




def cached_demo(settings: DemoSettings | None = None, log: Callable[[str], None] | None = None) -> Path:
    """The demo trace for `settings` (default: DEFAULT, what `qstate trace demo` records),
    made on first use and reused; the file name holds the settings and the qstate version,
    so a change to either makes a new one. (What `trace: demo` means in a suite.) A cached
    file that is not the whole trace (partial.cache_problem) is recorded again, saying so."""
    s = settings or DEFAULT
    path = demo_path(s)
    problem = cache_problem(path, s.steps)
    if problem is not None:
        check_cache(path, "the demo trace")  # before the training, not after it
    if problem:  # a file, but not the whole trace: recorded again (atomically, over it)
        print(f"qstate: the cached demo trace {path} {problem}: recording it again", file=sys.stderr)
    elif problem is not None and log:
        log(f"making the demo trace (cached at {path})")
    if problem is not None:
        run_demo(path, s, log)
    return path


def check_cache(path: Path, what: str) -> None:
    """Refuse, before `what` is recorded into the cache file `path`, a cache folder it could
    not be written in (a file, a read-only folder): one line now, not after the recording."""
    from ..errors import QstateError
    from ..results import check_folder

    try:
        check_folder(path.parent, "cache")
    except QstateError as exc:
        raise QstateError(f"{exc}; {what} is recorded there before use: set QSTATE_CACHE to a folder you can "
                          f"write") from None


def demo_path(settings: DemoSettings = DEFAULT) -> Path:
    """The cache file of the demo trace for `settings` (it may not exist yet)."""
    from .. import __version__

    s = settings
    return cache_dir() / (f"demo-{s.model}-{s.steps}steps-{s.blocks_per_tensor}blocks-{s.grad_dtype}-"
                          f"bs{s.batch_size}-lr{s.lr:g}-seed{s.seed}-qstate{__version__}.pt")


def run_demo(out: Path, settings: DemoSettings = DemoSettings(), log: Callable[[str], None] | None = None) -> dict:
    """Train, record, write `out`; returns a summary (steps, losses, size, time).
    `log` receives about ten progress lines. Runs on one CPU thread: the model's ops are
    far too small for intra-op parallelism to pay (measured: 1 thread ~8x the steps/s of 2
    on a busy 2-core machine)."""
    with torch_threads(1):
        return _run_demo(out, settings, log)


def _run_demo(out: Path, settings: DemoSettings, log) -> dict:
    model = tiny_lm.build(settings.model, settings.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.999), weight_decay=0.01)
    data = tiny_lm.batches("train", settings.batch_size, model.cfg.seq_len, settings.seed)
    t0 = time.perf_counter()
    loss = float("nan")
    meta = {"source": "qstate trace demo", "model": settings.model, "batch_size": settings.batch_size,
            "data": "pydoc_data.topics (bytes)"}
    with Recorder(opt, out, model=model, blocks_per_tensor=settings.blocks_per_tensor, steps=settings.steps,
                  seed=settings.seed, grad_dtype=settings.grad_dtype, meta=meta, partial=False) as rec:
        for step in range(1, settings.steps + 1):
            x, y = next(data)
            loss_t = model.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss_t.backward()
            opt.step()
            loss = float(loss_t.detach())
            if log and (step % max(1, settings.steps // 10) == 0 or step == settings.steps):
                log(f"step {step}/{settings.steps}  train loss {loss:.3f}  "
                             f"({time.perf_counter() - t0:.0f} s)")
    return {"trace": str(out), "model": settings.model, "steps": settings.steps,
            "train_loss": round(loss, 4), "val_loss": round(tiny_lm.evaluate(model), 4),
            "recorded_elements": rec.n_rec, "params": sum(p.numel() for p in model.parameters()),
            "size_mib": round(Path(out).stat().st_size / 2**20, 2),
            "train_s": round(time.perf_counter() - t0, 1)}


CHUNK_ELEMENTS = 1 << 24  # trace info reads this many gradient values at a time (a 128 MiB float64 temporary)


def step_chunks(grads: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS):
    """`grads` [n_steps, n_rec] as row slices (views, no copy) of about chunk_elements values,
    at least one step each: a summary over them holds a few chunks, not several copies of
    the whole tensor (an 800 MB bf16 trace peaked at 5.7 GB when read in one piece)."""
    rows = max(1, chunk_elements // max(1, grads.shape[1]))
    for start in range(0, grads.shape[0], rows):
        yield grads[start:start + rows]


def grad_stats(t, chunk_elements: int = CHUNK_ELEMENTS) -> tuple[int, float, torch.Tensor]:
    """(non-finite gradient values, RMS of the finite ones counting each non-finite as 0,
    alive [n_rec]: any step non-zero, NaN counting as alive) of tensor `t`, read a chunk of
    steps at a time (step_chunks). The sum of squares is kept in float64, chunk by chunk, and
    the RMS rounded to float32 as a float32 mean gave it: the chunk size does not change it."""
    nonfinite, squares = 0, 0.0
    alive = torch.zeros(t.grads.shape[1], dtype=torch.bool)
    for chunk in step_chunks(t.grads, chunk_elements):
        alive |= chunk.ne(0).any(0)
        finite = torch.isfinite(chunk)
        g = chunk.double().reshape(-1)  # float64: the square of a bf16, fp16 or fp32 value is exact
        if not bool(finite.all()):
            nonfinite += finite.numel() - int(finite.sum())
            g.masked_fill_(~finite.reshape(-1), 0.0)
        squares += float(torch.dot(g, g))
        del g, finite
    rms = math.sqrt(squares / t.grads.numel()) if t.grads.numel() else math.nan
    return nonfinite, float(torch.tensor(rms, dtype=torch.float32)), alive


def dead_blocks(t, alive: torch.Tensor | None = None) -> int:
    """Recorded 2048-element blocks of tensor `t` whose gradient is zero at every step
    (`alive`: grad_stats's, else read here)."""
    if alive is None:
        alive = grad_stats(t)[2]
    pad = (-alive.numel()) % BLOCK
    if pad:
        alive = torch.cat([alive, alive.new_zeros(pad)])
    return int((~alive.view(-1, BLOCK).any(1)).sum())


def info(trace: Trace, chunk_elements: int = CHUNK_ELEMENTS) -> tuple[dict, list[dict]]:
    """A summary of the trace and one row per tensor (gradient RMS, non-finite counts, and
    dead blocks: recorded blocks whose gradient is zero at every step), each tensor's
    gradients read `chunk_elements` values at a time (grad_stats)."""
    rows = []
    nonfinite_total = dead_total = 0
    for t in trace.tensors:
        nonfinite, rms, alive = grad_stats(t, chunk_elements)
        nonfinite_total += nonfinite
        dead = dead_blocks(t, alive)
        dead_total += dead
        rows.append({"tensor": t.name, "index": t.index, "shape": "x".join(map(str, t.shape)) or "scalar",
                     "numel": t.numel, "blocks": f"{t.blocks.numel()}/{t.n_blocks}",
                     "recorded": t.n_recorded, "dead_blocks": dead, "grad_rms": rms,
                     "nonfinite": nonfinite, "init": t.init is not None})
    hp = ", ".join(f"{k}={v}" for k, v in trace.hparams.items())
    summary = {
        "trace": trace.source, "schema_version": trace.schema_version, "optimizer": trace.optimizer, "hparams": hp,
        "seed": trace.seed, "steps": f"{trace.step_start}..{trace.step_start + trace.n_steps - 1} "
                                     f"({trace.n_steps})",
        "tensors": len(trace.tensors), "recorded_elements": trace.recorded_elements,
        "total_elements": trace.total_elements,
        "recorded_fraction": round(trace.recorded_elements / max(1, trace.total_elements), 4),
        "grad_dtype": trace.grad_dtype, "element_steps": trace.recorded_elements * trace.n_steps,
        "nonfinite_grads": nonfinite_total,
        "digest": digest(trace),  # what a replay reads, not the file (schema.digest; diagnose's meta.trace_digest)
        "dead_blocks": f"{dead_total} of {sum(t.blocks.numel() for t in trace.tensors)} recorded blocks "
                       f"(gradient zero at every step)",
    }
    absent = {t.name: len(t.absent_rows) for t in trace.tensors if t.absent_rows}
    if absent:
        summary["absent_steps"] = ", ".join(f"{n} ({k})" for n, k in absent.items())
    if trace.meta.get("zero_tensors"):
        summary["meta.zero_tensors"] = ", ".join(trace.meta["zero_tensors"])
    shards = trace.meta.get("shards")
    if shards:
        summary["shards"] = len(shards)
    for key in ("source", "model", "created", "qstate"):
        if key in trace.meta:
            summary[f"meta.{key}"] = trace.meta[key]
    size = _size_mib(trace.source)
    if size is not None:
        summary["size_mib"] = round(size, 2)
    return summary, rows


def _size_mib(source: str) -> float | None:
    p = Path(source)
    if p.is_file():
        return p.stat().st_size / 2**20
    if p.is_dir():
        return sum(f.stat().st_size for f in p.glob("*.pt")) / 2**20
    return None

