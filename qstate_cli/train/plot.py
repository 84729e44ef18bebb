"""Loss curves of a `bench train` result (matplotlib's Figure API on the Agg canvas; no
pyplot state, so it is safe in tests, threads and servers).

Three panels, one line per run (mean over seeds, a band from the lowest to the highest
seed when there are several):
  1. training loss, smoothed by an EMA over ~2% of the steps (raw values are noisy at
     16 sequences per step);
  2. validation loss at each evaluation;
  3. validation-loss gap to the fp32 run of the same seed (what the states cost).
A run that diverged ends with an x at the step where it was stopped, drawn at the top
edge when its loss is off the chart (the y range is clipped to the useful part).
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from .. import mplconfig
from .study import BASELINE


def _by_run(series: list[dict], key: str) -> dict[str, dict[int, dict[int, float]]]:
    """{run: {seed: {step: value}}} for rows with a non-null `key`."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for row in series:
        if row.get(key) is not None:
            out[row["config"]][row["seed"]][row["step"]] = row[key]
    return out


def _smooth(values: list[float], span: int) -> list[float]:
    """Exponential moving average with the span's usual alpha = 2 / (span + 1)."""
    alpha, acc, out = 2.0 / (span + 1), None, []
    for v in values:
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def _mean_band(per_seed: dict[int, dict[int, float]]):
    """Steps present in every seed; mean, min, max over seeds at each."""
    common = sorted(set.intersection(*(set(s) for s in per_seed.values()))) if per_seed else []
    vals = [[per_seed[s][t] for s in per_seed] for t in common]
    return common, [sum(v) / len(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def loss_figure(doc: dict):
    """A matplotlib Figure of the result document's loss curves."""
    mplconfig.prepare()  # a read-only HOME: matplotlib's folder in qstate's cache, quietly
    from matplotlib.figure import Figure

    series, records = doc.get("series", []), doc.get("records", [])
    runs = list(dict.fromkeys(r["config"] for r in records))
    meta = doc.get("meta", {})
    steps_total = (meta.get("settings") or {}).get("steps") or max((r["step"] for r in series), default=1)
    span = max(1, steps_total // 50)
    train, val = _by_run(series, "train_loss"), _by_run(series, "val_loss")
    gaps = _gaps(val)
    fig = Figure(figsize=(15, 5.4), layout="constrained")
    axes = fig.subplots(1, 3)
    colors = {run: f"C{i % 10}" for i, run in enumerate(runs)}
    finite_all = [v for run in train.values() for s in run.values() for v in s.values()]
    first = [r["train_loss"] for r in series if r["step"] == 1 and r.get("train_loss") is not None]
    top = 1.05 * (max(first) if first else max(finite_all, default=1.0))
    for run in runs:
        c = colors[run]
        smoothed = {seed: dict(zip(sorted(pts), _smooth([pts[t] for t in sorted(pts)], span)))
                    for seed, pts in train.get(run, {}).items()}
        stopped = sorted({r["diverged_at_step"] for r in records if r["config"] == run and r.get("diverged")})
        label = run + (f" (diverged at step {', '.join(map(str, stopped))})" if stopped else "")
        for ax, data in ((axes[0], smoothed), (axes[1], val.get(run, {})), (axes[2], gaps.get(run, {}))):
            steps, mean, lo, hi = _mean_band(data)
            if not steps:
                continue
            ax.plot(steps, mean, color=c, lw=1.4, label=label if ax is axes[0] else None,
                    ls="--" if run == BASELINE else "-")
            if len(data) > 1:
                ax.fill_between(steps, lo, hi, color=c, alpha=0.15, lw=0)
        for rec in records:
            if rec["config"] == run and rec.get("diverged"):
                y = rec.get("final_train_loss")
                y = top if y is None or not math.isfinite(y) or y > top else y
                axes[0].plot([rec["diverged_at_step"]], [y], marker="x", ms=9, mew=2, color=c, ls="none")
    bottom = min([v for run in val.values() for s in run.values() for v in s.values()] or finite_all or [0.0])
    axes[0].set_ylim(0.97 * bottom, top)
    axes[1].set_ylim(0.97 * bottom, min(top, _upper(val, bottom)))
    axes[2].axhline(0.0, color="0.5", lw=0.8)
    for ax, title, ylabel in ((axes[0], "training loss (EMA-smoothed; x = diverged, stopped)", "nats/byte"),
                              (axes[1], "validation loss", "nats/byte"),
                              (axes[2], "validation-loss gap to fp32 states (same seed)", "nats/byte")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=min(4, max(1, len(runs))), fontsize=8, frameon=False)
    settings = meta.get("settings") or {}
    fig.suptitle(f"qstate bench train: {settings.get('model', '?')}, {settings.get('optimizer', '?')}, "
                 f"{steps_total} steps, seeds {meta.get('seeds', '?')}, on {meta.get('device', '?')}", fontsize=11)
    return fig


def _gaps(val) -> dict:
    base = val.get(BASELINE, {})
    out: dict = defaultdict(dict)
    for run, seeds in val.items():
        for seed, pts in seeds.items():
            ref = base.get(seed, {})
            diff = {t: v - ref[t] for t, v in pts.items() if t in ref}
            if diff:
                out[run][seed] = diff
    return out


def _upper(val, bottom: float) -> float:
    """Top of the validation panel: above every value after the first evaluation."""
    later = [v for run in val.values() for s in run.values() for t, v in sorted(s.items())[1:]]
    return max(later) * 1.02 if later else bottom * 2


def save_loss_curves(doc: dict, path) -> Path:
    """Write the loss-curve figure to `path` (.png, .svg or .pdf), atomically
    (atomic.atomic_path: a symlink's target, a device in place, the old file's mode kept)."""
    mplconfig.prepare()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from ..results import atomic_path

    path = Path(path)
    fig = loss_figure(doc)
    FigureCanvasAgg(fig)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".").lower() or None)
    return path
