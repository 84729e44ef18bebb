"""`qstate bench kernels`: time real optimizer steps against the memory roofline.

The unit of work is one `optimizer.step()` over tensors with random gradients (two
gradient sets, swapped between repetitions outside the timed region; never zeros).
One row per (dtype, size or model, config or baseline), plus one `copy` row first:
the device's copy bandwidth measured in the same run (bytes read + written over the
median time), which every row's `pct_of_copy` divides by:

    gbps = bytes_moved / time,   pct_of_copy = 100 * gbps / copy_gbps

except for a row that sits in cache (roofline.py: faster than the copy, or its own bytes
copy at cache speed): `cache_resident` true and `pct_of_copy` null.

`bytes_moved` is the bytes model (bytes_model.py) for the states that subject really
keeps on each tensor. A size that runs out of memory marks its rows "failed" and the
sweep goes on; a baseline that cannot run here is "unavailable" with the reason. So does
a size whose estimated peak (kernels_group_bytes) is more than the memory available,
found before any of it is allocated (workset.py).
The rows of one (dtype, size or model) are timed together, interleaved in `--rounds`
rounds beside same-run references (group.py); they go to `on_row` as soon as their group
is measured (the CLI writes them to disk), so Ctrl-C (KeyboardInterrupt, never caught
here) keeps every finished group.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import QstateError
from ..options import MAX_THREADS, Options, lower, many, option, seed_option
from ..quant.config import ROUNDINGS, StateConfig, parse_config
from ..optim.base import BACKENDS
from ..optim.registry import names_text, optimizer_info
from ..progress import QUIET, Progress
from ..results import Result, cpu_affinity, device_info
from ..runtime import free_memory, is_oom, resolve_device, torch_threads
from .bytes_model import DTYPE_NAMES, DTYPES, dtype_bytes
from .shapes import model_shapes, numel as shapes_numel, parse_count, split_models, sweep_shape
from .group import failure, fill_timing, measure_group
from .subjects import Context, Subject, chosen_configs, config_or_none, ours, select_baselines
from .timing import copy_item, measure_rounds
from .workset import COPY_HEADROOM_BYTES, allocate, group_bytes, memory_shortfall, state_bytes

__all__ = ["KernelsOptions", "execute", "failure", "fill_timing", "plan", "run", "streamed"]

CONFIGS_BY_BITS = {
    4: ("nearest-4bit", "sr-4bit", "bred-4bit", "torchao-4bit"),
    8: ("nearest-8bit", "sr-8bit", "bred-8bit", "bnb-8bit"),
}
# Defaults per device: the CPU sweep finishes in well under a minute on 2 cores; the
# CUDA sweep reaches past 1e8 elements (2**27 = 134M), where a step is bandwidth bound.
DEFAULTS = {
    "cpu": dict(numel=(1 << 14, 1 << 18), dtype=("fp32",), warmup_ms=10.0, rep_ms=100.0, copy_numel=1 << 26),
    "cuda": dict(numel=(1 << 20, 1 << 23, 1 << 26, 1 << 27), dtype=("fp32", "bf16"), warmup_ms=25.0,
                 rep_ms=100.0, copy_numel=1 << 28),
}

FIELDS = ("name", "role", "optimizer", "config", "rounding", "bits", "numel", "n_tensors", "model",
          "param_dtype", "grad_dtype", "device", "device_name", "path", "status", "reason",
          "time_ms", "time_ms_iqr", "time_ms_min", "samples_ms", "noisy", "reps", "first_step_ms",
          "compile_ms", "bytes_moved", "bytes_per_elem", "gbps", "copy_gbps", "pct_of_copy",
          "cuda_graph", "l2_flush_bytes", "rounds", "round_ms", "ref_copy_ms", "time_rel_copy", "rel_copy_rounds",
          "ref_fused_ms", "time_rel_fused", "cpu_share", "footprint_copy_gbps", "cache_resident")


@dataclass
class KernelsOptions(Options):
    """`qstate bench kernels`: the CLI options and a suite point's parameters (options.py)."""

    COMMAND = "bench kernels"

    bits: int = option(4, "State bit width whose configs to time (4: nearest/sr/bred/torchao-4bit; "
                          "8: nearest/sr/bred/bnb-8bit).")
    optimizer: str = option("adamw", f"{names_text()}.", parse=lower)
    config: list[StateConfig] = many("Config or preset name (repeatable); overrides --bits/--rounding; 'none': "
                                     "the baselines only.", "--config", "-c", parse=config_or_none)
    rounding: list[str] = many("Keep configs with this rounding: nearest, stochastic, bred.", "--rounding", "-r")
    numel: list[int] = many("Tensor sizes (repeatable or comma list; 1e6, 2^20). Default: the device's sweep.",
                            "--numel", "-n", parse=parse_count)
    model: list[str] = many("Whole-model shapes: gpt2-small, gpt2-medium, llama-1b, tinyllama-1.1b, llama-7b, "
                            "tiny-lm, small-lm, or shapes such as 768x3072*12,768 (one model). Commas separate built-in "
                            "names; shapes written one after another are one model; repeat --model for two shape "
                            "lists.", "--model", "-m", split=split_models)
    dtype: list[str] = many("Parameter and gradient dtype: fp32, bf16, fp16 (repeatable). Default: fp32 on CPU; "
                            "fp32 and bf16 on CUDA.")
    device: str = option("auto", "auto, cuda or cpu.")
    baseline: list[str] = many("Baselines (repeatable): torch-fused, torch-foreach, bf16-states, bnb-adamw8bit, "
                               "torchao-adamw8bit, torchao-adamw4bit; not by default: bred-4bit-per-param, "
                               "flashoptim-adamw, te-fusedadam; all, none.")
    backend: list[str] = many("Our optimizers' backend: auto, reference, triton, cpu (the numba path) "
                              "(repeatable).")
    warmup_ms: float | None = option(None, "Warm-up time per row (default: 10 on CPU, 25 on CUDA).", type=float)
    rep_ms: float | None = option(None, "Timed repetitions per row, in ms (at least 5 reps; default 100).",
                                  type=float)
    cuda_graph: bool = option(False, "Capture each step in a CUDA graph and time its replays.")
    copy_numel: int | None = option(None, "fp32 elements of the copy that measures bandwidth (default: 2^26 on "
                                          "CPU, 2^28 on CUDA).", parse=parse_count, type=int)
    seed: int = seed_option("Seed of the parameters and gradients.")
    rounds: int = option(3, "Rounds: the rows of one size and dtype are timed interleaved (A B C, C B A, ...) "
                            "this many times, beside same-run copy and torch-fused references.")
    threads: int | None = option(None, f"CPU threads for torch, 1 to {MAX_THREADS} (default: unchanged; 1 is "
                                       "steadier on a shared machine; more than the CPUs this process may run on "
                                       "warns).", type=int)

    def check(self, here: bool = True) -> None:
        plan(self, here)


