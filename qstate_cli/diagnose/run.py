"""`qstate diagnose` as a library: choose configurations, replay, build the result document.

Configurations (`select_configs`):
- `--config NAME` (repeatable): exactly these (presets or explicit configurations);
- `--bits B` / `--rounding R` (repeatable): the linear presets `{R}-{B}bit` for every B and R
  (R defaults to nearest, stochastic, bred; B to 4), added to any --config;
- neither: DEFAULT_CONFIGS, what people run or consider today;
- `--block-size N` then sets the block size of every block-scaled state.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from .. import theory
from ..errors import QstateError
from ..quant.config import ROUNDINGS, StateConfig, config_of, parse_config, parse_spec
from ..results import document, environment
from ..trace import load_trace
from ..trace.schema import Trace
from .replay import ReplayOptions, replay
from .summary import build

DEFAULT_CONFIGS = ("nearest-4bit", "sr-4bit", "bred-4bit", "bnb-8bit", "torchao-4bit", "bf16", "bf16-sr")
LINEAR_PRESET = {"nearest": "nearest", "stochastic": "sr", "bred": "bred"}
THEORY_FORMATS = ("bf16", "e4m3", "e2m2")


def select_configs(configs=(), bits=(), rounding=(), block_size: int | None = None) -> list[StateConfig]:
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


def diagnose(trace: Trace | str | Path, configs: list[StateConfig], reset="none", steps_limit: int | None = None,
             device: str = "auto", progress=None, keep_states: bool = False,
             profile_phases: bool = False) -> tuple[dict, dict]:
    """Replay `trace` through `configs`; returns (result document, raw replay results).
    `trace` may be a Trace, a path, or "demo" (the cached demo trace, made on first use,
    when no file of that name exists). `profile_phases` synchronizes CUDA around each phase
    so the per-phase times are exact."""
    if not isinstance(trace, Trace):
        trace = load_trace(resolve_trace(trace))
    if steps_limit is not None and steps_limit < 1:
        raise QstateError(f"steps limit must be >= 1, got {steps_limit}")
    opts = ReplayOptions(list(configs), reset=reset, steps_limit=steps_limit, device=device, keep_states=keep_states,
                         profile=profile_phases)
    t0 = time.perf_counter()
    raw = replay(trace, opts, progress)
    rows = build(raw)
    meta = {
        "trace": trace.source, "optimizer": trace.optimizer, "hparams": trace.hparams, "seed": trace.seed,
        "step_start": trace.step_start, "steps": raw["n_steps"], "trace_steps": trace.n_steps,
        "tensors": len(trace.tensors), "recorded_elements": trace.recorded_elements,
        "total_elements": trace.total_elements, "grad_dtype": trace.grad_dtype,
        "configs": [str(c) for c in configs], "canonical": {str(c): c.canonical() for c in configs},
        "reset": str(reset), "reset_applied": {str(c["cfg"]): [c["period"], c["period_reason"]] for c in raw["configs"]},
        "nonfinite_grads": int(raw["nonfinite_units"].sum()), "notes": list(raw["recursion"].notes),
        "quantized_everything": "every recorded tensor is quantized (the optimizers keep tensors under "
                                "min_quant_numel=4096 in fp32)",
        "profile": profile(raw, time.perf_counter() - t0),
    }
    doc = document("diagnose", rows.pop("records"), meta, environment(raw["device"]))
    doc.update(rows)
    return doc, raw


def resolve_trace(trace) -> Path:
    """A trace path; "demo" (with no such file here) names the cached demo trace."""
    if str(trace) == "demo" and not Path("demo").exists():
        from ..trace.demo import cached_demo

        return cached_demo()
    return Path(trace)


def profile(raw: dict, total_s: float) -> dict:
    """Replay throughput: element-steps (recorded elements x steps) per second of wall time,
    and per CPU-second (what the replay gets on a machine that other work also uses)."""
    n_cfg = len(raw["configs"])
    element_steps = raw["layout"].n_valid * raw["n_steps"]
    wall = raw["wall_s"]
    per_cfg = {k: v for k, v in raw["timings_s"].items() if k not in ("gather", "shadow")}
    cpu = raw["cpu_s"]
    return {
        "device": raw["device"], "threads": raw["threads"], "element_steps": element_steps, "configs": n_cfg,
        "replay_s": round(wall, 3), "replay_cpu_s": round(cpu, 3), "total_s": round(total_s, 3),
        "element_steps_per_s_per_config": round(element_steps * n_cfg / wall) if wall > 0 else None,
        "element_steps_per_cpu_s_per_config": round(element_steps * n_cfg / cpu) if cpu > 0 else None,
        "phases_s": {k: round(v, 3) for k, v in raw["timings_s"].items()},
        "phases_synchronized": raw["timings_synchronized"],
        "config_element_steps_per_s": {k: round(element_steps / v) for k, v in per_cfg.items() if v > 0},
        "layout": {"unit": raw["layout"].unit, "padded_elements": raw["layout"].n},
    }


def theory_document(formats=THEORY_FORMATS, beta2: float = 0.999, roundings=("nearest", "stochastic"),
                    buildup_steps=(10, 100, 1000)) -> dict:
    """`qstate diagnose --theory`: predicted stall probabilities and reset periods, no trace."""
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
    rows = theory.theory_rows(specs, beta2)
    for row, spec in zip(rows, specs):
        for t in buildup_steps:
            row[f"p_stall_t{t}"] = round(float(theory.stall_probability(spec, beta2, float(
                theory.buildup_level(t, beta2)))), 4)
    return document("diagnose", [], {"mode": "theory", "beta2": beta2, "formats": list(formats or THEORY_FORMATS),
                                     "buildup": theory.BUILDUP}, environment("cpu")) | {"theory": rows}
