"""`qstate bench memory`: optimizer-state bytes per parameter, counted and measured.

For each config or baseline, on a model's parameter shapes (or single tensors):

- `state_bytes`: exact accounting of the optimizer's real state after one step: every
  tensor reachable from `optimizer.state` (tensor subclasses such as torchao's
  quantized states are opened into their inner tensors), each storage of two or more
  elements counted once (bitsandbytes shares its code book between parameters), and each
  one-element tensor (a step counter) once for every parameter that holds it, even where
  a path shares it: ours count 5 int64 counters (40 B) per tensor on every path, though
  the fused paths hold only nonfinite per tensor and share step (= each state's written)
  and since_reset between a group's tensors (32 B per tensor fewer held, plus 16 B), so
  the count does not depend on whether numba is installed (docs/bench.md, "Counters:
  counted per tensor, not as held"). A torch.compile'd peer (torchao) takes this step
  with torch.compiler.set_stance("force_eager"): its state is the same, and compiling
  every shape (seconds each on a CPU) is not what this command measures; the CUDA pass
  below compiles, as training does.
- `expected_state_bytes`: the bytes model's codes + scales for the states the subject
  keeps on each tensor (no counters): state_bytes - expected_state_bytes is the counter
  overhead, so the two cross-check each other.
- `bytes_per_param = state_bytes / params`;
  `reduction_vs_fp32 = 1 - state_bytes / (states * 4 * params + counters)`: against the same
  optimizer holding fp32 states (AdamW: 8 bytes/param) and the same per-tensor counters
  (`counters = state_bytes - expected_state_bytes`), so an fp32 row reads exactly 0.
- CUDA only, in a separate pass with a fresh optimizer: `measured_state_bytes` =
  torch.cuda.memory_allocated() after the first step minus before it, and
  `peak_extra_mib` = torch.cuda.max_memory_allocated() during a second step minus the
  memory allocated before it (the transient memory a step needs). On CPU both are null.
- Measured on both, in that separate pass, per parameter of the row (as
  `bytes_per_param`): `first_step_peak_bytes_per_param` = the peak while the optimizer
  is built and takes its first step (which allocates the state) minus the memory before
  it, and `step_peak_bytes_per_param` = the peak of a second step minus the memory before
  it. `measured_by` says what "memory" is: "cuda-allocator"
  (torch.cuda.max_memory_allocated; step_peak = peak_extra_mib per parameter) or
  "process-rss" (a CPU on Linux: the process's VmHWM over its VmRSS, bench/rss.py; a
  torch.compile'd peer steps with force_eager there, as in the accounting step). Where
  neither can be measured they are null, and `measured_reason` says why; it also says
  why the CUDA-only columns are null on a CPU.

A model or size whose estimated peak (parameters, two gradient sets, the largest subject's
states, a step's temporaries: workset.group_bytes) is more than the memory available
(hostmem.available_memory) is not allocated: its rows are "failed" with the reason
"needs ~X GiB, Y GiB available" and the run goes on (an allocation past what is available
is not refused on Linux: the OOM killer ends the process later, with no file and no message).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import QstateError
from ..options import Options, lower, many, option, seed_option
from ..quant.config import StateConfig
from ..optim.base import BACKENDS
from ..optim.registry import names_text, optimizer_info
from ..progress import Progress
from ..results import Result, device_info
from ..runtime import free_memory, resolve_device
from . import rss
from .bytes_model import DTYPE_NAMES, DTYPES
from .kernels import Target, failure, streamed
from .workset import Tensors, allocate, group_bytes, state_bytes
from .shapes import model_shapes, parse_count, split_models
from .subjects import Context, Subject, Unavailable, chosen_configs, config_or_none, ours, select_baselines

DEFAULT_CONFIGS = ("bred-4bit", "torchao-4bit", "bred-8bit", "bnb-8bit")
DEFAULT_MODEL = {"cpu": "small-lm", "cuda": "gpt2-small"}
CPU_REASON = "accounting only: torch.cuda memory statistics need a CUDA device"
RSS_REASON = ("peaks are process RSS (VmHWM over VmRSS): measured_state_bytes and peak_extra_mib are "
              "torch.cuda allocator statistics and need a CUDA device")
CUDA_SOURCE = "cuda-allocator"
MIB = 2**20

FIELDS = ("name", "role", "optimizer", "config", "model", "params", "n_tensors", "param_dtype", "device",
          "device_name", "path", "status", "reason", "state_bytes", "expected_state_bytes",
          "bytes_per_param", "reduction_vs_fp32", "measured_state_bytes", "peak_extra_mib",
          "first_step_peak_bytes_per_param", "step_peak_bytes_per_param", "measured_by", "measured_reason")


@dataclass
class MemoryOptions(Options):
    """`qstate bench memory`: the CLI options and a suite point's parameters (options.py)."""

    COMMAND = "bench memory"

    model: list[str] = many("Models: gpt2-small, gpt2-medium, llama-1b, tinyllama-1.1b, llama-7b, tiny-lm, small-lm, "
                            "or shapes such as 768x3072*12,768 (one model). Commas separate built-in names; shapes "
                            "written one after another are one model; repeat --model for two shape lists. Default: "
                            "small-lm on CPU, gpt2-small on CUDA.", "--model", "-m", split=split_models)
    numel: list[int] = many("Single tensors of these sizes instead of / besides --model.", "--numel", "-n",
                            parse=parse_count)
    config: list[StateConfig] = many("Configs (repeatable). Default: bred-4bit, torchao-4bit, bred-8bit, bnb-8bit; "
                                     "'none': the baselines only.", "--config", "-c", parse=config_or_none)
    optimizer: str = option("adamw", f"{names_text()}.", parse=lower)
    dtype: str = option("fp32", "Parameter dtype: fp32, bf16, fp16.")
    device: str = option("auto", "auto, cuda or cpu.")
    baseline: list[str] = many("Baselines (repeatable), all (default) or none.")
    backend: str = option("auto", "Our optimizers' backend: auto, reference, triton or cpu (the numba path).")
    seed: int = seed_option("Seed of the parameters and gradients.")

    def check(self, here: bool = True) -> None:
        plan(self, here)


