"""What `qstate compare` compares, per result kind: the identity of a row and its metrics.

Timing (kernels `time_ms`): a row regresses when median(new) / median(baseline) exceeds
`threshold` AND a two-sided Mann-Whitney U test on the kept samples (`samples_ms`) gives
p < alpha; beyond the threshold without that evidence it is *insignificant*. The mirror
(ratio below 1/threshold, p < alpha) is *improved*.

Deterministic quality metrics (a seeded trace replays bit for bit on one build; builds
and thread counts may differ in the last bits) are compared with a tolerance per metric,
tol = max(abs_tol, rel_tol * |baseline|), in the metric's direction: `worse` beyond tol
is regressed, `better` beyond tol is improved, else same.

    metric            better   abs_tol  rel_tol  why
    drift_max_abs     lower    1e-3     10%      more drift is worse (bias building up)
    rel_rms_error     lower    1e-4      5%      state error relative to the fp32 shadow
    stall_rate        lower    0.01      5%      stale states adapt slower
    update_cosine     higher   2e-3      0       update direction vs fp32 states
    update_rel_error  lower    1e-3      5%
    bytes_per_param   lower    1e-9      0       exact accounting: any growth is a regression
    final_val_loss    lower    0.02    0.5%      same seed, same data order
    diverged          False    -         -       False -> True is a regression
"""
from __future__ import annotations

from dataclasses import dataclass


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


METRICS: dict[str, tuple[Metric, ...]] = {
    "kernels": (Metric("time_ms", "ms", "lower", timing=True),),
    "memory": (Metric("bytes_per_param", "bytes/param", "lower", 1e-9),),
    "diagnose": (Metric("drift_max_abs", "fraction of RMS", "lower", 1e-3, 0.10),
                 Metric("rel_rms_error", "fraction of RMS", "lower", 1e-4, 0.05),
                 Metric("stall_rate", "fraction", "lower", 0.01, 0.05),
                 Metric("update_cosine", "cosine", "higher", 2e-3),
                 Metric("update_rel_error", "fraction", "lower", 1e-3, 0.05)),
    "train": (Metric("final_val_loss", "nats", "lower", 0.02, 0.005),
              Metric("diverged", "bool", "lower")),
}

# Fields that identify a row (the same thing measured in both files).
IDENTITY: dict[str, tuple[str, ...]] = {
    "kernels": ("name", "optimizer", "config", "numel", "n_tensors", "model", "param_dtype", "grad_dtype", "device",
                "path"),
    "memory": ("name", "optimizer", "config", "model"),
    "diagnose": ("config", "state", "numel", "steps"),
    "train": ("config", "optimizer", "model", "seed", "steps"),
}


def identity(kind: str, row: dict) -> tuple:
    return tuple(str(row.get(k)) for k in IDENTITY[kind])


def row_name(kind: str, row: dict) -> str:
    """A short, stable, readable name for a row (also the benchmark series name)."""
    if kind == "kernels":
        where = f" {row['model']}" if row.get("model") else f" n={row.get('numel')}"
        return f"{row.get('name')} [{row.get('path')}] {row.get('param_dtype')}{where} @{row.get('device')}"
    if kind == "memory":
        return f"{row.get('name')} {row.get('model')}"
    if kind == "diagnose":
        return f"{row.get('config')} {row.get('state')}"
    if kind == "train":
        return f"{row.get('config')} seed={row.get('seed')}"
    return str(identity(kind, row))
