"""Plots as PNG bytes, drawn with matplotlib's object API (Figure + Agg, no pyplot state).

Every plot labels its axes with units, uses log axes where sizes sweep, and gives each
configuration the same colour in every figure of a report (`Palette`). Baselines are
dashed, our configurations solid. Rows of one configuration that differ in something else
(a kernels path, a suite axis: a row's `variant`, report/labels.py) are separate lines in
its colour, told apart by line style and marker and named in the legend.

Text from a results file (names, configurations, titles holding a device name) goes
through `plain`: its `$` are escaped, so a name like `cost $\\frac{a}{ $` is drawn as it is
and never parsed as mathtext (the axes' own tick labels still are: 10^2 on log axes).

Where matplotlib's own folders cannot be written (a read-only HOME) and MPLCONFIGDIR is
unset, it is set before matplotlib loads (mplconfig.prepare): to qstate's cache, else a
temporary folder; matplotlib would warn twice on stderr and rebuild its font cache each run.
"""
from __future__ import annotations

import io
import math
import statistics
from collections import defaultdict

from .. import mplconfig
from ..results import is_finite_number

mplconfig.prepare()  # before matplotlib loads: MPLCONFIGDIR where its default cannot be written

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402 - after MPLCONFIGDIR is set
from matplotlib.figure import Figure  # noqa: E402

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"]


class Palette:
    """One colour per name, stable across the figures of a report (sorted order)."""

    def __init__(self, names):
        self.colors = {name: _COLORS[i % len(_COLORS)] for i, name in enumerate(sorted({str(n) for n in names}))}

    def __call__(self, name) -> str:
        return self.colors.get(str(name), "#444444")


LINESTYLES = ("-", "-.", ":", (0, (3, 1, 1, 1, 1, 1)), (0, (1, 1)), (0, (5, 1)))
MARKERS = ("o", "s", "^", "D", "v", "P")
FILLS = ("full", "none", "left", "bottom", "right", "top")


def variant_index(pairs) -> dict:
    """{(colour name, variant): its index among the variants of that colour name}: the
    line style (LINESTYLES), marker (MARKERS) or fill (FILLS) that tells them apart."""
    by = defaultdict(list)
    for name, var in sorted(set(pairs), key=lambda p: (str(p[0]), str(p[1]))):
        by[name].append(var)
    return {(name, var): i for name, vars_ in by.items() for i, var in enumerate(vars_)}


def plain(text) -> str:
    """Text from a results file as matplotlib draws it literally: every `$` escaped (`\\$`),
    so no pair of them starts mathtext (whose parse errors would abort the report), and a
    leading space before a `_`, which would leave the label out of the legend."""
    text = str(text).replace("$", "\\$")
    return f" {text}" if text.startswith("_") else text


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
    """Kernels: time (ms, log-log) and % of the measured copy bandwidth against numel, one
    line per name, path and variant (a name timed on two paths is two lines in its colour);
    cache-resident rows have no percentage and are crosses in a band above 100%."""
    fig, (ax_t, ax_p) = new_figure(2, width=11.5, height=4.0)
    by_line = defaultdict(list)
    for r in rows:
        if is_finite_number(r.get("time_ms")) and is_finite_number(r.get("numel")):
            by_line[(str(r.get("name")), str(r.get("path")), str(r.get("variant") or ""))].append(r)
    index = variant_index((name, (path, var)) for name, path, var in by_line)
    for (name, path, var), group in sorted(by_line.items()):
        at = defaultdict(list)  # numel -> rows: a size measured more than once is one point, its median
        for r in group:
            at[r["numel"]].append(r)
        x = sorted(at)
        i = index[(name, (path, var))]
        text = " ".join(t for t in (name, f"[{path}]" if path not in (name, "None") else "", var) if t)
        base = is_baseline(group[0])
        style = dict(color=palette(name), marker=MARKERS[i % len(MARKERS)], ms=4, lw=1.6,
                     ls="--" if base else LINESTYLES[i % len(LINESTYLES)],
                     label=plain(f"{text} (baseline)" if base else text))
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
    fig.suptitle(plain(title), fontsize=11)
    _legend(fig, [ax_t, ax_p])
    return to_png(fig)


