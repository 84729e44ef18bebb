"""The kinds of results, in one table: what runs each one, how it is reported and compared.

    kind      command         options / engine                          report section      compared on
    kernels   bench kernels   bench.kernels: KernelsOptions, execute    sections.kernels    time_ms (timing)
    memory    bench memory    bench.memory: MemoryOptions, execute      sections.memory     bytes_per_param
    diagnose  diagnose        diagnose.run: DiagnoseOptions, execute    report.diagnose     drift, error, stalls, fidelity
    train     bench train     train.study: TrainSettings, execute       sections.train      final_val_loss, diverged
    doctor    doctor          doctor.run: DoctorOptions, execute        sections.doctor     errors
    compare   compare         (made by `qstate compare`)                compare.section     -

A suite runs the kinds that have an engine: a point's parameters fill the kind's options
dataclass (options.py: the same fields as the command's flags) and `execute(options,
progress) -> Result` runs it. The report (report/__init__.py) draws each document with its
kind's section; `qstate compare` (compare/) matches rows on `identity` (where rows of one
side share it: also on the suite parameters, else the `distinguish` fields, that tell them
apart: compare/identity.py) and judges each of `metrics`. Engines, options and sections are
named "module:attribute" and imported on first use, so this table imports nothing above it
and a build without an engine still loads the rest.

Compare metrics. Timing (kernels `time_ms`): compare/noise.py (the time relative to a
same-run copy, rounds apart and beyond the measured noise floor; a shared CPU is
"noisy"; rows without rounds: ratio beyond the threshold AND a two-sided Mann-Whitney U
test on `samples_ms` with p < alpha). Deterministic quality metrics (a seeded trace
replays bit for bit on one build; builds and thread counts may differ in the last bits)
are compared with a tolerance, tol = max(abs_tol, rel_tol * |baseline|), in the metric's
direction:

    metric            better   abs_tol  rel_tol  why
    drift_max_abs     lower    1e-3     10%      more drift is worse (bias building up)
    rel_rms_error     lower    1e-4      5%      state error relative to the fp32 shadow
    stall_rate        lower    0.01      5%      stale states adapt slower
    update_cosine     higher   2e-3      0       update direction vs fp32 states
    update_rel_error  lower    1e-3      5%
    bytes_per_param   lower    1e-9      0       exact accounting: any growth is a regression
    final_val_loss    lower    0.02    0.5%      same seed, same data order
    diverged          False    -         -       False -> True is a regression
    errors            lower    0         0       a checkpoint finding that would change training

Suite baselines: for `kernels` and `memory` a suite passes `config` and `baseline` to every
point as lists (`list_params`; an empty list means none, not the command's defaults): a
config point has `config: [NAME], baseline: []`, a baseline point `config: [],
baseline: [NAME]`. For `diagnose` and `train` a baseline is a configuration like any
other (`baseline_param` is `config`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from .errors import QstateError


@dataclass(frozen=True)
class Metric:
    field: str
    unit: str
    better: str  # "lower" | "higher"
    abs_tol: float = 0.0
    rel_tol: float = 0.0
    timing: bool = False

    def tolerance(self, baseline: float) -> float:
        return max(self.abs_tol, self.rel_tol * abs(baseline))


@dataclass(frozen=True)
class Kind:
    name: str
    command: str  # the CLI command that makes it: `qstate <command>`
    options: str | None  # "module:Class", the options dataclass (None: no engine)
    engine: str | None  # "module:function": execute(options, progress) -> Result
    section: str  # "module:function": (doc, source, palette) -> (report Section, summary lines)
    metrics: tuple[Metric, ...] = ()
    identity: tuple[str, ...] = ()  # fields that name a row: the same thing measured in two files
    # row fields that tell apart rows of one identity where their suite points' parameters do
    # not (used only for rows that share an identity: compare/identity.py)
    distinguish: tuple[str, ...] = ()
    baseline_param: str = "config"  # the parameter a suite's baseline point sets
    list_params: tuple[str, ...] = ()  # parameters a suite passes as lists (empty: none)

    @property
    def runnable(self) -> bool:
        return self.engine is not None


def _kind(name: str, command: str, module: str | None, options: str | None, section: str, **kw) -> Kind:
    return Kind(name, command, f"{module}:{options}" if module else None, f"{module}:execute" if module else None,
                section if ":" in section else f"qstate_cli.report.sections:{section}", **kw)


PATH_PARAMS = ("trace",)  # suite parameters that name a file (read relative to the suite's folder)

KINDS: dict[str, Kind] = {k.name: k for k in (
    _kind("kernels", "bench kernels", "qstate_cli.bench.kernels", "KernelsOptions", "kernels",
          metrics=(Metric("time_ms", "ms", "lower", timing=True),),
          identity=("name", "optimizer", "config", "numel", "n_tensors", "model", "param_dtype", "grad_dtype",
                    "device", "path"),
          distinguish=("rounds", "cuda_graph", "l2_flush_bytes"),
          baseline_param="baseline", list_params=("config", "baseline")),
    _kind("memory", "bench memory", "qstate_cli.bench.memory", "MemoryOptions", "memory",
          metrics=(Metric("bytes_per_param", "bytes/param", "lower", 1e-9),),
          identity=("name", "optimizer", "config", "model"),
          distinguish=("params", "n_tensors", "param_dtype", "device", "path"),
          baseline_param="baseline", list_params=("config", "baseline")),
    _kind("diagnose", "diagnose", "qstate_cli.diagnose.run", "DiagnoseOptions", "qstate_cli.report.diagnose:diagnose",
          metrics=(Metric("drift_max_abs", "fraction of RMS", "lower", 1e-3, 0.10),
                   Metric("rel_rms_error", "fraction of RMS", "lower", 1e-4, 0.05),
                   Metric("stall_rate", "fraction", "lower", 0.01, 0.05),
                   Metric("update_cosine", "cosine", "higher", 2e-3),
                   Metric("update_rel_error", "fraction", "lower", 1e-3, 0.05)),
          identity=("config", "state", "numel", "steps"),
          distinguish=("reset_applied", "block_size", "sqrt", "beta", "optimizer")),
    _kind("train", "bench train", "qstate_cli.train.study", "TrainSettings", "train",
          metrics=(Metric("final_val_loss", "nats", "lower", 0.02, 0.005), Metric("diverged", "bool", "lower")),
          identity=("config", "optimizer", "model", "seed", "steps"),
          distinguish=("batch_size", "lr", "reset", "states", "steps_requested", "device", "path")),
    _kind("doctor", "doctor", "qstate_cli.doctor.run", "DoctorOptions", "doctor",
          metrics=(Metric("errors", "findings", "lower"),), identity=("checkpoint", "optimizer", "param")),
    _kind("compare", "compare", None, None, "qstate_cli.compare.section:compare"),
)}


def runnable_kinds() -> tuple[str, ...]:
    """The kinds a suite can run (they have an engine), in table order."""
    return tuple(name for name, kind in KINDS.items() if kind.runnable)


def kind(name: str) -> Kind:
    if name not in KINDS:
        raise QstateError(f"unknown kind {name!r}; use one of {', '.join(KINDS)}")
    return KINDS[name]


def load(ref: str, what: str):
    """The attribute a "module:attribute" reference names, imported now; a missing module
    or attribute is a clear error naming `what` needs it."""
    module_name, attr = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise QstateError(f"{what} needs {module_name}.{attr}, which this build does not have ({exc})") from None
    value = getattr(module, attr, None)
    if value is None:
        raise QstateError(f"{what} needs {module_name}.{attr}, which {module_name} does not define")
    return value
