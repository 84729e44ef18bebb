"""Record a trace from any PyTorch training loop.

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(opt, "trace.pt", model=model, blocks_per_tensor=4, steps=500):
        for x, y in data:
            loss = loss_fn(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()   # the recorder hooks opt.step

The recorder registers an optimizer step pre-hook and copies the gradients of the chosen
blocks just before each step reads them (after backward and any clipping; for a step
called with a closure, right after the closure ran), so `zero_grad()` before or after
the step, with `set_to_none` or not, loses nothing; on leaving the `with` block it writes
the trace atomically, also on Ctrl-C or an error: then the steps recorded so far, said on
stderr, beside an earlier file at `path` (NAME.partial.pt), never over it; partial=False
writes none (partial.py). Without an optimizer, pass `params=` and call `rec.capture()`
yourself before each update.

Under torchrun (an initialized process group of several ranks): with DDP (plain, replicated
parameters) rank 0 alone records and writes `path`, so there is one copy of the gradients,
not N. With FSDP2 (DTensor parameters) `path` is a directory: the blocks are sampled on the
whole tensors (the same global blocks as a single-process recording), each rank records
the elements of those blocks that its shard holds, with their indices, and writes
`path/rank<r>.pt`; the directory loads as one trace (trace/io.py joins the pieces), equal to
a single-process recording of the same run. Replicated parameters in an FSDP2 model are
recorded by rank 0.

Streaming (`flush_steps=N`): `path` is a directory and every N steps the recorder writes
the steps it holds as one file (atomically), then rewrites `manifest.json` (atomically,
last) listing the files so far, and forgets those steps: memory stays bounded by N steps
of one rank's recorded elements, and an interrupted run keeps every step already
written (trace/io.py loads the files of the manifests, consecutive step ranges joined).

Bounded size: `include`/`exclude` (regular expressions on parameter names) pick the
tensors; `blocks_per_tensor` caps how many 2048-element blocks of each are kept, chosen
by the project's counter hash (stream seed, tensor index, state id 2, step 0) so the same
seed samples the same blocks, among the blocks that carry gradient at the first recorded
step (an embedding's unused rows are zero: a dead block replays as no data at all), then
dead ones only if too few are live. A parameter whose `.grad` is None at a step (an MoE
expert or a branch unused that step: the optimizer skips it, its step count unchanged) gets
a zero row there and the row listed in its `absent` rows (schema.py), so the replay skips
it too; frozen parameters (requires_grad=False) are not recorded (groups.py). A tensor whose recorded gradient stays zero at every
recorded step gets a warning on stderr and is listed in the trace's meta (`zero_tensors`;
under FSDP2 each rank judges the elements it holds, says so, and skips tensors it holds
none of; the loader recomputes the list from the joined gradients); `start` (global optimizer step) and `steps` pick a
consecutive window of steps (a replay needs every step of it). The planned size is
n_steps x recorded elements x (4 bytes fp32 | 2 bytes bf16); `max_mib` refuses a plan
above it, or stops recording when an open-ended one reaches it.
"""
from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path

import torch

from .. import __version__
from ..errors import QstateError
from ..optim import sharding
from ..optim.registry import OPTIMIZERS
from ..quant import hash as qhash
from ..results import write_json_atomic
from ..runtime import rank_and_world
from .groups import check_groups, recorded_hparams, select
from .hparams import name_of, optimizer_step
from .io import MANIFEST_TAG, save_trace
from .items import Recorded, names_text, pick, shard_item
from .notes import save_replacing, window_note
from .partial import write_partial
from .schema import BLOCK, GRAD_DTYPES, SAMPLING_STATE_ID, Trace, TraceTensor, recorded_elements

