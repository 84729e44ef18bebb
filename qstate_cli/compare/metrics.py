"""How `qstate compare` names and matches rows: the metrics and identity of each kind are
in the kinds table (qstate_cli/kinds.py, with the tolerances and why); this module turns
a row into its identity and a readable name."""
from __future__ import annotations

from ..kinds import KINDS, Metric

__all__ = ["COMPARED", "Metric", "STATUSES", "compared_kinds", "identity", "metrics", "row_name"]

# A verdict record's statuses, worst first: the order of the verdict table and its counts.
STATUSES = ("regressed", "failed", "unjudged", "missing", "new", "noisy", "insignificant", "improved", "same")
# The statuses of a metric measured and compared on both sides (noisy: measured, not judged).
# A kind with none of them and no regression compared nothing, and fails the gate.
COMPARED = ("regressed", "improved", "same", "insignificant", "noisy")


def compared_kinds() -> tuple[str, ...]:
    """Kinds with something to compare."""
    return tuple(name for name, kind in KINDS.items() if kind.metrics)


def metrics(kind: str) -> tuple[Metric, ...]:
    return KINDS[kind].metrics


def identity(kind: str, row: dict) -> tuple:
    return tuple(str(row.get(k)) for k in KINDS[kind].identity)


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
