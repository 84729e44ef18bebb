"""Plots as PNG bytes, drawn with matplotlib's object API (Figure + Agg, no pyplot state).

Every plot labels its axes with units, uses log axes where sizes sweep, and gives each
configuration the same colour in every figure of a report (`Palette`). Baselines are
dashed, our configurations solid.
"""
from __future__ import annotations

import io
import math
import statistics
from collections import defaultdict

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..results import is_finite_number

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"]


class Palette:
    """One colour per name, stable across the figures of a report (sorted order)."""

    def __init__(self, names):
        self.colors = {name: _COLORS[i % len(_COLORS)] for i, name in enumerate(sorted({str(n) for n in names}))}

    def __call__(self, name) -> str:
        return self.colors.get(str(name), "#444444")



def new_figure(ncols: int = 1, width: float = 10.0, height: float = 3.8):
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.12)
    return fig, list(axes)


def to_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, metadata={"Software": None})
    return buf.getvalue()


def _legend(fig, axes) -> None:
    handles, labels = {}, []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    if labels:
        fig.legend([handles[label] for label in labels], labels, loc="outside right upper", fontsize=8, frameon=False)


CACHE_BAND = 110.0  # where size_sweep marks cache-resident rows (bench/roofline.py), in %


def size_sweep(rows: list[dict], title: str, palette: Palette, is_baseline) -> bytes:
    """Kernels: time (ms, log-log) and % of the measured copy bandwidth against numel;
    cache-resident rows have no percentage and are crosses in a band above 100%."""
    fig, (ax_t, ax_p) = new_figure(2, width=11.5, height=4.0)
    by_name = defaultdict(list)
    for r in rows:
        if is_finite_number(r.get("time_ms")) and is_finite_number(r.get("numel")):
            by_name[str(r.get("name"))].append(r)
    for name, group in sorted(by_name.items()):
        at = defaultdict(list)  # numel -> rows: a size measured more than once is one point, its median
        for r in group:
            at[r["numel"]].append(r)
        x = sorted(at)
        style = dict(color=palette(name), marker="o", ms=4, lw=1.6, ls="--" if is_baseline(group[0]) else "-",
                     label=f"{name} (baseline)" if is_baseline(group[0]) else str(name))
        ax_t.plot(x, [statistics.median(r["time_ms"] for r in at[n]) for n in x], **style)
        pct = [[r["pct_of_copy"] for r in at[n]
                if is_finite_number(r.get("pct_of_copy")) and not r.get("cache_resident")]
               for n in x]
        ax_p.plot(x, [statistics.median(p) if p else math.nan for p in pct], **style)
        cached = [n for n in x if any(r.get("cache_resident") for r in at[n])]
        if cached:  # no roofline percentage: a cross in the band above 100%
            ax_p.plot(cached, [CACHE_BAND] * len(cached), ls="none", marker="x", ms=7, color=palette(name))
    ax_t.set(xscale="log", yscale="log", xlabel="elements per step (numel)", ylabel="time per step (ms, median)",
             title="Time")
    ax_p.set(xscale="log", xlabel="elements per step (numel)", ylabel="% of measured copy bandwidth",
             title="Roofline", ylim=(0, 120))
    ax_p.axhline(100, color="#999999", lw=0.8)
    ax_p.text(0.01, CACHE_BAND + 4, "cache-resident (x)", transform=ax_p.get_yaxis_transform(), fontsize=7,
              color="#666666", va="bottom")
    fig.suptitle(title, fontsize=11)
    _legend(fig, [ax_t, ax_p])
    return to_png(fig)