@dataclass
class Target:
    """One set of tensors to step: a single tensor of a sweep size, or a model's shapes."""

    shapes: list[tuple[int, ...]]
    model: str | None

    @property
    def numel(self) -> int:
        return shapes_numel(self.shapes)


@dataclass
class Plan:
    device: torch.device
    optimizer: str
    subjects: list[tuple[Subject, str]]  # (subject, backend)
    dtypes: list[str]
    targets: list[Target]
    warmup_ms: float
    rep_ms: float
    cuda_graph: bool
    copy_numel: int
    seed: int
    rounds: int = 3
    threads: int | None = None

    @property
    def total_rows(self) -> int:
        return 1 + len(self.dtypes) * len(self.targets) * len(self.subjects)


def configs(opts: KernelsOptions) -> list[StateConfig]:
    """--config as given (none for `none`), else every config of --bits, filtered by --rounding."""
    if opts.config:
        return chosen_configs(opts.config, [])
    if opts.bits not in CONFIGS_BY_BITS:
        raise QstateError(f"--bits {opts.bits}: use 4 or 8 (or name configs with --config)")
    cfgs = [parse_config(n) for n in CONFIGS_BY_BITS[opts.bits]]
    if opts.rounding:
        wanted = set()
        for r in opts.rounding:
            if r.lower() not in ROUNDINGS:
                raise QstateError(f"unknown rounding {r!r}: choose from nearest, stochastic, bred")
            wanted.add(ROUNDINGS[r.lower()])
        cfgs = [c for c in cfgs if c.m.rounding in wanted]
    return cfgs