def bars(labels: list[str], values: list[float], xlabel: str, title: str, palette: Palette,
         colors: list[str] | None = None) -> bytes:
    """Horizontal bars with the value written at each bar (memory: bytes per parameter),
    coloured by `colors` (the palette's names; default: the labels)."""
    fig, (ax,) = new_figure(1, width=8.0, height=0.45 * len(labels) + 1.2)
    y = list(range(len(labels)))
    ax.barh(y, values, color=[palette(colors[i] if colors else label) for i, label in enumerate(labels)])
    ax.set_yticks(y, [plain(label) for label in labels])
    ax.invert_yaxis()
    for yi, v in zip(y, values):
        ax.annotate(f"{v:.5g}", (v, yi), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set(xlabel=xlabel, title=plain(title))
    ax.grid(False, axis="y")
    return to_png(fig)


def per_state_lines(series: list[dict], metric: str, ylabel: str, title: str, palette: Palette,
                    predicted: str | None = None, states=("m", "v")) -> bytes:
    """Diagnose: `metric` over steps per configuration and variant (report/labels.py), one
    panel per state; the theory's prediction dashed in the same colour."""
    fig, axes = new_figure(len(states), width=11.5, height=3.8)
    index = variant_index((str(r.get("config")), str(r.get("variant") or "")) for r in series)
    for ax, state in zip(axes, states):
        by_line = defaultdict(list)
        for r in series:
            if r.get("state") == state and is_finite_number(r.get("step")):
                by_line[(str(r.get("config")), str(r.get("variant") or ""))].append(r)
        for (config, var), rows in sorted(by_line.items()):
            rows.sort(key=lambda r: r["step"])
            steps = [r["step"] for r in rows]
            i = index[(config, var)]
            text = f"{config} {var}" if var else config
            ax.plot(steps, [r[metric] if is_finite_number(r.get(metric)) else math.nan for r in rows],
                    color=palette(config), lw=1.4, ls=LINESTYLES[i % len(LINESTYLES)], label=plain(text))
            if predicted and any(is_finite_number(r.get(predicted)) for r in rows):
                ax.plot(steps, [r[predicted] if is_finite_number(r.get(predicted)) else math.nan for r in rows],
                        color=palette(config), lw=1.2, ls="--", label=plain(f"{text} (predicted)"))
        ax.set(xlabel="step", ylabel=ylabel, title=plain(f"state {state}"))
    fig.suptitle(plain(title), fontsize=11)
    _legend(fig, axes)
    return to_png(fig)


def drawable_histogram(h: dict) -> bool:
    """A histogram row staleness_histograms can draw: counts, and one more edge than counts."""
    counts, edges = h.get("counts"), h.get("edges")
    return isinstance(counts, list) and isinstance(edges, list) and len(edges) == len(counts) + 1 and bool(counts)


def staleness_histograms(hists: list[dict], palette: Palette, states=("m", "v")) -> bytes:
    """Diagnose: fraction of elements per staleness bin (steps since the stored value changed)."""
    fig, axes = new_figure(len(states), width=11.5, height=3.8)
    index = variant_index((str(h.get("config")), str(h.get("variant") or "")) for h in hists)
    for ax, state in zip(axes, states):
        for h in sorted((h for h in hists if h.get("state") == state),
                        key=lambda h: (str(h.get("config")), str(h.get("variant") or ""))):
            total = sum(h["counts"]) or 1
            config, var = str(h.get("config")), str(h.get("variant") or "")
            ax.stairs([c / total for c in h["counts"]], h["edges"], color=palette(config), lw=1.6,
                      ls=LINESTYLES[index[(config, var)] % len(LINESTYLES)],
                      label=plain(f"{config} {var}" if var else config))
        ax.set_xscale("symlog", linthresh=1)
        ax.set(xlabel="staleness (steps since the stored value changed)", ylabel="fraction of elements",
               title=plain(f"state {state}"))
    fig.suptitle("Staleness", fontsize=11)
    _legend(fig, axes)
    return to_png(fig)


def predicted_vs_observed(records: list[dict], palette: Palette) -> bytes:
    """Diagnose: observed mean code stall rate (the stall rate in older documents) against the
    staleness model's prediction; o: v, square: m; variants of a configuration differ in fill."""
    fig, (ax,) = new_figure(1, width=7.5, height=4.6)
    index = variant_index((str(r.get("config")), str(r.get("variant") or "")) for r in records)
    for r in records:
        x, y = r.get("stall_rate_predicted"), r.get("code_stall_rate", r.get("stall_rate"))
        if is_finite_number(x) and is_finite_number(y):
            config, var = str(r.get("config")), str(r.get("variant") or "")
            ax.plot([x], [y], ls="none", color=palette(config), ms=7, marker="o" if r.get("state") == "v" else "s",
                    fillstyle=FILLS[index[(config, var)] % len(FILLS)],
                    label=plain(f"{config}{' ' + var if var else ''} ({r.get('state')})"))
    ax.plot([0, 1], [0, 1], color="#999999", lw=0.8, ls=":", label="observed = predicted")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted stall rate (model)", ylabel="observed code stall rate",
           title="Stalling: model vs replay", aspect="equal")
    _legend(fig, [ax])
    return to_png(fig)


def loss_curves(series: list[dict], palette: Palette) -> bytes:
    """Train: training loss (lines) and validation loss (markers) against step, per config
    and variant; every seed drawn in the configuration's colour; a divergence ends its line
    with an x."""
    fig, (ax,) = new_figure(1, width=10.0, height=4.4)
    runs = defaultdict(list)
    for r in series:
        if is_finite_number(r.get("step")):
            runs[(str(r.get("config")), str(r.get("variant") or ""), str(r.get("seed")))].append(r)
    index = variant_index((config, var) for config, var, _ in runs)
    labelled = set()
    for (config, var, seed), rows in sorted(runs.items()):
        rows.sort(key=lambda r: r["step"])
        color = palette(config)
        text = f"{config} {var}" if var else config
        label = None if text in labelled else plain(text)
        labelled.add(text)
        steps = [r["step"] for r in rows]
        loss = [r["train_loss"] if is_finite_number(r.get("train_loss")) else math.nan for r in rows]
        ax.plot(steps, loss, color=color, lw=1.2, alpha=0.85, ls=LINESTYLES[index[(config, var)] % len(LINESTYLES)],
                label=label)
        val = [(r["step"], r["val_loss"]) for r in rows if is_finite_number(r.get("val_loss"))]
        if val:
            ax.plot(*zip(*val), color=color, ls="none", marker=MARKERS[index[(config, var)] % len(MARKERS)], ms=4)
        if rows and not is_finite_number(rows[-1].get("train_loss")):
            last = next((v for v in reversed(loss) if math.isfinite(v)), None)
            if last is not None:
                ax.plot([rows[-1]["step"]], [last], color=color, marker="x", ms=9, mew=2)
    ax.set(xlabel="step", ylabel="loss (cross-entropy, nats)", title="Loss (lines: train, dots: validation, x: diverged)")
    _legend(fig, [ax])
    return to_png(fig)
