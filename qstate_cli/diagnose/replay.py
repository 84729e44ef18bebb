"""The replay engine: a trace's gradients through an fp32 shadow and every configuration.

Per step (one pass over the trace, all configurations together):

    g      = recorded gradients of every tensor, in the flat layout (layout.py);
             NaN/Inf elements counted and set to 0 (the optimizers' policy)
    shadow : fp32 states, one set per reset schedule:  u_ref, s = rule(g, s_prev)
    config : u, x = rule(g, x_hat_prev)         (optim.rules via recursions.py)
             x_hat = decode(encode(x))           (quant.QuantizedState, step-keyed streams)
             statistics of x_hat vs s and of u vs u_ref (stats.py)
    (step.py: one step of a shadow and of a configuration)

exactly as the reference optimizer does it (quantized states read back as zeros until
written; a reset puts them back to that; a v read back below 0 is clamped to 0, as the optimizer does),
except that every recorded tensor is quantized (the optimizers keep tensors under
`min_quant_numel` in fp32). Cost per configuration and step: about 2 x (encode + decode
+ ~15 elementwise passes) over the recorded elements; the fp32 shadow and the gradient
gather are shared by all configurations. The staleness model (staleness.py: per element,
from the fp32 shadow) costs about one more encode + decode per state (~60 torch passes; on
the fused CPU codec's states one numba pass and the Gaussian CDFs, stats.ModelStats), so
it is evaluated at model_points(n) steps spread evenly over the replay: MODEL_POINTS, fewer
on a large layout (at most MODEL_ELEMENT_STEPS element evaluations per state, at least
MODEL_MIN_POINTS steps), every step of a replay up to twice that. On CPU, an AdamW
configuration whose rule, codec and statistics are all fused steps in one kernel call
(fused_step.py), the same records. A trace whose tensors lack a gradient at some steps
(`absent` rows: the optimizer skipped them) replays on the reference rule, each tensor at
its own step count and held where absent (gaps.py).

The configurations of a step run one after another, or up to ReplayOptions.config_threads
at once (`--config-threads`, runtime.Workers): each writes only its own states and reads
the step's gradients and shadow, so the records are the same. Step i starts at the
(i mod k)-th of the k configurations (`step_order`): the first configuration of a step runs
slower for its place alone (~25 us a step on the demo, docs/diagnose.md, "Subnormal tails"),
so each pays that 1/k of the time and `--profile` charges it to none in particular.

Under torchrun (`ReplayOptions.split`, distributed.py) each rank runs this loop on its
part of the layout (layout.py) or on its configurations, and the parts are merged
(merge.py) into the Replay one process would return.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np
import torch

from ..errors import QstateError
from ..kernels.cpu import PATH as CPU_PATH  # the fused CPU codec's path (no numba imported)
from ..kernels.cpu import unavailable_reason as cpu_unavailable
from ..kernels.cpu.host import threads as kernel_threads  # no numba
from ..kernels.cpu.team import team as kernel_team, team_parts  # no numba until a team is asked for
from ..optim.reset import ResetPolicy, auto_period
from ..quant.config import STATE_IDS, StateConfig  # streams keyed as the optimizers key them
from ..runtime import StepClock, Timer, Workers, resolve_device, torch_threads
from ..trace.schema import Trace
from . import merge
from .codec import check_backend, replay_rule, replay_state
from . import fused_step
from .gaps import Gaps
from .layout import Layout
from .step import ConfigState, Shadow, model_inputs, step_config, step_shadow, stream_for
from .recursions import Recursion, recursion_for
from .stats import GradientStats, ModelStats, StateStats, UpdateStats, dimension_ms, fidelity, unit_sums



@dataclass
class ReplayOptions:
    configs: list  # of StateConfig
    reset: str = "none"  # none | N | auto
    steps_limit: int | None = None
    device: str = "auto"
    snapshots: int = 32  # staleness / dimension snapshots over the replay
    keep_states: bool = False  # return the final stored states (tests)
    profile: bool = False  # synchronize around phases (CUDA) so the timings are exact
    split: object | None = None  # torchrun: this rank's share and the collectives (distributed.Split)
    reference_reset: bool = True  # the fp32 shadow follows each configuration's resets (False: never resets)
    models: bool = True  # evaluate the staleness model (staleness.py)
    state_stats: bool = True  # the states' statistics (False: stored, not measured; the update's are: validate.py)
    backend: str = "auto"  # the states' codec: auto (a fused one where it covers the state) or reference (codec.py)
    fused_step: bool = True  # a whole configuration step in one kernel call where it covers it (fused_step.py)
    config_threads: int = 1  # configurations stepped at once on CPU (config_threads_for)
    resets: list | None = None  # per configuration its own reset (none | N) in place of `reset` (runs_of)
    unit: int | None = None  # the layout's unit (None: layout_unit(configs); validate.py passes the replay's)


@dataclass
class ConfigReplay:
    """What one configuration's replay measured (summary.py turns it into rows)."""

    cfg: StateConfig
    period: int | None  # the reset period the replay applied (None: none)
    period_reason: str
    states: dict[str, dict]  # state -> StateStats.collect(): per-step series and per-unit sums (stats.py)
    update: dict  # UpdateStats.collect(): update fidelity per step and per unit
    models: dict[str, dict] = field(default_factory=dict)  # state -> ModelStats.collect() (staleness.py)
    codec: dict[str, list] = field(default_factory=dict)  # state -> [path, why the reference ran or None] (codec.py)