@dataclass
class MemoryPlan:
    device: torch.device
    optimizer: str
    dtype: str
    targets: list[Target]
    subjects: list[Subject]
    seed: int
    backend: str = "auto"

    @property
    def total_rows(self) -> int:
        return len(self.targets) * len(self.subjects)


def plan(opts: MemoryOptions, here: bool = True) -> MemoryPlan:
    """Validate the options (QstateError on bad input); here=False: Options.check."""
    optimizer_info(opts.optimizer)  # QstateError for an unknown optimizer
    if opts.dtype not in DTYPES:
        raise QstateError(f"unknown dtype {opts.dtype!r}: choose from {', '.join(DTYPES)}")
    device = resolve_device(opts.device, here)
    models = list(opts.model) or ([] if opts.numel else [DEFAULT_MODEL[device.type]])
    if any(n < 1 for n in opts.numel):
        raise QstateError("--numel must be >= 1")
    targets = [Target([(n,)], None) for n in opts.numel] + [Target(model_shapes(m), m) for m in models]
    subjects = [ours(c) for c in chosen_configs(opts.config, DEFAULT_CONFIGS)]
    subjects += select_baselines(opts.optimizer, opts.baseline)  # default: all but the per-param one
    if not subjects:
        raise QstateError("--config none and --baseline none: nothing to measure")
    if opts.backend not in BACKENDS:
        raise QstateError(f"unknown backend {opts.backend!r}: choose from {', '.join(BACKENDS)}")
    return MemoryPlan(device, opts.optimizer, opts.dtype, targets, subjects, int(opts.seed), opts.backend)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every distinct storage reachable from opt.state (see module doc); a
    one-element tensor (a step counter) counts its own bytes wherever a parameter holds
    it, so the count does not depend on which path shares its counters."""
    seen: set[tuple] = set()
    total = 0

    def visit(obj):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
                names, _ = obj.__tensor_flatten__()
                for name in names:
                    visit(getattr(obj, name))
                return
            if obj.numel() <= 1:  # a counter (step, since_reset, written): counted where each parameter holds
                total += obj.numel() * obj.element_size()  # it, as the fused paths share one per group
                return
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)

    for st in opt.state.values():
        visit(st)
    return total


def expected_state_bytes(subject: Subject, optimizer: str, shapes, dtype: torch.dtype) -> int:
    """Codes + scales of the states `subject` keeps on each tensor (bytes model)."""
    return state_bytes(subject, optimizer, shapes, dtype)


def target_bytes(p: MemoryPlan, target: Target, dtype: torch.dtype) -> int:
    """The peak bytes of one target (workset.group_bytes): its subjects step one at a time."""
    states = [state_bytes(s, p.optimizer, target.shapes, dtype) for s in p.subjects]
    return group_bytes(target.shapes, dtype, states, together=False)


def eager_if(flag: bool):
    """torch.compile directives ignored (same state, no per-shape compile) when flag."""
    return torch.compiler.set_stance("force_eager") if flag else contextlib.nullcontext()


def run(p: MemoryPlan, on_row: Callable[[dict], None] | None = None,
        on_start: Callable[[str, int, int], None] | None = None) -> list[dict]:
    rows: list[dict] = []
    info = device_info(str(p.device))
    dtype = DTYPES[p.dtype]
    for target in p.targets:
        tensors, alloc_error = allocate(target.shapes, dtype, p.device, p.seed,
                                        target_bytes(p, target, dtype))
        for subject in p.subjects:
            if on_start:
                on_start(f"{subject.name} {target.model or f'{target.numel:,}'}", len(rows), p.total_rows)
            ctx = Context(p.optimizer, p.device, backend=p.backend if subject.role == "config" else "auto")
            row = base_row(subject, ctx, target, dtype, info)
            if alloc_error:
                row.update(status="failed", reason=alloc_error)
            else:
                measure_subject(row, subject, ctx, tensors)
            rows.append(row)
            if on_row:
                on_row(row)
        del tensors
        free_memory(p.device)
    return rows


def base_row(subject: Subject, ctx: Context, target: Target, dtype, info: dict) -> dict:
    row = dict.fromkeys(FIELDS)
    row.update(name=subject.name, role=subject.role, optimizer=ctx.optimizer,
               config=subject.config_text(dtype), model=target.model, params=target.numel,
               n_tensors=len(target.shapes), param_dtype=DTYPE_NAMES[dtype], device=ctx.device.type,
               device_name=info["device_name"], path=subject.nominal_path(ctx), status="ok",
               expected_state_bytes=expected_state_bytes(subject, ctx.optimizer, target.shapes, dtype),
               measured_reason=measured_reason(ctx.device))
    return row


def measured_reason(device: torch.device) -> str | None:
    """Why some measured columns are null on this device (None on CUDA: none are)."""
    if device.type == "cuda":
        return None
    why = rss.unavailable()
    return RSS_REASON if why is None else f"{CPU_REASON}; {why}"


def measure_subject(row: dict, subject: Subject, ctx: Context, tensors: Tensors) -> None:
    n_states = len(optimizer_info(ctx.optimizer).states)
    try:
        opt, path = subject.build(tensors.params, ctx)
        row["path"] = path
        with eager_if(subject.compiles):
            opt.step()
        state = optimizer_state_bytes(opt)
        del opt
        free_memory(ctx.device)
        expected = row["expected_state_bytes"]
        counters = state - expected if expected is not None and 0 <= expected <= state else 0
        row.update(state_bytes=state, bytes_per_param=state / row["params"],
                   reduction_vs_fp32=1.0 - state / (n_states * 4 * row["params"] + counters))
        if ctx.device.type == "cuda":
            row.update(cuda_pass(subject, ctx, tensors))
        elif ctx.device.type == "cpu" and rss.unavailable() is None:
            row.update(rss_pass(subject, ctx, tensors))
    except (Unavailable, QstateError) as exc:
        row.update(status="unavailable", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - one bad row must not end the run
        row.update(failure(subject, exc))
    finally:
        free_memory(ctx.device)


def cuda_pass(subject: Subject, ctx: Context, tensors: Tensors) -> dict:
    """A fresh optimizer: state bytes from memory_allocated, the peak of a second step."""
    dev = ctx.device
    free_memory(dev)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    opt, _ = subject.build(tensors.params, ctx)
    opt.step()
    torch.cuda.synchronize(dev)
    after_first = torch.cuda.memory_allocated(dev)
    first_peak = torch.cuda.max_memory_allocated(dev)
    tensors.rotate()
    torch.cuda.reset_peak_memory_stats(dev)
    opt.step()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del opt
    n = tensors_numel(tensors)
    return {"measured_state_bytes": after_first - before, "peak_extra_mib": (peak - after_first) / MIB,
            "first_step_peak_bytes_per_param": (first_peak - before) / n,
            "step_peak_bytes_per_param": (peak - after_first) / n, "measured_by": CUDA_SOURCE}


def rss_pass(subject: Subject, ctx: Context, tensors: Tensors) -> dict:
    """As cuda_pass, in the process's resident memory (bench/rss.py): a fresh optimizer
    built and stepped once, then a second step, each peak over the resident size before
    it (after gc and malloc_trim); per parameter. Eager, as the accounting step."""
    held = []

    def first():
        opt, _ = subject.build(tensors.params, ctx)
        with eager_if(subject.compiles):
            opt.step()
        held.append(opt)

    def second():
        with eager_if(subject.compiles):
            held[0].step()

    first_peak = rss.peak_over(first)
    tensors.rotate()
    step_peak = rss.peak_over(second, collect=False)  # one full gc a row (rss.trim)
    held.clear()
    n = tensors_numel(tensors)
    return {"first_step_peak_bytes_per_param": first_peak / n, "step_peak_bytes_per_param": step_peak / n,
            "measured_by": rss.SOURCE}


def tensors_numel(tensors: Tensors) -> int:
    return sum(p.numel() for p in tensors.params)



def options_meta(opts: MemoryOptions, p: MemoryPlan) -> dict:
    return {"options": opts.to_params(), "dtype": p.dtype, "targets": [t.model or t.numel for t in p.targets],
            "subjects": [s.name for s in p.subjects]}



def execute(opts: MemoryOptions, progress: Progress | None = None) -> Result:
    """`qstate bench memory` as a library call (kinds.py)."""
    p = plan(opts)
    return streamed("memory", p, options_meta(opts, p), run, progress)