def plan(opts: KernelsOptions, here: bool = True) -> Plan:
    """Validate options and fill device defaults (QstateError on bad input); here=False:
    Options.check."""
    states = optimizer_info(opts.optimizer).states  # QstateError for an unknown optimizer
    device = resolve_device(opts.device, here)
    d = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    dtypes = list(opts.dtype) or list(d["dtype"])
    for dt in dtypes:
        if dt not in DTYPES:
            raise QstateError(f"unknown dtype {dt!r}: choose from {', '.join(DTYPES)}")
    backends = list(opts.backend) or ["auto"]
    for b in backends:
        if b not in BACKENDS:
            raise QstateError(f"unknown backend {b!r}: choose from {', '.join(BACKENDS)}")
    numels = list(opts.numel) or ([] if opts.model else list(d["numel"]))
    if any(n < 1 for n in numels):
        raise QstateError("--numel must be >= 1")
    if opts.copy_numel is not None and opts.copy_numel < 1:
        raise QstateError(f"--copy-numel {opts.copy_numel}: must be >= 1 (omit it for the device's default)")
    for flag, value, low in (("--warmup-ms", opts.warmup_ms, 0.0), ("--rep-ms", opts.rep_ms, None)):
        if value is not None and not (math.isfinite(value) and (value > 0 if low is None else value >= low)):
            raise QstateError(f"{flag} {value:g}: must be a finite number {'>= 0' if low is not None else '> 0'}")
    targets = [Target([sweep_shape(n, opts.optimizer == "muon")], None) for n in numels]
    targets += [Target(model_shapes(m), m) for m in opts.model]
    cfgs = configs(opts)
    if not cfgs and not opts.config:
        raise QstateError(f"no {opts.bits}-bit configuration uses rounding {', '.join(opts.rounding)}")
    subjects = [(ours(c), b) for b in backends for c in cfgs]
    widths = {max(c.spec(s).bits for s in states) for c in cfgs}
    bits = widths.pop() if len(widths) == 1 else None
    subjects += [(s, "auto") for s in select_baselines(opts.optimizer, opts.baseline, bits)]
    if not subjects:
        raise QstateError("--config none and --baseline none: nothing to time")
    if opts.cuda_graph and device.type != "cuda":
        raise QstateError("--cuda-graph needs a CUDA device")
    if opts.rounds < 1:
        raise QstateError(f"--rounds {opts.rounds}: use 1 or more")
    if opts.threads is not None and not 1 <= opts.threads <= MAX_THREADS:
        raise QstateError(f"--threads {opts.threads}: use 1 to {MAX_THREADS}")
    return Plan(device, opts.optimizer, subjects, dtypes, targets,
                d["warmup_ms"] if opts.warmup_ms is None else float(opts.warmup_ms),
                d["rep_ms"] if opts.rep_ms is None else float(opts.rep_ms),
                bool(opts.cuda_graph), int(opts.copy_numel or d["copy_numel"]), int(opts.seed),
                int(opts.rounds), opts.threads)


