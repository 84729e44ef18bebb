"""`qstate diagnose` as a library: options, configurations, the replay, the result.

    execute(DiagnoseOptions(trace="trace.pt", config=["bred-4bit"]), progress) -> Result
    diagnose(trace, configs, ...) -> (result document, Replay)      # tests, notebooks

Configurations (`select_configs`):
- `--config NAME` (repeatable): exactly these (presets or explicit configurations);
- `--bits B` / `--rounding R` (repeatable): the linear presets `{R}-{B}bit` for every B and R
  (R defaults to nearest, stochastic, bred; B to 4), added to any --config;
- neither: DEFAULT_CONFIGS, what people run or consider today;
- `--block-size N` then sets the block size of every block-scaled state.

The trace `demo` always names the cached demo trace (trace/demo.py: made on first use,
then reused), on the command line and in a suite alike; a file or folder that happens to
be called demo is `./demo`. `corpus:NAME` names a corpus trace (trace/corpus.py), made
on first use and cached alike.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import theory
from ..errors import QstateError
from ..optim.reset import ResetPolicy
from ..options import Options, many, option
from ..progress import QUIET, Progress
from ..quant.config import MAX_BLOCK, MIN_BLOCK, MIN_QUANT_NUMEL, ROUNDINGS, StateConfig, config_of, parse_config, parse_spec
from ..results import Result
from ..runtime import resolve_device
from ..trace import load_trace
from ..trace.schema import Trace, digest
from . import distributed
from .codec import check_backend
from .gaps import absent_counts
from .replay import Replay, ReplayOptions, replay
from .summary import build
from .validate import replays_for, update_errors, validate

DEFAULT_CONFIGS = ("nearest-4bit", "sr-4bit", "bred-4bit", "bnb-8bit", "torchao-4bit", "bf16", "bf16-sr")
LINEAR_PRESET = {"nearest": "nearest", "stochastic": "sr", "bred": "bred"}
THEORY_FORMATS = ("bf16", "e4m3", "e2m2")
DEMO = "demo"
ABSENT_NOTES = 10  # one note per tensor without a gradient at some steps, at most this many


@dataclass
class DiagnoseOptions(Options):
    """`qstate diagnose`: the CLI options and a suite point's parameters (options.py)."""

    COMMAND = "diagnose"

    trace: str | None = option(None, "Trace file or directory of shards (from `qstate trace demo` or the Recorder); "
                                     "'demo': the cached demo trace; 'corpus:NAME': a corpus trace (qstate trace corpus); "
                                     "both made on first use.", argument=True)
    config: list[StateConfig] = many("Configuration to replay (repeatable): preset or m=SPEC,v=SPEC.",
                                     "--config", "-c", parse=parse_config)
    bits: list[int] = many("Add the linear presets at these bits (4, 8; repeatable).", type=int)
    rounding: list[str] = many("With --bits: nearest, stochastic, bred (repeatable; default all).")
    block_size: int | None = option(None, "Block size for every block-scaled state (power of two, 32..2048).",
                                    "--block-size", "-b", type=int)
    reset: str = option("none", "Reset policy the replay applies: none, N (every N steps) or auto (staleness "
                                "model).")
    steps_limit: int | None = option(None, "Replay only the first N recorded steps.", type=int)
    device: str = option("auto", "auto (CUDA when present), cpu or cuda.")
    split: str = option("auto", "Under torchrun: split the recorded elements across ranks (elements) or the "
                                "configurations (configs); auto: elements from 65,536 recorded elements per rank "
                                "or with fewer configurations than ranks, else configs; docs/distributed.md.",
                        parse=lambda v: _split_mode(v))
    backend: str = option("auto", "The states' codec: auto (a fused codec where one covers the state and device, "
                                  "bit-identical records) or reference (the eager quantizer).",
                          parse=lambda v: check_backend(v))
    config_threads: int = option(1, "CPU: replay this many configurations at once, one per thread (the same "
                                    "records with any count; faster only with that many free cores; "
                                    "docs/diagnose.md).", parse=lambda v: _config_threads(v), metavar="N")
    profile: bool = option(False, "Print replay throughput (element-steps per second) per phase (always in meta).")
    skip_reset_check: bool = option(False, "Give the reset advice without replaying it (validate.py: by default "
                                           "each recommended period is replayed and kept only if it lowers the "
                                           "update error against fp32).")
    theory: bool = option(False, "Only the staleness model: predicted stall probabilities and reset periods.")
    format: list[str] = many("With --theory: float formats (default bf16, e4m3, e2m2).", "--format", "-f")
    beta2: float = option(0.999, "With --theory: the second-moment beta.")

    def check(self, here: bool = True) -> None:
        check_options(self, here)