@dataclass
class ReplayPart:
    """What one rank measured (merge.py puts the parts together): its unit range of the
    layout, and the collected statistics of its configurations (host arrays only)."""

    units: tuple[int, int]
    configs: list[ConfigReplay]
    nonfinite_units: np.ndarray | None  # None (and gradients None): a rank that replayed nothing
    gradients: dict | None
    wall_s: float
    cpu_s: float
    threads: int
    timings_s: dict[str, float]
    timings_synchronized: bool
    compile_s: dict[str, float] = field(default_factory=dict)  # of timings_s: kernel compilation (Timer.compiled)
    load_s: dict[str, float] = field(default_factory=dict)  # of timings_s: loading compiled kernels (Timer.loaded)
    setup_s: dict[str, float] = field(default_factory=dict)  # of timings_s: first calls' one-time work (Timer.setup)
    left_out_s: dict[str, float] = field(default_factory=dict)  # of wall_s: compile, load, setup (StepClock)
    final_states: dict | None = None  # keep_states: {config: {state: [per-tensor piece]}}
    config_threads: int = 1  # configurations stepped at once (config_threads_for)


@dataclass
class Replay:
    """What `replay` returns: the statistics of every configuration against the fp32
    shadow, and how the replay ran (host-side; the tensors stay where stats.py says)."""

    trace: Trace
    recursion: Recursion
    layout: Layout
    n_steps: int
    device: str
    wall_s: float  # wall time of the step loop (the slowest rank's under torchrun)
    cpu_s: float  # CPU time over the step loop (summed over torchrun's ranks)
    threads: int  # CPU threads during the loop: torch's intra-op count, or the kernels' (fused_step.torch_aside)
    timings_s: dict[str, float]  # wall seconds per phase: gather, shadow, one per configuration (slowest rank)
    timings_synchronized: bool  # whether each phase's time is exact (runtime.Timer.exact)
    compile_s: dict[str, float]  # of timings_s: seconds compiling kernels (a first use; the slowest rank's)
    load_s: dict[str, float]  # of timings_s: seconds loading them from the disk cache (once per process)
    nonfinite_units: np.ndarray  # NaN/Inf gradient elements per unit block, summed over steps
    configs: list[ConfigReplay]
    gradients: dict = field(default_factory=dict)  # GradientStats.collect(): the Gaussian model's assumptions
    final_states: dict | None = None  # keep_states: {config: {state: [per-tensor stored values]}}
    config_threads: int = 1  # configurations stepped in parallel (config_threads_for; the most of any rank)
    setup_s: dict[str, float] = field(default_factory=dict)  # of timings_s: first calls' one-time work (Timer.setup)
    left_out_s: dict[str, float] = field(default_factory=dict)  # of the loop: compile, load, setup (StepClock; the
    net_wall_s: float | None = None  # slowest rank's) and wall_s / cpu_s less them (the slowest rank's net wall,
    net_cpu_s: float | None = None  # every rank's net CPU seconds)

    @property
    def nonfinite_grads(self) -> int:
        return int(self.nonfinite_units.sum())