def kernels_group_bytes(p: Plan, target: Target, dtype: torch.dtype) -> int:
    """group_bytes of one bench kernels group: every subject's states held together, and the
    references (group.py): torch's fused AdamW (two states of the parameters' dtype) and a
    copy of each distinct bytes_moved (a source and a destination: bytes_moved in all)."""
    numels = [int(torch.Size(s).numel()) for s in target.shapes]
    states, footprints = [], set()
    for subject, _ in p.subjects:
        extra = subject.extra_bytes(dtype) / 2 if subject.extra_bytes else 0.0  # stored once, read + written
        states.append(state_bytes(subject, p.optimizer, target.shapes, dtype) + int(extra * sum(numels)))
        footprints.add(subject.bytes_moved(p.optimizer, numels, dtype))
    refs = 2 * sum(numels) * dtype_bytes(dtype) + sum(footprints)
    return group_bytes(target.shapes, dtype, states, together=True, extra=refs)


def threads_warning(threads: int | None) -> str | None:
    """A line for stderr when --threads asks for more threads than the CPUs this process may
    run on (cpu_affinity): they then take turns on them, and every op waits at its
    fork/join barrier for a descheduled one (4096 threads on 2 CPUs timed a copy ~100x slower)."""
    cpus = cpu_affinity()
    if threads is None or not cpus or threads <= cpus:
        return None
    return (f"warning: --threads {threads} is more than the {cpus} CPU{'s' * (cpus != 1)} this process may run on: "
            f"threads take turns and times grow (use --threads {cpus} or fewer)")


def run(p: Plan, on_row: Callable[[dict], None] | None = None,
        on_start: Callable[[str, int, int], None] | None = None) -> list[dict]:
    """Measure every row of plan `p`; returns the rows (also passed to on_row, group by
    group: the rows of one size and dtype are timed together, in rounds; group.py)."""
    with torch_threads(p.threads):
        return _run(p, on_row, on_start)


def _run(p: Plan, on_row, on_start) -> list[dict]:
    rows: list[dict] = []
    info = device_info(str(p.device))

    def emit(row):
        rows.append(row)
        if on_row:
            on_row(row)

    def start(label):
        if on_start:
            on_start(label, len(rows), p.total_rows)

    start(f"copy {p.copy_numel:,} fp32")
    copy_row = measure_copy(p, info)
    emit(copy_row)
    copy_gbps = copy_row["gbps"]
    for dt in p.dtypes:
        dtype = DTYPES[dt]
        for target in p.targets:
            tensors, alloc_error = allocate(target.shapes, dtype, p.device, p.seed,
                                            kernels_group_bytes(p, target, dtype))
            start(f"{len(p.subjects)} rows x {p.rounds} rounds, {target.model or f'{target.numel:,}'} {dt}")
            jobs = []
            for subject, backend in p.subjects:
                ctx = Context(p.optimizer, p.device, p.cuda_graph, backend)
                row = base_row(subject, ctx, target, dtype, info, copy_gbps)
                if alloc_error:
                    row.update(status="failed", reason=alloc_error)
                jobs.append((row, subject, ctx))
            if not alloc_error:
                measure_group(jobs, tensors, p)
            for row, _, _ in jobs:
                emit(row)
            del tensors, jobs
            free_memory(p.device)
    return rows


def base_row(subject: Subject, ctx: Context, target: Target, dtype, info: dict, copy_gbps) -> dict:
    cfg = subject.config(dtype)
    rounding = cfg.m.rounding if cfg.m.rounding == cfg.v.rounding or ctx.optimizer != "adamw" else "mixed"
    if cfg.m.fmt.kind == "identity":
        rounding = None
    bytes_moved = subject.bytes_moved(ctx.optimizer, [int(torch.Size(s).numel()) for s in target.shapes], dtype)
    row = dict.fromkeys(FIELDS)
    row.update(name=subject.name, role=subject.role, optimizer=ctx.optimizer, config=cfg.canonical(),
               rounding=rounding, bits=max(cfg.spec(s).bits for s in optimizer_info(ctx.optimizer).states),
               numel=target.numel, n_tensors=len(target.shapes), model=target.model,
               param_dtype=DTYPE_NAMES[dtype], grad_dtype=DTYPE_NAMES[dtype], device=ctx.device.type,
               device_name=info["device_name"], path=subject.nominal_path(ctx), status="ok",
               bytes_moved=bytes_moved, bytes_per_elem=round(bytes_moved / target.numel, 6),
               copy_gbps=copy_gbps, cuda_graph=ctx.cuda_graph)
    return row