def _config_threads(value) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(value).strip() != str(n):
        raise QstateError(f"--config-threads {value}: use a whole number of threads, 1 or more")
    return n


def _split_mode(value) -> str:
    mode = str(value).strip().lower()
    if mode not in distributed.MODES:
        raise QstateError(f"--split {value}: choose auto, elements or configs")
    return mode


def select_configs(configs=(), bits=(), rounding=(), block_size: int | None = None) -> list[StateConfig]:
    if block_size is not None and not (MIN_BLOCK <= block_size <= MAX_BLOCK and block_size & (block_size - 1) == 0):
        raise QstateError(f"--block-size {block_size}: the replay needs a power of two from {MIN_BLOCK} to "
                          f"{MAX_BLOCK}")
    names = list(configs or ())
    if bits or rounding:
        for b in bits or (4,):
            if b not in (4, 8):
                raise QstateError(f"--bits {b}: the linear presets exist at 4 and 8 bits")
            for r in rounding or ("nearest", "stochastic", "bred"):
                key = ROUNDINGS.get(str(r).lower())
                if key is None:
                    raise QstateError(f"unknown rounding {r!r}: choose from nearest, stochastic, bred")
                names.append(f"{LINEAR_PRESET[key]}-{b}bit")
    if not names:
        names = list(DEFAULT_CONFIGS)
    out, seen = [], set()
    for n in names:
        cfg = parse_config(n)
        if block_size is not None:
            cfg = with_block_size(cfg, block_size)
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


def with_block_size(cfg: StateConfig, block: int) -> StateConfig:
    """The configuration with every block-scaled state at `block` (floats stay unscaled);
    StateSpec checks the block size (range, parity) with a clear message."""
    m, v = (replace(spec, block=block) if spec.scaled else spec for spec in (cfg.m, cfg.v))
    return config_of(m, v)


def check_options(opts: DiagnoseOptions, here: bool = True) -> list[StateConfig]:
    """What `execute` would refuse, found before a trace is made, loaded or replayed
    (Options.check; here=False checks the device by name only); the configurations."""
    if opts.theory:
        theory_specs(opts.format or THEORY_FORMATS, opts.beta2)
        return []
    if not opts.trace:
        raise QstateError("diagnose needs a TRACE (a suite point needs 'trace'), or --theory; make one with "
                          "`qstate trace demo`, or name `demo`")
    configs = select_configs(opts.config, opts.bits, opts.rounding, opts.block_size)
    if opts.steps_limit is not None and opts.steps_limit < 1:
        raise QstateError(f"--steps-limit {opts.steps_limit}: must be >= 1 (omit it for every recorded step)")
    ResetPolicy.parse(opts.reset)
    resolve_device(opts.device, here)
    if here:  # a corpus trace this machine cannot record (a package missing) fails now, not mid-suite
        from ..trace.corpus import check_can_make

        check_can_make(opts.trace)
    return configs


def execute(opts: DiagnoseOptions, progress: Progress | None = None) -> Result:
    """`qstate diagnose` as a library call (kinds.py): the replay's records and rows, or
    with `theory` the staleness model alone."""
    progress = progress or QUIET
    configs = check_options(opts)  # before the trace is made or loaded: an error is the only line
    if opts.theory:
        return theory_result(opts.format or THEORY_FORMATS, opts.beta2)
    if distributed.launched():  # torchrun: rank 0 makes the demo trace (if needed) before the others look
        distributed.init(opts.device)
        if distributed.rank() == 0:
            path = resolve_trace(opts.trace, log=progress.log)
        torch.distributed.barrier()
        path = resolve_trace(opts.trace)
    else:
        path = resolve_trace(opts.trace, log=progress.log)
    trace = load_trace(path)
    n_steps = min(trace.n_steps, opts.steps_limit or trace.n_steps)
    progress.begin(n_steps, Result("diagnose", meta={"trace": trace.source}))

    def advance(done: int, total: int) -> None:
        progress.start(f"replaying {len(configs)} configuration{'s' * (len(configs) != 1)}", done)

    def checking(group: int, groups: int, done: int, total: int) -> None:
        progress.start(f"checking the reset advice: replay {group + 1} of {groups}", done)

    result, _ = replay_result(trace, configs, reset=opts.reset, steps_limit=opts.steps_limit, device=opts.device,
                              progress=advance, profile_phases=opts.profile,
                              check_resets=not opts.skip_reset_check, log=progress.log, split=opts.split,
                              backend=opts.backend, config_threads=opts.config_threads, check_progress=checking)
    return result


