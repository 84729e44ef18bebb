"""`qstate bench train`: what each state configuration does to a real (small) training run.

Every run trains the same built-in byte-level LM (models/tiny_lm.py) from the same
initialization, on the same batches in the same order, with the same learning-rate
schedule; only the optimizer-state storage differs. Seed s fixes the model init, the
data order and the optimizer's random streams (SR / BReD), so for one seed the fp32 run
is the exact reference of every other run and the loss gap is due to the states alone.

Per run: training loss every `log_every` steps, validation loss every `eval_every`
steps and at the last step (mean over fixed validation batches, nats per byte),
steps per second (training steps only; CUDA-synchronised on CUDA), optimizer-state
bytes (codes + scales), resets performed, non-finite gradient elements.

Divergence: a run diverges at the first step whose training or validation loss is
not finite or exceeds `diverge_factor` x the run's first training loss (at init the
loss is ~ln 256 = 5.55 nats; a loss twice that is a blow-up, not noise). The run is
stopped there and reported (`diverged`, `diverged_at_step`, `reason`); its final loss
is null and the other runs go on. A run that raises (e.g. out of memory) is marked
`status = "failed"` with the reason, and the study goes on.

Learning rate: linear warm-up over `warmup_frac` of the steps, then cosine decay to
`min_lr_frac` x lr at the last step (`lr_at`), set on every param group before each step.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import QstateError
from ..models import tiny_lm
from ..optim import optimizer_info
from ..optim.registry import names_text
from ..options import MAX_SEED, MAX_THREADS, Options, lower, many, option, seed_option
from ..progress import QUIET, Progress
from ..results import Result
from ..runtime import Timer, free_memory, resolve_device, torch_threads
from .runspec import RunSpec, resolve_reset

DEFAULT_CONFIGS = ("fp32", "bf16", "nearest-4bit", "sr-4bit", "bred-4bit", "bnb-8bit", "torchao-4bit",
                   "nearest-4bit@reset=auto")




def threads_option(value) -> int | None:
    """--threads N; 0 means torch's default (None)."""
    try:
        n = int(str(value).strip())
    except ValueError:
        raise QstateError(f"--threads {value!r}: give a whole number (0: torch's default)") from None
    if not 0 <= n <= MAX_THREADS:
        raise QstateError(f"--threads {value}: use 0 (torch's default) to {MAX_THREADS}")
    return None if n == 0 else n