def sample_blocks(numel: int, k: int | None, seed: int, tensor_index: int,
                  live: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (ascending, int64) of k of the tensor's ceil(numel / 2048) blocks: those with
    the smallest hash of (seed, tensor_index, SAMPLING_STATE_ID, step 0; block index),
    live blocks (bool [n_blocks]: carrying gradient) before dead ones when `live` is given."""
    n = -(-numel // BLOCK)
    if k is None or k >= n:
        return torch.arange(n, dtype=torch.int64)
    keys = qhash.stream_keys(seed, tensor_index, SAMPLING_STATE_ID, 0)
    score = qhash.random_bits(keys, torch.arange(n, dtype=torch.int64)).to(torch.int64)
    if live is not None:
        score = score + (~live.cpu()).to(torch.int64) * (1 << 33)  # hash bits are 32: every live block first
    return torch.sort(torch.argsort(score)[:k]).values


def live_blocks(grad: torch.Tensor) -> torch.Tensor:
    """bool [n_blocks]: whether each 2048-element block of `grad` has a non-zero element."""
    flat = grad.detach().reshape(-1)
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK).ne(0).any(1)


class Recorder:
    """Records the gradients a training loop hands to `optimizer` (see module docstring).

    optimizer          hooked with a step pre-hook (None: pass params= and optimizer_name=)
    path               where `with` writes the trace on exit (None: call trace()/save())
    model              names the parameters (else param0, param1, ...)
    include, exclude   regular expressions on those names
    blocks_per_tensor  2048-element blocks kept per tensor (None: all)
    start, steps       first global optimizer step to record, and how many (None: until exit)
    seed               keys the block sampling and the replay's random streams
                       (default: the optimizer's own `seed` hyper-parameter, else 0)
    grad_dtype         "fp32" or "bf16";  record_params: also keep the parameters' values
    max_mib            size cap (see module docstring)
    partial            on Ctrl-C or an error, write the steps recorded so far (module docstring)
    hparams            what the replay steps with (default: those of the parameter group holding the
                       first recorded tensor, groups.py; a warning names other recorded groups that differ)
    """

    def __init__(self, optimizer=None, path=None, *, model=None, params=None, include: str | None = None,
                 exclude: str | None = None, blocks_per_tensor: int | None = 4, start: int | None = None,
                 steps: int | None = None, seed: int | None = None, grad_dtype: str = "fp32",
                 record_params: bool = False, max_mib: float = 2048.0, optimizer_name: str | None = None,
                 hparams: dict | None = None, meta: dict | None = None, flush_steps: int | None = None,
                 partial: bool = True):
        if grad_dtype not in GRAD_DTYPES:
            raise QstateError(f"grad_dtype {grad_dtype!r}: choose from {', '.join(GRAD_DTYPES)}")
        if blocks_per_tensor is not None and blocks_per_tensor < 1:
            raise QstateError("blocks_per_tensor must be >= 1 (or None for every block)")
        if steps is not None and steps < 1:
            raise QstateError("steps must be >= 1 (or None: until the recorder closes)")
        if flush_steps is not None and (flush_steps < 1 or path is None):
            raise QstateError("flush_steps must be >= 1 and needs a path (a directory the steps stream into)")
        self.flush_steps = flush_steps
        self.partial = partial
        self.written: Path | None = None  # where the trace (this rank's file) went, once written
        self.flushed = 0  # steps already written (streaming)
        self.files: list[str] = []
        self.optimizer, self.path = optimizer, path
        self.dtype = GRAD_DTYPES[grad_dtype]
        self.grad_dtype = grad_dtype
        if optimizer is None and (params is None or optimizer_name is None):
            raise QstateError("Recorder needs an optimizer, or params= and optimizer_name= (then call capture())")
        check_groups(optimizer)  # none (Lightning's stand-in): one line, not an IndexError
        plist = list(params) if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
        chosen, group_meta = select(plist, model, include, exclude), {}
        self.name = optimizer_name or name_of(optimizer)
        if self.name not in OPTIMIZERS:  # found now, not when diagnose refuses the finished trace
            print(f"qstate: the replay steps {', '.join(OPTIMIZERS)}; this records {self.name!r}, which "
                  f"`qstate diagnose` will refuse: pass optimizer_name= naming the rule it follows", file=sys.stderr)
        # the group holding the first recorded tensor's (groups.py); without an optimizer and hparams=,
        # the replay takes the named optimizer's defaults
        self.hparams = (dict(hparams) if hparams is not None else
                        recorded_hparams(optimizer, chosen, group_meta) if optimizer else {})
        self.seed = int(seed if seed is not None else self.hparams.get("seed", 0))
        self.rank, self.world = rank_and_world()
        self.sharded = self.world > 1 and any(sharding.is_dtensor(p) for p in plist)
        self.items: list[Recorded] = []
        self.blocks_per_tensor = blocks_per_tensor
        for i, name, p in chosen:  # include/exclude applied (groups.py)
            if self.world > 1 and self.rank != 0 and not sharding.is_dtensor(p):
                continue  # replicated (DDP, or unsharded under FSDP2): rank 0 records it
            blocks = sample_blocks(p.numel(), blocks_per_tensor, self.seed, i)
            if sharding.is_dtensor(p):
                self.items.append(shard_item(p, name, i, blocks))
                continue
            full = blocks.numel() == -(-p.numel() // BLOCK)
            idx = None if full else recorded_elements(blocks, p.numel()).to(p.device)
            self.items.append(Recorded(p, name, i, blocks, idx))
        if not self.items and not (self.world > 1 and self.rank != 0):
            raise QstateError("no parameters selected to record (check include/exclude)")
        self.n_rec = sum(r.n_recorded for r in self.items)
        self.row_mib = self.n_rec * self.dtype.itemsize / 2**20
        self.max_mib, self.steps, self.record_params = max_mib, steps, record_params
        if steps is not None and steps * self.row_mib > max_mib:
            raise QstateError(f"planned trace is {steps * self.row_mib:.0f} MiB ({steps} steps x {self.n_rec} elements), "
                              f"over max_mib={max_mib:g}: record fewer blocks or steps")
        self.step = optimizer_step(optimizer) if optimizer is not None else 0
        self.start = start
        self.step_start: int | None = None
        self.init: list = []
        self.done = False
        self.meta = {"source": "Recorder", "qstate": __version__, "argv": list(sys.argv),
                     "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **group_meta,
                     **(meta or {})}
        if self.world > 1:
            self.meta.update(rank=self.rank, world_size=self.world)
        self._hook = None
        self._warned = False

    # ---- context manager: hook the optimizer, write the trace on exit -------------------
    def __enter__(self) -> "Recorder":
        if self.optimizer is not None:
            self._hook = self.optimizer.register_step_pre_hook(self._before_step)
        return self

    def _before_step(self, optimizer, args, kwargs):
        """The step pre-hook. A plain `opt.step()` runs after backward: copy now. A step
        given a closure (Lightning, LBFGS) computes its gradients inside the step, so the
        gradients present now are the previous step's: wrap the closure to copy right after
        its first call instead (Lightning's closure includes gradient clipping, so what is
        copied is what the optimizer reads)."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is None:
            self.capture()
            return None
        called = []

        def recording_closure():
            loss = closure()
            if not called:
                called.append(True)
                self.capture()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": recording_closure}
        return (args[0], recording_closure, *args[2:]), kwargs

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        if self.path is not None and self.items and self.n_steps:
            if exc_type is not None:  # Ctrl-C or an error: what it keeps (partial.py)
                write_partial(self, exc_type)
            elif self.flush_steps:
                self.flush()
            else:
                self.save(self.path)

    @property
    def writes(self) -> bool:
        """Whether this rank writes a file (all but rank 0 of a DDP run record nothing)."""
        return bool(self.items)

    def file_for(self, path) -> Path:
        """Where this rank's recording goes: `path`, or `path/rank<r>.pt` when sharded."""
        return Path(path) / f"rank{self.rank}.pt" if self.sharded else Path(path)

    def flush(self) -> None:
        """Streaming: write the steps held as one file, then the manifest (module docstring)."""
        if not self.items or not self.buffered:
            return
        first = self.step_start + self.flushed
        rank = f"rank{self.rank}-" if self.sharded else ""
        name = f"{rank}steps{first:08d}-{first + self.buffered - 1:08d}.pt"
        folder = Path(self.path)  # the names in it are ours: regular files there, never through a link (atomic.py)
        save_trace(self.trace(), folder / name, picked_in=folder)
        self.written = Path(self.path)
        self.files.append(name)
        manifest = {"format": MANIFEST_TAG, "files": list(self.files), "steps": self.flushed + self.buffered,
                    "step_start": self.step_start}
        write_json_atomic(folder / (f"manifest-rank{self.rank}.json" if self.sharded else "manifest.json"),
                          manifest, picked_in=folder)
        self.flushed += self.buffered
        self.init = []
        for r in self.items:
            r.rows.clear()
            r.absent.clear()

    @property
    def buffered(self) -> int:
        """Steps held in memory (not yet written)."""
        return len(self.items[0].rows) if self.items else 0

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.path is not None and self.items and not self.n_steps:
            print(f"qstate: no step recorded, so no trace written to {self.path} (the optimizer took "
                  f"{self.step} steps; start={self.start})", file=sys.stderr)
        zero = self.zero_tensors() if self.n_steps and not self._warned else []
        whole = [r.name for r in self.items if r.name in zero and r.global_elements is None]
        pieces = [r.name for r in self.items if r.name in zero and r.global_elements is not None]
        if whole:
            print(f"qstate: the recorded gradient of {len(whole)} tensor(s) was zero at every one of {self.n_steps} "
                  f"steps ({names_text(whole)}): they replay as no data; check they are trained, or leave them out "
                  f"with exclude=", file=sys.stderr)
        if pieces:  # a rank sees its own elements only: the others' may be live
            print(f"qstate: rank {self.rank}: the recorded gradient elements this rank holds of {len(pieces)} "
                  f"sharded tensor(s) were zero at every one of {self.n_steps} steps ({names_text(pieces)}); the other ranks' "
                  f"pieces may not be: the joined trace lists the tensors zero on every rank in meta.zero_tensors "
                  f"(`qstate trace info {self.path}`)", file=sys.stderr)
        self._warned = self._warned or bool(zero)

    @property
    def n_steps(self) -> int:
        """Steps recorded so far (written and held)."""
        return self.flushed + self.buffered

    # ---- recording ---------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> None:
        """Copy the chosen gradient blocks for the optimizer step about to run."""
        self.step += 1
        if self.done or (self.start is not None and self.step < self.start):
            return
        if self.steps is not None and self.n_steps >= self.steps:
            self.done = True
            return
        if (self.n_steps + 1) * self.row_mib > self.max_mib:
            print(f"qstate: trace reached max_mib={self.max_mib:g}; recording stopped at step {self.step - 1}",
                  file=sys.stderr)
            self.done = True
            return
        if self.step_start is None:
            self.step_start = self.step
            window_note(self)  # a start before this run's first step (a resumed run): said on stderr
            self._sample_live_blocks()
            if self.record_params:
                self.init = [pick(sharding.local_tensor(r.param.detach()), r.elements, torch.float32)
                             for r in self.items]
        for r in self.items:
            g = r.param.grad
            if g is None:  # unused this step (the optimizer skips it): zeros, and the row listed as absent
                r.absent.append(len(r.rows))
                r.rows.append(torch.zeros(r.n_recorded, dtype=self.dtype))
            else:
                r.rows.append(pick(sharding.local_tensor(g.detach()), r.elements, self.dtype))
                r.nonzero = r.nonzero or bool(r.rows[-1].ne(0).any())
        if self.flush_steps and self.buffered >= self.flush_steps:
            self.flush()

    def _sample_live_blocks(self) -> None:
        """At the first recorded step: re-draw each sampled tensor's blocks among those
        that carry gradient now (module docstring); the plan's size stays within a block."""
        if self.blocks_per_tensor is None:
            return
        for k, r in enumerate(self.items):
            g = r.param.grad
            n_blocks = -(-r.param.numel() // BLOCK)
            if g is None or r.blocks.numel() == n_blocks:
                continue
            # a sharded gradient is gathered once so that every rank draws the same global blocks
            # (a collective: every rank holds an item for each sharded parameter, in one order)
            live = live_blocks(g.full_tensor() if sharding.is_dtensor(g) else g)
            blocks = sample_blocks(r.param.numel(), self.blocks_per_tensor, self.seed, r.index, live)
            if sharding.is_dtensor(r.param):
                self.items[k] = shard_item(r.param, r.name, r.index, blocks)
                continue
            r.blocks = blocks
            r.elements = recorded_elements(r.blocks, r.param.numel()).to(r.param.device)
        self.n_rec = sum(r.n_recorded for r in self.items)
        self.row_mib = self.n_rec * self.dtype.itemsize / 2**20

    def zero_tensors(self) -> list[str]:
        """Tensors whose recorded gradient was zero at every recorded step; under FSDP2, of a
        sharded tensor the elements this rank holds (a rank holding none of its recorded
        elements says nothing about it)."""
        return [r.name for r in self.items if r.n_recorded and not r.nonzero]

    def trace(self) -> Trace:
        """The steps held in memory as a Trace (streaming: those not written yet)."""
        if not self.buffered:
            raise QstateError("nothing recorded yet: no optimizer step ran inside the recorder"
                              if not self.n_steps else "every recorded step was written already (streaming)")
        zero = self.zero_tensors()
        self.meta.pop("zero_tensors", None)  # not a list from an earlier flush
        if zero:
            self.meta["zero_tensors"] = zero
        tensors = []
        for j, r in enumerate(self.items):
            init = self.init[j] if self.init else None
            absent = torch.tensor(r.absent, dtype=torch.int64) if r.absent else None
            tensors.append(TraceTensor(r.name, r.index, tuple(r.param.shape), r.blocks, torch.stack(r.rows), init,
                                       r.global_elements, absent))
        return Trace(self.name, self.hparams, self.seed, self.step_start + self.flushed, self.buffered,
                     self.grad_dtype, tensors, dict(self.meta))

    def save(self, path) -> None:
        """Write this rank's recording (file_for(path)); nothing on a DDP rank other than 0."""
        if self.writes:
            self.written = save_replacing(self.trace(), self.file_for(path),  # says what it replaces
                                          picked_in=Path(path) if self.sharded else None)  # rank<r>.pt: ours