def diagnose(trace: Trace | str | Path, configs: list[StateConfig], reset="none", steps_limit: int | None = None,
             device: str = "auto", progress=None, keep_states: bool = False,
             profile_phases: bool = False, check_resets: bool = False, backend: str = "auto",
             config_threads: int = 1) -> tuple[dict, Replay]:
    """Replay `trace` through `configs`; returns (result document, the Replay). `trace`
    may be a Trace, a path, or "demo" (the cached demo trace). `progress(done, total)`
    after each step; `profile_phases` synchronizes CUDA around each phase so the
    per-phase times are exact; `check_resets` replays each recommended reset period
    (validate.py; off here by default: tests ask for it)."""
    result, raw = replay_result(trace, configs, reset, steps_limit, device, progress, keep_states, profile_phases,
                                check_resets, backend=backend, config_threads=config_threads)
    return result.document(), raw


def replay_result(trace: Trace | str | Path, configs: list[StateConfig], reset="none",
                  steps_limit: int | None = None, device: str = "auto", progress=None, keep_states: bool = False,
                  profile_phases: bool = False, check_resets: bool = True, log=None,
                  split: str = "auto", backend: str = "auto", config_threads: int = 1,
                  check_progress=None) -> tuple[Result, Replay]:
    """The replay (Replay) and its rows as a Result (kind "diagnose"). Under torchrun every
    rank replays its share (`split`: auto, elements or configs, distributed.py) and returns the
    same Result; rank 0 writes it."""
    if not isinstance(trace, Trace):
        trace = load_trace(resolve_trace(trace))
    if steps_limit is not None and steps_limit < 1:
        raise QstateError(f"steps limit must be >= 1, got {steps_limit}")
    ranks, share = 1, None
    if distributed.launched():  # torchrun: this rank's share (distributed.py)
        device = distributed.init(device)
        if split == "auto":
            split = distributed.auto_mode(trace.recorded_elements, len(configs),
                                          torch.distributed.get_world_size())
        share = distributed.split(split)
        ranks = share.size
    opts = ReplayOptions(list(configs), reset=reset, steps_limit=steps_limit, device=device, keep_states=keep_states,
                         profile=profile_phases, split=share, backend=backend,
                         config_threads=_config_threads(config_threads))
    t0 = time.perf_counter()
    raw = replay(trace, opts, progress)
    rows = build(raw)
    if check_resets:
        t_check = time.perf_counter()
        check_reset_advice(trace, raw, rows["records"], steps_limit, device, log,
                           None if share is None else share.elements(), backend, opts.config_threads,
                           progress=check_progress)
        meta_check_s = round(time.perf_counter() - t_check, 3)
    else:
        meta_check_s = None
    trace_digest = digest(trace)  # the whole trace's content (every row, whatever --steps-limit), not the file's bytes (schema.digest)
    meta = {
        "trace": trace.source, "trace_digest": trace_digest, "optimizer": trace.optimizer, "hparams": trace.hparams, "seed": trace.seed,
        "step_start": trace.step_start, "steps": raw.n_steps, "trace_steps": trace.n_steps,
        "tensors": len(trace.tensors), "recorded_elements": trace.recorded_elements,
        "total_elements": trace.total_elements, "grad_dtype": trace.grad_dtype,
        "configs": [str(c) for c in configs], "canonical": {str(c): c.canonical() for c in configs},
        "reset": str(reset), "reset_applied": {str(c.cfg): [c.period, c.period_reason] for c in raw.configs},
        "nonfinite_grads": raw.nonfinite_grads, "notes": list(raw.recursion.notes),
        "quantized_everything": "every recorded tensor is quantized (the optimizers keep tensors under "
                                f"min_quant_numel={MIN_QUANT_NUMEL} in fp32)",
        "profile": profile(raw, time.perf_counter() - t0),
        "codec": {str(c.cfg): c.codec for c in raw.configs},  # state -> [path, why the reference ran] (codec.py)
        "ranks": ranks, "split": split if ranks > 1 else None,  # torchrun's ranks and what they split
        "reset_check_s": meta_check_s,
    }
    meta["gradient_checks"] = rows.pop("gradient_checks")
    dead = meta["gradient_checks"]["grad_dead_elements"]
    if dead:
        meta["notes"].append(f"{dead} of {raw.layout.n_valid} recorded elements have a zero gradient at every "
                             f"step (dead blocks: `qstate trace info` counts them); they never stall and "
                             f"count in no stall rate")
    if steps_limit is not None and steps_limit > trace.n_steps:
        meta["notes"].append(f"--steps-limit {steps_limit}: the trace holds {trace.n_steps} steps, all replayed")
    small = [t for t in trace.tensors if t.numel < MIN_QUANT_NUMEL]
    if small and any(c.m.scaled or c.v.scaled or c.m.fmt.bits < 32 for c in configs):
        share = sum(t.n_recorded for t in small) / max(1, trace.recorded_elements)
        meta["notes"].append(f"{len(small)} of {len(trace.tensors)} tensors hold under {MIN_QUANT_NUMEL} elements "
                             f"({share:.1%} of the recorded ones): the replay quantizes them too, while the optimizers "
                             f"keep them in fp32 (min_quant_numel), so B/param and the statistics count them quantized")
    absent = absent_counts(trace, raw.n_steps)
    if absent:
        meta["absent_steps"] = absent
        for name, k in list(absent.items())[:ABSENT_NOTES]:
            meta["notes"].append(f"{name}: no gradient at {k} of {raw.n_steps} replayed steps (.grad None: the "
                                 f"optimizer did not step it); the replay skips them too (its states, codes "
                                 f"and step count held, no update, reset on its own count; the reference rule: "
                                 f"diagnose/gaps.py)")
        if len(absent) > ABSENT_NOTES:
            meta["notes"].append(f"... and {len(absent) - ABSENT_NOTES} more tensors without a gradient at some "
                                 f"steps, skipped alike (meta.absent_steps lists every one)")
    records = rows.pop("records")
    for r in records:  # what ties a row to its trace when files are concatenated (pandas)
        r.setdefault("seed", trace.seed)
        r.setdefault("trace_digest", trace_digest)
    return Result("diagnose", records, meta, extras=rows, device=raw.device), raw