def bars(labels: list[str], values: list[float], xlabel: str, title: str, palette: Palette) -> bytes:
    """Horizontal bars with the value written at each bar (memory: bytes per parameter)."""
    fig, (ax,) = new_figure(1, width=8.0, height=0.45 * len(labels) + 1.2)
    y = list(range(len(labels)))
    ax.barh(y, values, color=[palette(label) for label in labels])
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    for yi, v in zip(y, values):
        ax.annotate(f"{v:.5g}", (v, yi), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set(xlabel=xlabel, title=title)
    ax.grid(False, axis="y")
    return to_png(fig)


def per_state_lines(series: list[dict], metric: str, ylabel: str, title: str, palette: Palette,
                    predicted: str | None = None, states=("m", "v")) -> bytes:
    """Diagnose: `metric` over steps per configuration, one panel per state; the theory's
    prediction dashed in the same colour."""
    fig, axes = new_figure(len(states), width=11.5, height=3.8)
    for ax, state in zip(axes, states):
        by_config = defaultdict(list)
        for r in series:
            if r.get("state") == state and is_finite_number(r.get("step")):
                by_config[str(r.get("config"))].append(r)
        for config, rows in sorted(by_config.items()):
            rows.sort(key=lambda r: r["step"])
            steps = [r["step"] for r in rows]
            ax.plot(steps, [r[metric] if is_finite_number(r.get(metric)) else math.nan for r in rows],
                    color=palette(config), lw=1.4, label=str(config))
            if predicted and any(is_finite_number(r.get(predicted)) for r in rows):
                ax.plot(steps, [r[predicted] if is_finite_number(r.get(predicted)) else math.nan for r in rows],
                        color=palette(config), lw=1.2, ls="--", label=f"{config} (predicted)")
        ax.set(xlabel="step", ylabel=ylabel, title=f"state {state}")
    fig.suptitle(title, fontsize=11)
    _legend(fig, axes)
    return to_png(fig)


def drawable_histogram(h: dict) -> bool:
    """A histogram row staleness_histograms can draw: counts, and one more edge than counts."""
    counts, edges = h.get("counts"), h.get("edges")
    return isinstance(counts, list) and isinstance(edges, list) and len(edges) == len(counts) + 1 and bool(counts)


def staleness_histograms(hists: list[dict], palette: Palette, states=("m", "v")) -> bytes:
    """Diagnose: fraction of elements per staleness bin (steps since the stored value changed)."""
    fig, axes = new_figure(len(states), width=11.5, height=3.8)
    for ax, state in zip(axes, states):
        for h in sorted((h for h in hists if h.get("state") == state), key=lambda h: str(h.get("config"))):
            total = sum(h["counts"]) or 1
            ax.stairs([c / total for c in h["counts"]], h["edges"], color=palette(h.get("config")), lw=1.6,
                      label=str(h.get("config")))
        ax.set_xscale("symlog", linthresh=1)
        ax.set(xlabel="staleness (steps since the stored value changed)", ylabel="fraction of elements",
               title=f"state {state}")
    fig.suptitle("Staleness", fontsize=11)
    _legend(fig, axes)
    return to_png(fig)


def predicted_vs_observed(records: list[dict], palette: Palette) -> bytes:
    """Diagnose: observed mean code stall rate (the stall rate in older documents) against the
    staleness model's prediction."""
    fig, (ax,) = new_figure(1, width=7.5, height=4.6)
    for r in records:
        x, y = r.get("stall_rate_predicted"), r.get("code_stall_rate", r.get("stall_rate"))
        if is_finite_number(x) and is_finite_number(y):
            ax.scatter([x], [y], color=palette(r.get("config")), s=36, marker="o" if r.get("state") == "v" else "s",
                       label=f"{r.get('config')} ({r.get('state')})")
    ax.plot([0, 1], [0, 1], color="#999999", lw=0.8, ls=":", label="observed = predicted")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted stall rate (model)", ylabel="observed code stall rate",
           title="Stalling: model vs replay", aspect="equal")
    _legend(fig, [ax])
    return to_png(fig)


def loss_curves(series: list[dict], palette: Palette) -> bytes:
    """Train: training loss (lines) and validation loss (markers) against step, per config;
    every seed drawn in the configuration's colour; a divergence ends its line with an x."""
    fig, (ax,) = new_figure(1, width=10.0, height=4.4)
    runs = defaultdict(list)
    for r in series:
        if is_finite_number(r.get("step")):
            runs[(str(r.get("config")), str(r.get("seed")))].append(r)
    labelled = set()
    for (config, seed), rows in sorted(runs.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        rows.sort(key=lambda r: r["step"])
        color = palette(config)
        label = None if config in labelled else str(config)
        labelled.add(config)
        steps = [r["step"] for r in rows]
        loss = [r["train_loss"] if is_finite_number(r.get("train_loss")) else math.nan for r in rows]
        ax.plot(steps, loss, color=color, lw=1.2, alpha=0.85, label=label)
        val = [(r["step"], r["val_loss"]) for r in rows if is_finite_number(r.get("val_loss"))]
        if val:
            ax.plot(*zip(*val), color=color, ls="none", marker="o", ms=4)
        if rows and not is_finite_number(rows[-1].get("train_loss")):
            last = next((v for v in reversed(loss) if math.isfinite(v)), None)
            if last is not None:
                ax.plot([rows[-1]["step"]], [last], color=color, marker="x", ms=9, mew=2)
    ax.set(xlabel="step", ylabel="loss (cross-entropy, nats)", title="Loss (lines: train, dots: validation, x: diverged)")
    _legend(fig, [ax])
    return to_png(fig)