@dataclass(frozen=True)
class TrainSettings(Options):
    """One study's settings: `qstate bench train`'s options and a suite point's parameters
    (options.py); the defaults are the ~5-minute study on 2 CPU cores."""

    COMMAND = "bench train"

    config: list[str] = many("Run CONFIG[@reset=none|N|auto][@lr=X]; repeat for several. "
                             f"Default: {' '.join(DEFAULT_CONFIGS)}. fp32 is always run: gaps are measured against it.",
                             "--config", "-c")
    optimizer: str = option("adamw", f"{names_text(' | ').replace(', ', ' | ')}.", "--optimizer", "-o", parse=lower)
    steps: int = option(500, "Training steps per run.", "--steps", "-n")
    model: str = option("tiny-lm", "tiny-lm (0.14 M params) | small-lm (0.88 M).", "--model", "-m")
    seeds: int = option(1, "Seeds per run (init, data order, random streams).", "--seeds", "-k")
    seed: int = seed_option("First seed; seeds are seed .. seed + seeds - 1.")
    reset: str = option("none", "Reset policy for runs that name none: none | N | auto.")
    lr: float | None = option(None, "Peak learning rate (default: the optimizer's, optim/registry.py).", type=float)
    batch_size: int = option(16, "Sequences per step.", "--batch-size", "-b")
    eval_every: int = option(25, "Steps between validation evaluations.")
    min_quant_numel: int = option(0, "Tensors smaller than this keep fp32 states (bitsandbytes: 4096).")
    device: str = option("auto", "auto | cpu | cuda[:N].")
    backend: str = option("auto", "Optimizer backend: auto | reference | triton | cpu (the numba path).")
    threads: int | None = option(1, "torch CPU threads per run (0: torch's default). One is fastest for these "
                                    "small models, and robust on a busy machine.", parse=threads_option, type=int)
    warmup_frac: float = option(0.05, "Linear learning-rate warm-up over this fraction of the steps.")
    min_lr_frac: float = option(0.1, "Cosine decay to this fraction of lr at the last step.")
    eval_batches: int = option(8, "Validation batches (fixed for the whole study).")
    eval_batch_size: int = option(32, "Sequences per validation batch.")
    log_every: int = option(1, "Steps between training-loss points of the series.")
    diverge_factor: float = option(2.0, "A run diverges when a loss exceeds this x its first training loss.")

    def check(self, here: bool = True) -> None:
        self.validate(here)
        parse_runs(self.config, self.reset)

    def validate(self, here: bool = True) -> "TrainSettings":
        optimizer_info(self.optimizer)  # QstateError for an unknown optimizer
        if self.model not in tiny_lm.SIZES:
            from ..quant.formats import suggest

            raise QstateError(f"unknown model {self.model!r}{suggest(self.model, tiny_lm.SIZES)}")
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "eval_batch_size", "log_every", "seeds"):
            if getattr(self, name) < 1:
                raise QstateError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.lr is not None and not 0 < self.lr < math.inf:
            raise QstateError(f"--lr {self.lr}: must be a positive finite number")
        for name, lo, hi in (("warmup_frac", 0.0, 1.0), ("min_lr_frac", 0.0, 1.0)):
            if not lo <= getattr(self, name) <= hi:  # NaN fails too
                raise QstateError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be from {lo:g} to {hi:g}")
        if not 1.0 < self.diverge_factor < math.inf:
            raise QstateError(f"--diverge-factor {self.diverge_factor}: must be a finite number above 1 (a loss this "
                              f"many times the first one is a divergence)")
        if self.min_quant_numel < 0:
            raise QstateError(f"--min-quant-numel {self.min_quant_numel}: must be >= 0")
        if self.threads is not None and self.threads < 1:
            raise QstateError(f"--threads {self.threads}: must be at least 1")
        if self.seed + self.seeds - 1 > MAX_SEED:
            raise QstateError(f"--seed {self.seed} with --seeds {self.seeds}: the last seed is past 2^63-1")
        resolve_device(self.device, here)  # a usage error when CUDA is asked for where there is none
        return self

    @property
    def base_lr(self) -> float:
        return self.lr if self.lr is not None else optimizer_info(self.optimizer).default_lr