def check_reset_advice(trace: Trace, raw: Replay, records: list[dict], steps_limit, device, log=None,
                       split=None, backend: str = "auto", config_threads: int = 1, progress=None) -> None:
    """Replay every configuration's recommended reset period (validate.py) and rewrite its
    records' advice: kept where it lowers the update error against fp32, else no reset
    (through the same codec `backend` as the replay itself). Every configuration's candidate
    runs replay together (validate.update_errors), at most as many at once as the replay held
    configurations (3 at least: a configuration's candidates and its baseline), so the
    check holds no more states than the replay did, give or take two; on the replay's layout
    unit, so each error and the replay's own no-reset error sum in the same blocks."""
    rec = raw.recursion
    slow = rec.slowest_state
    asks = []
    for c in raw.configs:
        rows = [r for r in records if r["config"] == str(c.cfg)]
        advice = (rows[0]["reset_period"], rows[0]["reset_reason"])
        baseline = rows[0]["update_rel_error"] if c.period is None else None  # measured against fp32 without resets
        asks.append((c, rows, advice, baseline))
    runs = [(c.cfg, p) for c, _, advice, baseline in asks
            for p in replays_for(c.cfg.spec(slow), rec.betas[slow], advice, raw.n_steps, baseline)]
    if runs and log is not None:
        log("checking the reset advice by replay: " + ", ".join(
            f"{cfg} {f'every {p}' if p else 'without resets'}" for cfg, p in runs))
    errors = update_errors(trace, runs, steps_limit, device, split, backend, batch=max(3, len(raw.configs)),
                           config_threads=config_threads, unit=raw.layout.unit,  # the baseline's unit
                           progress=progress)  # (group, groups, done, total) after each step
    for c, rows, advice, baseline in asks:
        replayed = {p: e for (cfg, p), e in zip(runs, errors) if cfg == c.cfg}
        verdict = validate(trace, c.cfg, c.cfg.spec(slow), rec.betas[slow], advice, raw.n_steps, baseline,
                           steps_limit, device, split, backend, replayed)
        for r in rows:
            r.update(reset_period=verdict.period, reset_reason=verdict.reason,
                     reset_update_error=verdict.error_with, no_reset_update_error=verdict.error_without)


def resolve_trace(trace, log=None) -> Path:
    """A trace path; "demo" names the cached demo trace and "corpus:NAME" a corpus trace
    (both made on first use; module docstring, trace/corpus.py)."""
    from ..trace.corpus import resolve

    return resolve(trace, log)


