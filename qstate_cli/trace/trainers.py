"""What the trainer callbacks (hf.py, lightning.py) share: one Recorder per training run,
started on the optimizer the trainer built and written when training ends, stops or fails.

    session = RecordingSession("trace.pt", blocks_per_tensor=4, steps=500)
    session.start(optimizer, model)   # when training begins
    session.finish()                  # at the end: writes the trace
    session.finish(type(exc))         # on Ctrl-C or an error: the steps so far (trace/partial.py)

The options are the Recorder's (trace/recorder.py: include, exclude, blocks_per_tensor,
start, steps, seed, grad_dtype, record_params, max_mib, hparams, optimizer_name). A run
with no optimizer to record (None, or Lightning's stand-in when configure_optimizers
returns None: no parameter groups) gets one line on stderr, `qstate: no optimizer to
record: nothing recorded`, and trains on. The optimizer a trainer hands over
may be a wrapper (accelerate's AcceleratedOptimizer, which Hugging Face's Trainer uses);
the Recorder hooks the torch optimizer inside it, whose `step` the wrapper calls only when
it really steps (not on gradient-accumulation micro-steps, not on a step skipped for
non-finite fp16 gradients). Every process starts a Recorder and the Recorder decides who
writes under torchrun (trace/recorder.py): with DDP rank 0 alone, with FSDP2 every rank
its shard's elements into `path/rank<r>.pt`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..errors import QstateError
from ..runtime import rank_and_world
from .recorder import Recorder

RECORDER_OPTIONS = ("include", "exclude", "blocks_per_tensor", "start", "steps", "seed", "grad_dtype",
                    "record_params", "max_mib", "hparams", "optimizer_name")


def unwrap_optimizer(optimizer):
    """The torch optimizer inside trainer wrappers (`.optimizer` attributes)."""
    seen = 0
    while not _is_plain(optimizer) and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
        seen += 1
        if seen > 8:
            break
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise QstateError(f"cannot record: {type(optimizer).__name__} is not a torch optimizer")
    return optimizer


def _is_plain(optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Optimizer) and not isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer)


def pick_optimizer(optimizers: list, index: int):
    """optimizers[index] (None where there is none: the session says so); one line on stderr
    where there are several (which one is recorded); a QstateError for an index past the end."""
    if not optimizers:
        return None
    if index >= len(optimizers):
        raise QstateError(f"optimizer={index}: this run has {len(optimizers)} optimizer"
                          f"{'' if len(optimizers) == 1 else 's'} (optimizer=0..{len(optimizers) - 1})")
    if len(optimizers) > 1 and rank_and_world()[0] == 0:  # said once, as the recorder's other notes
        other = 1 if index == 0 else 0
        print(f"qstate: records optimizer {index} of {len(optimizers)} ({type(optimizers[index]).__name__}); "
              f"optimizer={other} picks another (start/steps count that optimizer's steps)", file=sys.stderr)
    return optimizers[index]


class RecordingSession:
    """A Recorder's life inside a trainer (see module docstring)."""

    def __init__(self, path, **options):
        unknown = sorted(set(options) - set(RECORDER_OPTIONS))
        if unknown:
            raise QstateError(f"unknown recorder option(s) {', '.join(unknown)}; use {', '.join(RECORDER_OPTIONS)}")
        self.path = Path(path)
        self.options = options
        self.recorder: Recorder | None = None
        self.written: Path | None = None

    def start(self, optimizer, model=None) -> None:
        """Hook `optimizer` (a trainer's wrapper is unwrapped); None, or one with no parameter
        groups (Lightning's stand-in for no optimizer): one line on stderr, nothing recorded."""
        if self.recorder is not None:
            return
        torch_optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        if torch_optimizer is None or not torch_optimizer.param_groups:
            print("qstate: no optimizer to record: nothing recorded", file=sys.stderr)
            return
        self.recorder = Recorder(torch_optimizer, self.path, model=model, **self.options).__enter__()

    def finish(self, exc_type: type | None = None) -> Path | None:
        """Unhook and write the trace atomically (nothing when no step was recorded). Given
        the exception that stopped training (Ctrl-C, an error), the steps recorded so far,
        as the Recorder writes them then: beside an earlier file, never over it (partial.py)."""
        rec, self.recorder = self.recorder, None
        if rec is None:
            return self.written
        wrote = bool(rec.items) and rec.n_steps > 0  # a DDP rank other than 0 records nothing
        rec.__exit__(exc_type, None, None)  # unhook; write this rank's file (the Recorder's own rules)
        if wrote:
            self.written = rec.file_for(self.path) if exc_type is None else rec.written
        return self.written