def measure_copy(p: Plan, info: dict) -> dict:
    """The `copy` row: a device-to-device copy of copy_numel fp32 values, timed in rounds
    like every other row (its verdict in `compare` then has rounds and a cpu_share)."""
    row = dict.fromkeys(FIELDS)
    row.update(name="copy", role="copy", optimizer=None, config="copy", numel=p.copy_numel, n_tensors=1,
               param_dtype="fp32", grad_dtype=None, device=p.device.type, device_name=info["device_name"],
               path="copy", status="ok", bytes_moved=8 * p.copy_numel, bytes_per_elem=8.0, cuda_graph=False)
    short = memory_shortfall(p.device, 8 * p.copy_numel + COPY_HEADROOM_BYTES)  # a source and a destination
    if short:
        row.update(status="failed", reason=short)
        return row
    try:
        measured = measure_rounds([copy_item(p.device, p.copy_numel)], p.device, p.rounds, p.warmup_ms, p.rep_ms)
        got = measured.items[0]
        if isinstance(got, BaseException):
            raise got
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        row.update(status="failed", reason=f"out of memory: {exc}")
        free_memory(p.device)
        return row
    fill_timing(row, got.timing)
    row.update(copy_gbps=row["gbps"], pct_of_copy=100.0, rounds=len(got.timings),
               round_ms=[float(f"{x:.6g}") for x in got.round_medians],
               cpu_share=None if measured.cpu_share is None else round(measured.cpu_share, 4))
    return row


def options_meta(opts: KernelsOptions, p: Plan) -> dict:
    return {"options": opts.to_params(), "warmup_ms": p.warmup_ms, "rep_ms": p.rep_ms, "rounds": p.rounds,
            "threads": p.threads, "dtypes": p.dtypes,
            "copy_numel": p.copy_numel, "targets": [t.model or t.numel for t in p.targets],
            "subjects": [s.name for s, _ in p.subjects]}



def streamed(kind: str, p, meta: dict, run_rows: Callable, progress: Progress | None,
             notes: tuple[str, ...] = ()) -> Result:
    """A bench engine's rows as a Result, each row reported to `progress` as soon as it is
    measured (Ctrl-C keeps what was reported). `run_rows(p, on_row, on_start)` measures;
    `notes`: lines for the log once the work begins (a warning)."""
    progress = progress or QUIET
    threads = getattr(p, "threads", None)  # --threads: the count the rows ran with, not the process's
    result = Result(kind, meta=meta, device=str(p.device), env={"torch_threads": threads} if threads else {})
    progress.begin(p.total_rows, result)
    for line in notes:
        progress.log(line)
    result.records = run_rows(p, on_row=progress.row,
                              on_start=lambda label, done, total: progress.start(label, done))
    return result


def execute(opts: KernelsOptions, progress: Progress | None = None) -> Result:
    """`qstate bench kernels` as a library call (kinds.py)."""
    p = plan(opts)
    warning = threads_warning(p.threads)
    result = streamed("kernels", p, options_meta(opts, p), run, progress, notes=(warning,) if warning else ())
    shares = [r["cpu_share"] for r in result.records if r.get("cpu_share") is not None]
    result.meta["cpu_share"] = min(shares) if shares else None  # the most shared group of the run
    return result