def profile(raw: Replay, total_s: float) -> dict:
    """Replay throughput: element-steps (recorded elements x steps) per second of wall time,
    and per CPU-second (what the replay gets on a machine that other work also uses). A
    phase's seconds spent compiling kernels (a first use on the machine: Timer.compiled),
    loading them from the disk cache (the first call of each in this process: Timer.loaded)
    and the rest of its first call's one-time work (imports, probes, starting threads:
    Timer.setup, the first call beyond the mean of the others) are left out of every rate
    and reported as compile_s, load_s and setup_s, per phase and in all; phases_s stays as
    measured. The loop's wall and CPU seconds leave out the loop's own count of the three
    (raw.left_out_s: runtime.StepClock, which counts once what phases running side by side,
    `--config-threads`, each count while open); a Replay without it takes the phases' sums."""
    n_cfg = len(raw.configs)
    element_steps = raw.layout.n_valid * raw.n_steps
    compiled = {k: v for k, v in raw.compile_s.items() if v > 0}
    loaded = {k: v for k, v in raw.load_s.items() if v > 0}
    setup = {k: v for k, v in (getattr(raw, "setup_s", None) or {}).items() if v > 0}
    net = {k: max(0.0, v - compiled.get(k, 0.0) - loaded.get(k, 0.0) - setup.get(k, 0.0))
           for k, v in raw.timings_s.items()}
    loop = getattr(raw, "left_out_s", None)
    if loop:  # counted once for the whole loop (docstring)
        compile_s, load_s, setup_s = loop["compile"], loop["load"], loop["setup"]
        wall, cpu = raw.net_wall_s, raw.net_cpu_s
    else:
        compile_s, load_s, setup_s = sum(compiled.values()), sum(loaded.values()), sum(setup.values())
        left_out = compile_s + load_s + setup_s
        wall, cpu = max(0.0, raw.wall_s - left_out), max(0.0, raw.cpu_s - left_out)
    per_cfg = {k: v for k, v in net.items() if k not in ("gather", "shadow")}
    return {
        "device": raw.device, "threads": raw.threads, "config_threads": raw.config_threads,
        "element_steps": element_steps, "configs": n_cfg,
        "replay_s": round(wall, 3), "replay_cpu_s": round(cpu, 3), "total_s": round(total_s, 3),
        "element_steps_per_s_per_config": round(element_steps * n_cfg / wall) if wall > 0 else None,
        "element_steps_per_cpu_s_per_config": round(element_steps * n_cfg / cpu) if cpu > 0 else None,
        "phases_s": {k: round(v, 3) for k, v in raw.timings_s.items()},
        "phases_synchronized": raw.timings_synchronized,
        "compile_s": round(compile_s, 3),
        "phases_compile_s": {k: round(v, 3) for k, v in compiled.items()},
        "load_s": round(load_s, 3),
        "phases_load_s": {k: round(v, 3) for k, v in loaded.items()},
        "setup_s": round(setup_s, 3),
        "phases_setup_s": {k: round(v, 3) for k, v in setup.items()},
        "config_element_steps_per_s": {k: round(element_steps / v) for k, v in per_cfg.items() if v > 0},
        "layout": {"unit": raw.layout.unit, "padded_elements": raw.layout.n},
    }


def theory_result(formats=THEORY_FORMATS, beta2: float = 0.999, roundings=("nearest", "stochastic"),
                  buildup_steps=(10, 100, 1000)) -> Result:
    """`qstate diagnose --theory`: predicted stall probabilities and reset periods, no trace."""
    specs = theory_specs(formats, beta2, roundings)
    rows = theory.theory_rows(specs, beta2)
    for row, spec in zip(rows, specs):
        for t in buildup_steps:
            row[f"p_stall_t{t}"] = round(float(theory.stall_probability(spec, beta2, float(
                theory.buildup_level(t, beta2)))), 4)
    meta = {"mode": "theory", "beta2": beta2, "formats": list(formats or THEORY_FORMATS), "buildup": theory.BUILDUP}
    return Result("diagnose", [], meta, extras={"theory": rows}, device="cpu")


def theory_specs(formats, beta2: float, roundings=("nearest", "stochastic")) -> list:
    """The state specs --theory models (QstateError for a beta2 or a format it cannot)."""
    if not 0.0 < beta2 < 1.0:
        raise QstateError(f"--beta2 {beta2}: must be between 0 and 1")
    specs = []
    for f in formats or THEORY_FORMATS:
        for r in roundings:
            spec = parse_spec(f"{f}:{r}")
            if theory.fraction_bits_of(spec) is None:
                raise QstateError(f"--format {f}: the staleness model covers float formats "
                                  f"(bf16, fp16, e4m3, e5m2, e2m1, e2m2), not {spec.fmt.kind} ones")
            specs.append(spec)
    return specs


def theory_document(formats=THEORY_FORMATS, beta2: float = 0.999, **kw) -> dict:
    """The --theory result as a results document."""
    return theory_result(formats, beta2, **kw).document()