def reset_schedule(reset, cfg: StateConfig, rec: Recursion) -> tuple[int | None, str]:
    """The reset period a configuration's replay applies, and why."""
    policy = ResetPolicy.parse(reset)
    if not policy.auto:
        return policy.period, "none" if policy.period is None else f"every {policy.period} steps (--reset)"
    state = rec.slowest_state  # the state the optimizers reset on: AdamW's v, the momentum otherwise
    period, basis = auto_period(cfg.spec(state), rec.betas[state])  # the optimizers' own reset="auto"
    why = f"auto ({basis}) for {cfg.spec(state)} at beta={rec.betas[state]}" + ("" if period else ": no reset")
    return period, why


MODEL_POINTS = 250  # steps at which the staleness model is evaluated (every step up to 2 x this)
MODEL_ELEMENT_STEPS = 1 << 25  # at most this many element evaluations of the model per state (large layouts)
MODEL_MIN_POINTS = 16  # but at least this many steps


def model_points(n: int) -> int:
    """Steps at which the staleness model is evaluated for a layout of n elements:
    min(MODEL_POINTS, max(MODEL_MIN_POINTS, MODEL_ELEMENT_STEPS // n)); 250 up to
    134,217 elements (the demo's 24,320: 250), 32 at 2**20."""
    return min(MODEL_POINTS, max(MODEL_MIN_POINTS, MODEL_ELEMENT_STEPS // max(1, n)))

SMALL_LAYOUT = 1 << 20  # elements: below it, one CPU thread is faster (runtime.torch_threads)


def replay(trace: Trace, opts: ReplayOptions, progress: Callable[[int, int], None] | None = None) -> Replay:
    """Run the replay; `progress(done, total)` after each step. With `opts.split` (torchrun,
    distributed.py) this rank replays its share, and every rank returns the same merged
    Replay (merge.py)."""
    if not opts.configs:
        raise QstateError("no configurations to replay")
    device = resolve_device(opts.device)
    rec = recursion_for(trace.optimizer, trace.hparams)
    n_steps = min(trace.n_steps, opts.steps_limit or trace.n_steps)
    unit = layout_unit(opts.configs, opts.unit)
    split, part, mine, reduce_absmax = opts.split, None, runs_of(opts), None
    if split is not None and split.mode == "elements":
        part, reduce_absmax = (split.rank, split.size), split.max_
    elif split is not None:
        mine = mine[split.rank::split.size]
    layout = Layout(trace, unit, device, part)
    small = device.type == "cpu" and trace.recorded_elements < SMALL_LAYOUT
    workers = config_threads_for(opts, device, len(mine))
    cores = torch.get_num_threads() if small and workers == 1 and split is None else 1
    with torch_threads(1 if small else None), kernel_team(cores):  # small ops: torch on one thread (runtime.py)
        if mine:
            here = _replay(trace, opts, mine, rec, layout, n_steps, reduce_absmax, progress, workers)
        else:
            here = ReplayPart(layout.units, [], None, None, 0.0, 0.0, torch.get_num_threads(), {}, True)
    parts = [here] if split is None else split.all_gather(here)
    whole = layout if layout.whole else Layout(trace, unit, device, upload=False)
    return _assemble(trace, opts, rec, whole, n_steps, str(device), parts)


def runs_of(opts: ReplayOptions) -> list[tuple]:
    """(configuration, its reset) per configuration replayed: `opts.reset` for each, or
    `opts.resets`, one per configuration, where a replay holds the same configuration under
    several periods (validate.py replays a reset advice's candidates together: one gradient
    gather and one fp32 shadow for all of them)."""
    resets = [opts.reset] * len(opts.configs) if opts.resets is None else list(opts.resets)
    if len(resets) != len(opts.configs):
        raise QstateError(f"{len(resets)} resets for {len(opts.configs)} configurations")
    return list(zip(opts.configs, resets))


def config_threads_for(opts: ReplayOptions, device: torch.device, n_configs: int) -> int:
    """How many configurations step at once (runtime.Workers): opts.config_threads, at most
    one per configuration, on CPU (CUDA queues every configuration's work from one thread).
    The configurations of a step share only what they read (the gradients, the shadow), so
    the records are the same, bit for bit, with any count. 1 by default: on the 2-vCPU
    machine this was measured on (one core's vector units shared) 2 threads gave 1.04-1.19x
    the wall speed for 1.3x the CPU seconds (docs/diagnose.md, "Configurations in parallel")."""
    if opts.config_threads < 1:
        raise QstateError(f"config_threads {opts.config_threads}: use 1 or more")
    return min(int(opts.config_threads), max(1, n_configs)) if device.type == "cpu" else 1


def layout_unit(configs, unit: int | None = None) -> int:
    """The layout's unit: the largest block (quantization or dither) of any state, or `unit`
    where given (a multiple of each). The per-unit sums of the statistics add up in these
    blocks, so a configuration's records carry its layout's unit in their last bits (fp32
    sums; the dimension statistic's chunks do not depend on it: stats.dimension_ms)."""
    blocks = [spec.dither_block for cfg in configs for spec in (cfg.m, cfg.v) if spec.fmt.kind != "identity"]
    unit = max(blocks, default=128) if unit is None else int(unit)
    if any(unit % b for b in blocks):
        raise QstateError(f"block sizes {sorted(set(blocks))} do not all divide {unit}: the replay needs "
                          f"power-of-two block sizes (32..2048)")
    return unit


def _replay(trace: Trace, opts: ReplayOptions, mine: list, rec: Recursion, layout: Layout, n_steps: int,
            reduce_absmax, progress, workers: int) -> ReplayPart:
    device = layout.device
    sign = -1.0 if rec.hparams.get("maximize") else 1.0
    if sign < 0:
        rec.notes.append("maximize: gradients negated, as the optimizer does")
    gaps = Gaps.of(trace, layout, n_steps)  # rows without a gradient: the reference rule skips them (gaps.py)
    rule = replay_rule(rec, opts.backend, device) if gaps is None else rec.step
    configs, shadows = _setup(trace, opts, mine, rec, layout, n_steps, reduce_absmax, rule != rec.step)
    for c in configs if opts.fused_step and gaps is None else ():
        c.fused = fused_step.fused_step_for(c, rule, layout)
    model_every = max(1, n_steps // model_points(layout.total_valid))  # the model costs ~ one encode + decode
    timer = Timer(device, sync=opts.profile)
    # the padding's flat positions: an index_fill_ of these costs ~7 us a state-step on the demo
    # against ~37 us for masked_fill_ with the whole layout's mask (1 thread)
    padding = (~layout.valid).nonzero().squeeze(1) if layout.valid is not None else None
    nonfinite = torch.zeros(layout.n_units, dtype=torch.float64, device=device)
    fused_cpu = check_backend(opts.backend) != "reference" and cpu_unavailable(device) is None
    grad_stats = GradientStats(layout, n_steps, fused=fused_cpu, gaps=gaps)
    clock = StepClock()
    t_start, cpu_start = time.perf_counter(), time.process_time()
    with Workers(workers) as pool, fused_step.torch_aside(configs, device):
        _loop(trace, configs, shadows, rec, layout, n_steps, timer, pool, grad_stats, nonfinite, padding, sign,
              model_every, rule, progress, gaps, clock)
        team = team_parts(layout.n) if any(c.fused is not None for c in configs) else 1  # the fused step's (after
        threads = max(kernel_threads(), team)  # the loop: off if its launch failed); or torch's, or the kernels'
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
    return ReplayPart(
        units=layout.units, wall_s=wall, cpu_s=cpu, threads=threads, timings_s=timer.totals,
        timings_synchronized=timer.exact, compile_s=timer.compiled, load_s=timer.loaded, setup_s=timer.setup,
        left_out_s={"compile": clock.compiled_s, "load": clock.loaded_s, "setup": clock.setup_s},
        nonfinite_units=nonfinite.cpu().numpy(),
        configs=[ConfigReplay(c.cfg, c.period, c.period_reason, {s: c.stats[s].collect() for s in rec.states},
                              c.update.collect(), {s: m.collect() for s, m in c.models.items()}, c.codec)
                 for c in configs],
        gradients=grad_stats.collect(),
        final_states={str(c.cfg): {s: _split(layout, c.x_hat[s]) for s in rec.states} for c in configs}
        if opts.keep_states else None, config_threads=workers)


def _loop(trace, configs, shadows, rec, layout, n_steps, timer, pool, grad_stats, nonfinite, padding, sign,
          model_every, rule, progress, gaps=None, clock=None) -> None:
    """The step loop (module docstring): per step the gradients, the shadows, then the
    configurations, in parallel on pool's threads (they share only what they read); each
    step timed whole by `clock` (runtime.StepClock) where given."""
    unit, cpu = layout.unit, layout.device.type == "cpu"
    models = any(c.models for c in configs)

    def one(c, g, i):
        with timer(str(c.cfg)):
            step_config(c, shadows[c.shadow], rec, g, i, trace.step_start + i, padding, layout,
                         bool(c.models) and i % model_every == 0, rule, gaps)  # no models: no step to split

    clock = clock or StepClock()
    for i in range(n_steps):
        with clock():
            with timer("gather"):
                g = layout.gradients(i)
                # a finite sum: every element finite (an inf or NaN makes the sum one), so nothing to
                # count or zero (~10 us against ~160 for the three ops on the demo; CUDA: no host sync)
                if not (cpu and math.isfinite(g.sum().item())):
                    bad = ~torch.isfinite(g)
                    nonfinite += unit_sums(bad, unit)
                    g.masked_fill_(bad, 0.0)  # the optimizers' policy: count, then treat as 0
                if sign < 0:
                    g.neg_()
                gone = gaps.missing(i) if gaps is not None else None
                if gone is not None:  # no gradient there: 0 (as recorded), left out of the checks (GradientStats)
                    g.index_fill_(0, gone, 0.0)
                grad_stats.observe(i, g)
            with timer("shadow"):
                for sh in shadows.values():
                    step_shadow(sh, rec, g, layout, rule, gaps, i)
                    if models and i % model_every == 0:
                        model_inputs(rec, sh)
            pool.each(partial(one, g=g, i=i), step_order(configs, i))
        if progress is not None:
            progress(i + 1, n_steps)


def step_order(configs: list, i: int) -> list:
    """The configurations in the order step i steps them: from the (i mod k)-th of the k,
    round (module docstring)."""
    k = i % len(configs) if configs else 0
    return configs[k:] + configs[:k]


def _slowest(per_rank: list[dict], start: dict | None = None) -> dict:
    """Each key's largest value over the ranks' dicts (a phase takes as long as its slowest
    rank), after the keys of `start` in their order."""
    out = dict(start or {})
    for d in per_rank:
        for k, v in d.items():
            out[k] = max(v, out.get(k, 0.0))
    return out


def _assemble(trace: Trace, opts: ReplayOptions, rec: Recursion, layout: Layout, n_steps: int, device: str,
              parts: list[ReplayPart]) -> Replay:
    """The parts (in rank order = layout order) as one Replay of the whole layout (merge.py)."""
    ran, seen = [], set()
    for p in parts:  # gradients: one part per distinct unit range (the configuration split repeats them)
        if p.gradients is not None and p.units not in seen:
            seen.add(p.units)
            ran.append(p)
    configs = []
    for cfg, reset in runs_of(opts):
        period = reset_schedule(reset, cfg, rec)[0]
        held = [c for p in parts for c in p.configs if c.cfg == cfg and c.period == period]
        st = {s: merge.states([c.states[s] for c in held]) for s in rec.states}
        for s in st.values():
            s["dim_ms"] = dimension_ms(s, layout)
        configs.append(ConfigReplay(cfg, held[0].period, held[0].period_reason, st,
                                    fidelity(merge.update([c.update for c in held])),
                                    {s: merge.models([c.models[s] for c in held]) for s in held[0].models},
                                    held[0].codec))
    order = {k: 0.0 for k in ["gather", "shadow"] + [str(c) for c in opts.configs]}  # the phases' order
    timings = _slowest([p.timings_s for p in parts], order)
    compiled, loaded = _slowest([p.compile_s for p in parts]), _slowest([p.load_s for p in parts])
    setup = _slowest([p.setup_s for p in parts])
    net = max(parts, key=lambda p: p.wall_s - sum(p.left_out_s.values()))  # the slowest rank, net of its one-time
    final = None
    if opts.keep_states:
        final = {str(c): {s: merge.tensors([p.final_states[str(c)][s] for p in parts if str(c) in p.final_states])
                          for s in rec.states} for c in opts.configs}
    return Replay(
        trace=trace, recursion=rec, layout=layout, n_steps=n_steps, device=device,
        wall_s=max(p.wall_s for p in parts), cpu_s=sum(p.cpu_s for p in parts), threads=parts[0].threads,
        timings_s=timings, timings_synchronized=all(p.timings_synchronized for p in parts), compile_s=compiled,
        load_s=loaded,
        nonfinite_units=np.concatenate([p.nonfinite_units for p in ran]), configs=configs,
        gradients=merge.gradients([p.gradients for p in ran]), final_states=final,
        config_threads=max(p.config_threads for p in parts), setup_s=setup, left_out_s=dict(net.left_out_s),
        net_wall_s=max(0.0, net.wall_s - sum(net.left_out_s.values())),
        net_cpu_s=sum(max(0.0, p.cpu_s - sum(p.left_out_s.values())) for p in parts))


def _setup(trace: Trace, opts: ReplayOptions, mine: list, rec: Recursion, layout: Layout, n_steps: int,
           reduce_absmax, fused_rule: bool = False):
    """One ConfigState per configuration, one Shadow per distinct reset period."""
    def zeros():
        return torch.zeros(layout.n, dtype=torch.float32, device=layout.device)

    snap_every = max(1, n_steps // max(1, opts.snapshots))
    configs, shadows = [], {}
    for cfg, reset in mine:
        period, why = reset_schedule(reset, cfg, rec)
        key = period if opts.reference_reset else None
        shadows.setdefault(key, Shadow(key, {s: zeros() for s in rec.states}))
        qs, stats, clamp, paths = {}, {}, {}, {}
        for s in rec.states:
            spec = cfg.spec(s)
            stream = stream_for(layout, spec, int(trace.seed), STATE_IDS[s])
            qs[s], path, why_ref = replay_state(spec, layout, stream, reduce_absmax, opts.backend)
            paths[s] = [path, why_ref]
            stats[s] = StateStats(layout, spec, n_steps, snap_every, fused=path == CPU_PATH)
            # as the optimizer (base.py): a v read back below 0 (dithered, or rounded to the
            # negative side of a signed grid without a zero code) is clamped to 0
            clamp[s] = s == "v" and not spec.sqrt and (spec.rounding == "bred" or spec.fmt.signed)
        models = {s: ModelStats(layout, cfg.spec(s), n_steps, reduce_absmax, fused=paths[s][0] == CPU_PATH)
                  for s in rec.states if cfg.spec(s).fmt.kind != "identity"} if opts.models else {}
        configs.append(ConfigState(cfg, period, why, qs, {s: zeros() for s in rec.states}, stats,
                                     UpdateStats(layout, n_steps, fused_rule), clamp, models, key, paths,
                                     counted=opts.state_stats))
    return configs, shadows


def _split(layout: Layout, x: torch.Tensor) -> list[torch.Tensor]:
    """Per tensor, the recorded elements of it that the layout (part) holds."""
    out = [x[:0].cpu()] * layout.n_tensors
    for i, _, count, at in layout.pieces:
        out[i] = x[at: at + count].cpu()
    return out

