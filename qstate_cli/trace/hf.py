"""Record a gradient trace from a Hugging Face `transformers.Trainer` run.

    from qstate_cli.trace.hf import QstateTraceCallback

    trace = QstateTraceCallback("trace.pt", blocks_per_tensor=4, steps=500)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[trace])
    with trace:            # also writes the trace on Ctrl-C or an error
        trainer.train()    # without `with`, it is written when training ends

The options are the Recorder's (trace/trainers.py). The callback hooks the optimizer the
Trainer built (inside accelerate's wrapper) when training begins, so it records the
gradients each real optimizer step reads: after gradient accumulation and clipping.
Needs `transformers` (`pip install 'qstate-cli[trainers]'`); nothing else in qstate
imports this module.
"""
from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("qstate_cli.trace.hf needs transformers: pip install 'qstate-cli[trainers]'") from exc

from .trainers import RecordingSession


class QstateTraceCallback(TrainerCallback):
    """A TrainerCallback that records a qstate trace (see module docstring)."""

    def __init__(self, path, **options):
        self.session = RecordingSession(path, **options)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.session.start(optimizer, model)

    def on_train_end(self, args, state, control, **kwargs):
        self.session.finish()

    def __enter__(self) -> "QstateTraceCallback":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.session.finish(exc_type)

    @property
    def path(self):
        return self.session.written