def lr_at(step: int, base_lr: float, steps: int, warmup_frac: float = 0.05, min_lr_frac: float = 0.1) -> float:
    """Learning rate for step `step` (1-based): linear warm-up over ceil(warmup_frac * steps)
    steps, then cosine from base_lr down to min_lr_frac * base_lr at step `steps`."""
    warmup = max(1, math.ceil(warmup_frac * steps))
    if step <= warmup:
        return base_lr * step / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return base_lr * (min_lr_frac + (1.0 - min_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass
class RunResult:
    """One (run, seed): the record fields and the loss series."""

    record: dict
    series: list[dict] = field(default_factory=list)


def validation_batches(settings: TrainSettings, seq_len: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation batches every run is evaluated on (same as tiny_lm.evaluate)."""
    it = tiny_lm.batches("val", settings.eval_batch_size, seq_len, seed=1234)
    return [tuple(t.to(device) for t in next(it)) for _ in range(settings.eval_batches)]


@torch.no_grad()
def evaluate(model, val: list) -> float:
    """Mean validation loss (nats per byte) over the fixed batches."""
    model.eval()
    loss = sum(float(model.loss(x, y)) for x, y in val) / len(val)
    model.train()
    return loss


def make_optimizer(run: RunSpec, settings: TrainSettings, params, seed: int):
    """The qstate optimizer for `run`, with its reset policy resolved (see runspec.py)."""
    cls = optimizer_info(settings.optimizer).cls
    opt = cls(params, lr=run.lr or settings.base_lr, states=run.config, reset=None, seed=seed,
              min_quant_numel=settings.min_quant_numel, backend=settings.backend)
    group = opt.param_groups[0]
    state = cls.reset_state(group)
    period, basis = resolve_reset(run.config.spec(state), run.reset, cls.state_betas(group)[state])
    opt.reset_policy = opt.reset_policy.parse(period)
    return opt, period, basis


def train_run(run: RunSpec, settings: TrainSettings, seed: int, val=None,
              log: Callable[[str], None] | None = None) -> RunResult:
    """Train one run for one seed; never raises for a divergence (it is reported). `log`
    gets one line when the run ends."""
    with torch_threads(settings.threads):  # one by default: these ops are small (runtime.py)
        return _train_run(run, settings, seed, val, log)


def _train_run(run, settings, seed, val, log) -> RunResult:
    device = str(resolve_device(settings.device))
    model = tiny_lm.build(settings.model, seed).to(device)
    seq_len = model.cfg.seq_len
    val = val if val is not None else validation_batches(settings, seq_len, device)
    opt, period, basis = make_optimizer(run, settings, model.parameters(), seed)
    base_lr = run.lr or settings.base_lr
    data = tiny_lm.batches("train", settings.batch_size, seq_len, seed)
    timer = Timer(device, sync=True)  # seconds in training steps only
    series: list[dict] = []
    first_loss = best_val = last_val = None
    diverged_at, reason, step = None, None, 0
    for step in range(1, settings.steps + 1):
        x, y = (t.to(device) for t in next(data))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, base_lr, settings.steps, settings.warmup_frac, settings.min_lr_frac)
        with timer("step"):
            loss = model.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            train_loss = float(loss.detach())  # the host sync ends the timed segment on CUDA anyway
        first_loss = train_loss if first_loss is None else first_loss
        val_loss = None
        if step % settings.eval_every == 0 or step == settings.steps:
            val_loss = evaluate(model, val)
        reason = _divergence(train_loss, val_loss, first_loss, settings.diverge_factor)
        if val_loss is not None and reason is None:
            last_val = val_loss
            best_val = val_loss if best_val is None else min(best_val, val_loss)
        if step % settings.log_every == 0 or val_loss is not None or reason or step == settings.steps:
            series.append({"config": run.label, "seed": seed, "step": step, "train_loss": _finite(train_loss),
                           "val_loss": _finite(val_loss)})
        if reason:
            diverged_at = step
            break
    params = sum(p.numel() for p in model.parameters())
    state_bytes = opt.state_nbytes()
    # a first use compiles the CPU kernels (or loads them from the disk cache) inside the
    # first steps: seconds left out of steps/s and reported apart (runtime.Timer.compiled)
    compile_s = sum(timer.compiled.values()) + sum(timer.loaded.values())
    step_s = timer.seconds - compile_s
    record = {
        "config": run.label, "states": run.config.canonical(), "optimizer": settings.optimizer,
        "model": settings.model, "params": params, "seed": seed, "steps": step, "steps_requested": settings.steps,
        "lr": base_lr, "batch_size": settings.batch_size,
        "final_val_loss": None if diverged_at else last_val, "best_val_loss": best_val, "gap_to_fp32": None,
        "final_train_loss": _finite(train_loss) if step else None,
        "diverged": diverged_at is not None, "diverged_at_step": diverged_at,
        "steps_per_s": step / step_s if step_s > 0 else None, "compile_s": round(compile_s, 3),
        "state_bytes": state_bytes, "bytes_per_param": state_bytes / params,
        "reset": run.reset, "reset_period": period, "reset_basis": basis,
        "resets": (step - 1) // period if period else 0,
        "nonfinite_grads": opt.nonfinite_count(),
        "min_quant_numel": settings.min_quant_numel, "device": device,
        "path": opt.path_for(next(iter(model.parameters()))),
        "status": "ok", "reason": reason,
    }
    if log:
        end = f"diverged at step {diverged_at} ({reason})" if diverged_at else f"val loss {last_val:.4f}"
        compiling = f" ({compile_s:.1f} s compiling kernels left out)" if compile_s >= 0.05 else ""
        log(f"{run.label} seed {seed}: {step} steps, {end}, {record['steps_per_s'] or 0:.1f} steps/s{compiling}")
    return RunResult(record, series)


def _divergence(train_loss: float, val_loss: float | None, first_loss: float, factor: float) -> str | None:
    """Why this step counts as diverged (None: it does not)."""
    for what, value in (("training loss", train_loss), ("validation loss", val_loss)):
        if value is None:
            continue
        if not math.isfinite(value):
            return f"{what} is {value}"
        if value > factor * first_loss:
            return f"{what} {value:.4g} > {factor:g} x the first loss {first_loss:.4g}"
    return None


def _finite(value):
    return value if value is not None and math.isfinite(value) else None


def _failed(run: RunSpec, settings: TrainSettings, seed: int, exc: BaseException) -> dict:
    """The row of a run that raised: every column of an ok row, nulls where nothing was measured."""
    return {"config": run.label, "states": run.config.canonical(), "optimizer": settings.optimizer,
            "model": settings.model, "params": None, "seed": seed, "steps": 0, "steps_requested": settings.steps,
            "lr": run.lr or settings.base_lr, "batch_size": settings.batch_size,
            "final_val_loss": None, "best_val_loss": None, "gap_to_fp32": None, "final_train_loss": None,
            "diverged": False, "diverged_at_step": None, "steps_per_s": None, "compile_s": None, "state_bytes": None,
            "bytes_per_param": None, "reset": run.reset, "reset_period": None, "reset_basis": None, "resets": 0,
            "nonfinite_grads": None, "min_quant_numel": settings.min_quant_numel,
            "device": str(resolve_device(settings.device)), "path": None,
            "status": "failed", "reason": f"{type(exc).__name__}: {exc}".splitlines()[0]}


# ---- the study: every run x every seed ------------------------------------------------
BASELINE = "fp32"


def parse_runs(configs, default_reset: str = "none") -> list[RunSpec]:
    """RunSpecs for the configs asked (default: DEFAULT_CONFIGS), fp32 baseline first
    (added when absent: every gap is measured against it)."""
    texts = list(configs) if configs else list(DEFAULT_CONFIGS)
    runs = [RunSpec.parse(t, default_reset) for t in texts]
    labels = [r.label for r in runs]
    dupes = sorted({lab for lab in labels if labels.count(lab) > 1})
    if dupes:
        raise QstateError(f"run {dupes[0]!r} is asked for twice")
    base = [r for r in runs if _is_baseline(r)]
    if not base:
        base = [RunSpec.parse(BASELINE)]
    return base + [r for r in runs if not _is_baseline(r)]


def _is_baseline(run: RunSpec) -> bool:
    return run.label == BASELINE and run.lr is None and run.reset == "none"


def execute(settings: TrainSettings, progress: Progress | None = None, configs=None) -> Result:
    """Train every run (settings.config, or `configs`) for every seed (kind "train").

    Runs go seed by seed, fp32 first, so each finished row already has its gap to fp32;
    after each one `progress` gets the row and a snapshot (records, series, summary), so
    a caller that writes them keeps a consistent document through Ctrl-C."""
    progress = progress or QUIET
    settings = settings.validate()
    runs = parse_runs(settings.config if configs is None else configs, settings.reset)
    device = str(resolve_device(settings.device))
    meta = {"settings": settings.to_params(), "runs": [r.label for r in runs], "baseline": BASELINE,
            "seeds": list(range(settings.seed, settings.seed + settings.seeds)), "device": device,
            "lr_schedule": f"linear warm-up {settings.warmup_frac:g} of steps, cosine to "
                           f"{settings.min_lr_frac:g} x lr", "tokens_per_step": None}
    result = Result("train", meta=meta, extras={"series": [], "summary": []}, device=device,
                    env={"torch_threads": settings.threads or torch.get_num_threads()})  # what the runs used
    progress.begin(len(runs) * settings.seeds, result)
    val = None
    for seed in meta["seeds"]:
        base_loss = None
        for run in runs:
            progress.start(f"{run.label} seed {seed}", len(result.records))
            try:
                if val is None:
                    seq_len = tiny_lm.SIZES[settings.model].seq_len
                    val = validation_batches(settings, seq_len, device)
                    meta["tokens_per_step"] = settings.batch_size * seq_len
                run_result = train_run(run, settings, seed, val=val, log=progress.log)
            except QstateError:
                raise
            except (RuntimeError, ValueError, MemoryError) as exc:  # incl. out of memory (runtime.is_oom)
                free_memory(device)
                run_result = RunResult(_failed(run, settings, seed, exc))
                progress.log(f"{run.label} seed {seed}: failed ({run_result.record['reason']})")
            rec = run_result.record
            if _is_baseline(run):
                base_loss = rec["final_val_loss"]
            if base_loss is not None and rec["final_val_loss"] is not None:
                rec["gap_to_fp32"] = rec["final_val_loss"] - base_loss
            result.extras["series"].extend(run_result.series)
            result.records.append(rec)
            result.extras["summary"] = summarize(result.records)
            progress.snapshot(result)
    return result


def run_study(settings: TrainSettings, configs=None, progress: Progress | None = None) -> dict:
    """The study's results document (execute(...).document())."""
    return execute(settings, progress, configs).document()


def summarize(records: list[dict]) -> list[dict]:
    """One row per run over its seeds: losses, the gap to fp32 with its spread (std,
    min/max, and a 95% Student-t interval half-width when there are >= 2 seeds),
    divergences, speed and bytes."""
    from scipy import stats

    out = []
    for label in dict.fromkeys(r["config"] for r in records):
        rows = [r for r in records if r["config"] == label]
        gaps = [r["gap_to_fp32"] for r in rows if r["gap_to_fp32"] is not None]
        finals = [r["final_val_loss"] for r in rows if r["final_val_loss"] is not None]
        speeds = [r["steps_per_s"] for r in rows if r.get("steps_per_s")]
        diverged = [r for r in rows if r["diverged"]]
        n = len(gaps)
        std = statistics.stdev(gaps) if n >= 2 else None
        first = rows[0]
        out.append({
            "config": label, "optimizer": first["optimizer"], "model": first["model"], "seeds": len(rows),
            "final_val_loss_mean": statistics.fmean(finals) if finals else None,
            "best_val_loss_mean": _mean(r["best_val_loss"] for r in rows),
            "gap_to_fp32_mean": statistics.fmean(gaps) if gaps else None,
            "gap_to_fp32_std": std,
            "gap_to_fp32_min": min(gaps) if gaps else None,
            "gap_to_fp32_max": max(gaps) if gaps else None,
            "gap_to_fp32_ci95": float(stats.t.ppf(0.975, n - 1) * std / math.sqrt(n)) if std is not None else None,
            "diverged": len(diverged),
            "diverged_at_step_min": min((r["diverged_at_step"] for r in diverged), default=None),
            "failed": sum(r["status"] == "failed" for r in rows),
            "steps_per_s_mean": statistics.fmean(speeds) if speeds else None,
            "state_bytes": first.get("state_bytes"), "bytes_per_param": first.get("bytes_per_param"),
            "reset": first["reset"], "reset_period": first.get("reset_period"),
        })
    return out


def _mean(values):
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None
