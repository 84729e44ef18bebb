"""Record a gradient trace from a Lightning `Trainer` run.

    from qstate_cli.trace.lightning import QstateTraceCallback

    trainer = lightning.Trainer(max_steps=1000, callbacks=[QstateTraceCallback("trace.pt", steps=500)])
    trainer.fit(module, data)   # written at the end of fit, also on Ctrl-C or an error

The options are the Recorder's (trace/trainers.py). Lightning steps its optimizers with
a closure (forward, backward and clipping run inside `optimizer.step`): the Recorder
copies the gradients right after that closure, i.e. what the optimizer reads, not the
previous step's. Records one optimizer, `trainer.optimizers[optimizer]` (default 0; where
there are several, one line on stderr says which, and `start`/`steps` count that
optimizer's steps, not `trainer.global_step`); a run with no optimizer (configure_optimizers
returns None) records nothing and says so. Under torchrun the Recorder decides who writes
(DDP: rank 0; FSDP2: every rank its shard). Needs
`lightning` (`pip install 'qstate-cli[trainers]'`); nothing else in qstate imports this
module.
"""
from __future__ import annotations

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("qstate_cli.trace.lightning needs lightning: pip install 'qstate-cli[trainers]'") from exc

from ..errors import QstateError
from .trainers import RecordingSession, pick_optimizer


class QstateTraceCallback(Callback):
    """A Lightning Callback that records a qstate trace (see module docstring);
    `optimizer`: which of `trainer.optimizers` (an index)."""

    def __init__(self, path, *, optimizer: int = 0, **options):
        if isinstance(optimizer, bool) or not isinstance(optimizer, int) or optimizer < 0:
            raise QstateError(f"optimizer={optimizer!r}: an index into trainer.optimizers (0, 1, ...)")
        self.optimizer = optimizer
        self.session = RecordingSession(path, **options)

    def on_train_start(self, trainer, pl_module):
        self.session.start(pick_optimizer(list(trainer.optimizers), self.optimizer), pl_module)

    def on_train_end(self, trainer, pl_module):
        self.session.finish()

    def on_exception(self, trainer, pl_module, exception):
        self.session.finish(type(exception))

    @property
    def path(self):
        return self.session.written
