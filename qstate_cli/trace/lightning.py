"""Record a gradient trace from a Lightning `Trainer` run.

    from qstate_cli.trace.lightning import QstateTraceCallback

    trainer = lightning.Trainer(max_steps=1000, callbacks=[QstateTraceCallback("trace.pt", steps=500)])
    trainer.fit(module, data)   # written at the end of fit, also on Ctrl-C or an error

The options are the Recorder's (trace/trainers.py). Lightning steps its optimizers with
a closure (forward, backward and clipping run inside `optimizer.step`): the Recorder
copies the gradients right after that closure, i.e. what the optimizer reads, not the
previous step's. Records the first optimizer (`trainer.optimizers[0]`); under torchrun the
Recorder decides who writes (DDP: rank 0; FSDP2: every rank its shard). Needs
`lightning` (`pip install 'qstate-cli[trainers]'`); nothing else in qstate imports this
module.
"""
from __future__ import annotations

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("qstate_cli.trace.lightning needs lightning: pip install 'qstate-cli[trainers]'") from exc

from .trainers import RecordingSession


class QstateTraceCallback(Callback):
    """A Lightning Callback that records a qstate trace (see module docstring)."""

    def __init__(self, path, **options):
        self.session = RecordingSession(path, **options)

    def on_train_start(self, trainer, pl_module):
        if trainer.optimizers:
            self.session.start(trainer.optimizers[0], pl_module)

    def on_train_end(self, trainer, pl_module):
        self.session.finish()

    def on_exception(self, trainer, pl_module, exception):
        self.session.finish(type(exception))

    @property
    def path(self):
        return self.session.written
