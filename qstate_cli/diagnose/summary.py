"""Raw replay results -> the rows of a `kind = "diagnose"` result file (docs/results.md).

Record values are means over the replayed steps unless named *_final, *_max_abs or
*_late (the last 10% of the steps, at least one); stall_rate (stored value unchanged) and
code_stall_rate (stored code or raw bits unchanged) pool all element-steps with a
non-zero nominal update; staleness percentiles (on codes) come from the exact per-step
counts at the snapshot steps.
"""
from __future__ import annotations

import math

import numpy as np

from .. import theory
from .assumptions import gradient_checks, model_warning
from .recommend import recommend
from .replay import ConfigReplay, Replay

MAX_SERIES_POINTS = 1000
LATE_FRACTION = 0.1


def _f(x):
    """JSON-friendly float (None for NaN/inf)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _nanmean(a) -> float | None:
    a = np.asarray(a, dtype=float)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else None


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), np.nan)


def state_series(st: dict) -> dict:
    """Per-step drift, relative RMS error, error variance and stall rate of one state."""
    n, x2 = st["n"], st["shadow2_sum"]
    drift = _div(st["err_sum"], np.sqrt(x2 * n))
    rel2 = _div(st["err2_sum"], x2)
    return {"drift": drift, "rel_rms_error": np.sqrt(rel2), "error_var": rel2 - drift ** 2,
            "stall_rate": _div(st["stalls"], st["nominal"]), "code_stall_rate": _div(st["code_stalls"], st["nominal"])}


def late_start(n_steps: int) -> int:
    """Index of the first of the last 10% of steps (at least one step)."""
    return n_steps - max(1, math.ceil(LATE_FRACTION * n_steps))


def pooled_rate(events: np.ndarray, nominal: np.ndarray, start: int = 0) -> float | None:
    """sum(events[start:]) / sum(nominal[start:]): a rate pooled over element-steps."""
    den = float(np.nansum(nominal[start:]))  # NaN: a step the model skipped (replay.MODEL_POINTS)
    return float(np.nansum(events[start:])) / den if den > 0 else None


def predicted_curve(c: ConfigReplay, state: str, rec, n_steps: int):
    """The Gaussian model's P(stall) per step: theory.py's curve for Adam's v in an unscaled
    float format; otherwise (block- or tensor-scaled floats too: a scaled grid's small
    elements sit in its coarse subnormals, and its top element has no neighbour above) the
    per-element model of the replay (staleness.py), or None."""
    spec = c.cfg.spec(state)
    if rec.adam_moments and state == "v" and spec.fmt.kind == "float" and not spec.has_scales:
        return theory.stall_curve(spec, rec.betas[state], n_steps, c.period)
    model = c.models.get(state)
    if model is None or not np.isfinite(model["gaussian"]).any():
        return None
    return _div(model["gaussian"], model["nominal"])


def _mean(a, start: int = 0):
    return None if a is None else _nanmean(np.asarray(a)[start:])


def staleness_summary(counts: np.ndarray) -> dict:
    total = counts.sum()
    if total == 0:
        return {"staleness_mean": None, "staleness_p50": None, "staleness_p90": None, "staleness_max": None}
    k = np.arange(counts.size)
    cdf = np.cumsum(counts) / total
    return {"staleness_mean": float((k * counts).sum() / total),
            "staleness_p50": int(np.searchsorted(cdf, 0.5)), "staleness_p90": int(np.searchsorted(cdf, 0.9)),
            "staleness_max": int(np.nonzero(counts)[0][-1])}


def log2_histogram(counts: np.ndarray) -> tuple[list[int], list[int]]:
    """Counts of staleness 0, 1, [2, 4), [4, 8), ...: edges [0, 1, 2, 4, ...]."""
    top = max(1, int(np.nonzero(counts)[0][-1]) + 1 if counts.any() else 1)
    edges = [0, 1] + [2 ** k for k in range(1, int(math.ceil(math.log2(top))) + 2)]
    cum = np.concatenate([[0], np.cumsum(counts)])
    at = lambda e: int(cum[min(e, counts.size)])
    return edges, [at(b) - at(a) for a, b in zip(edges[:-1], edges[1:])]


def dim_slope(dims, ms, from_d: int = 1) -> float | None:
    """Least-squares slope of log RMS(sum of d errors) against log d, over d >= from_d (the
    dither block: inside one, BReD's errors share a dither and add up coherently; across
    blocks they are independent, which is what large d is about). All d if that leaves
    fewer than 3 points."""
    d, m = np.asarray(dims, float), np.asarray(ms, float)
    ok = m > 0
    if (ok & (d >= from_d)).sum() >= 3:
        ok &= d >= from_d
    if ok.sum() < 3:
        return None
    return float(np.polyfit(np.log(d[ok]), 0.5 * np.log(m[ok]), 1)[0])


def code_values(spec, mode: str, n_codes: int) -> np.ndarray:
    """The normalised value of every code (fraction of the block absmax for scaled formats),
    or of every binade's lower edge (16-bit floats)."""
    import torch

    fmt = spec.fmt
    k = torch.arange(n_codes)
    if mode == "binade":
        return np.where(k.numpy() > 0, 2.0 ** (k.numpy() + fmt.emin - 1), 0.0)
    if fmt.kind == "linear":
        q = ((k ^ (1 << (fmt.bits - 1))) - (1 << (fmt.bits - 1))) if fmt.signed else k
        return (q.float() / fmt.levels).numpy()
    if fmt.kind == "table":
        return np.asarray(fmt.table, dtype=float)
    mag_bits = fmt.bits - 1 if fmt.signed else fmt.bits
    mag = (k & ((1 << mag_bits) - 1)).clamp(max=fmt.max_ordinal)
    val = fmt.code_value(mag).double()
    if fmt.signed:
        val = torch.where((k >> mag_bits) > 0, -val, val)
    return (val / (fmt.fmax if spec.scaled else 1.0)).numpy()


def downsample(arrays: dict, n_steps: int, limit: int = MAX_SERIES_POINTS):
    """Window means so that at most `limit` points remain; returns (steps, arrays)."""
    k = max(1, math.ceil(n_steps / limit))
    steps = np.arange(1, n_steps + 1)
    if k == 1:
        return steps, arrays
    pad = (-n_steps) % k

    def win(a):
        a = np.concatenate([np.asarray(a, float), np.full(pad, np.nan)]).reshape(-1, k)
        with np.errstate(invalid="ignore"):
            cnt = np.isfinite(a).sum(1)
            return np.where(cnt > 0, np.nansum(a, 1) / np.maximum(cnt, 1), np.nan)

    last = np.minimum(np.arange(k, n_steps + pad + 1, k), n_steps)
    return last, {name: (None if a is None else win(a)) for name, a in arrays.items()}


def per_tensor_rows(name: str, state: str, layout, st: dict, upd: dict, n_steps: int) -> list[dict]:
    units = st["units"]  # err, err2, stall, nominal, shadow2, code stall summed over steps, per unit block
    per = np.zeros((units.shape[0], layout.n_tensors))
    owner = layout.unit_tensor.cpu().numpy()
    for r in range(units.shape[0]):
        per[r] = np.bincount(owner, weights=units[r], minlength=layout.n_tensors)
    up = np.zeros((4, layout.n_tensors))
    for r in range(4):
        up[r] = np.bincount(owner, weights=upd["units"][r], minlength=layout.n_tensors)
    rows = []
    for j, t in enumerate(layout.trace.tensors):
        n_el = layout.lengths[j] * n_steps
        with np.errstate(divide="ignore", invalid="ignore"):
            rows.append({"config": name, "state": state, "tensor": t.name, "numel": layout.lengths[j],
                         "drift": _f(per[0, j] / math.sqrt(per[4, j] * n_el) if per[4, j] > 0 else None),
                         "rel_rms_error": _f(math.sqrt(per[1, j] / per[4, j]) if per[4, j] > 0 else None),
                         "stall_rate": _f(per[2, j] / per[3, j] if per[3, j] > 0 else None),
                         "code_stall_rate": _f(per[5, j] / per[3, j] if per[3, j] > 0 else None),
                         "update_cosine": _f(up[0, j] / math.sqrt(up[1, j] * up[3, j]) if up[1, j] * up[3, j] > 0 else None),
                         "update_rel_error": _f(math.sqrt(up[2, j] / up[3, j]) if up[3, j] > 0 else None)})
    return rows


def build(raw: Replay) -> dict:
    """records + series/histograms/per_code/per_tensor/dim_scaling/theory rows."""
    rec = raw.recursion
    out = {k: [] for k in ("records", "series", "histograms", "per_code", "per_tensor", "dim_scaling", "theory")}
    slow = rec.slowest_state
    checks = gradient_checks(raw.gradients, raw.n_steps)
    for c in raw.configs:
        cfg = c.cfg
        stall_slow = state_series(c.states[slow])["code_stall_rate"]  # the frozen code is the stall that matters
        advice = recommend(cfg.spec(slow), slow, rec.optimizer, rec.betas[slow], stall_slow, c.period)
        for s in c.states:
            _state_rows(out, raw, c, s, advice, checks)
        if rec.adam_moments:
            row = theory.theory_rows([cfg.spec("v")], rec.betas["v"])[0]
            out["theory"].append({"config": str(cfg), **row})
    _rank(out["records"])
    out["gradient_checks"] = checks
    return out


def _state_rows(out: dict, raw: Replay, c: ConfigReplay, s: str, advice: tuple, checks: dict) -> None:
    """Every row of one (configuration, state)."""
    rec, layout, n_steps = raw.recursion, raw.layout, raw.n_steps
    cfg, name, st, upd = c.cfg, str(c.cfg), c.states[s], c.update
    spec = cfg.spec(s)
    ser = state_series(st)
    pred = predicted_curve(c, s, rec, n_steps)
    model = c.models.get(s)
    emp = _div(model["empirical"], model["nominal"]) if model is not None else None
    drift = ser["drift"]
    late = late_start(n_steps)
    out["records"].append({
        "config": name, "state": s, "format": spec.fmt.name, "rounding": spec.rounding,
        "bits": spec.bits, "block_size": spec.block, "sqrt": spec.sqrt, "numel": layout.n_valid,
        "steps": n_steps, "optimizer": rec.optimizer, "beta": rec.betas[s],
        "bytes_per_param": round(sum(cfg.spec(x).bytes_per_element() for x in rec.states), 6),
        "drift_final": _f(drift[-1]), "drift_mean": _nanmean(drift),
        "drift_max_abs": _f(np.nanmax(np.abs(drift))) if np.isfinite(drift).any() else None,
        "rel_rms_error": _nanmean(ser["rel_rms_error"]), "error_var": _nanmean(ser["error_var"]),
        "dim_slope": dim_slope(st["dims"], st["dim_ms"], spec.dither_block),
        "stall_rate": pooled_rate(st["stalls"], st["nominal"]),
        "code_stall_rate": pooled_rate(st["code_stalls"], st["nominal"]),
        "stall_rate_late": pooled_rate(st["stalls"], st["nominal"], late),
        "code_stall_rate_late": pooled_rate(st["code_stalls"], st["nominal"], late),
        "stall_rate_predicted": _mean(pred), "stall_rate_predicted_late": _mean(pred, late),
        "stall_rate_predicted_empirical": None if model is None else pooled_rate(model["empirical"], model["nominal"]),
        "stall_rate_predicted_empirical_late": None if model is None else pooled_rate(model["empirical"],
                                                                                       model["nominal"], late),
        **staleness_summary(st["staleness_counts"]),
        "update_cosine": _nanmean(upd["cosine"]), "update_rel_error": _nanmean(upd["rel_error"]),
        "nonfinite_grads": raw.nonfinite_grads, "reset_applied": c.period,
        "reset_period": advice[0], "reset_reason": advice[1],
        "reset_update_error": None, "no_reset_update_error": None,  # validate.py, when the advice is replayed
    })
    record = out["records"][-1]
    observed = record["stall_rate_late" if spec.rounding == "bred" else "code_stall_rate_late"]
    record["model_warning"] = model_warning(record["stall_rate_predicted_late"], observed,
                                            record["stall_rate_predicted_empirical_late"], checks, spec.has_scales)
    steps, arr = downsample({**ser, "stall_rate_predicted": pred, "stall_rate_predicted_empirical": emp,
                             "update_cosine": upd["cosine"],
                             "update_rel_error": upd["rel_error"]}, n_steps)
    for j, t in enumerate(steps):
        out["series"].append({"config": name, "state": s, "step": int(t),
                              **{k: (None if a is None else _f(a[j])) for k, a in arr.items()}})
    edges, counts = log2_histogram(st["staleness_counts"])
    out["histograms"].append({"config": name, "state": s, "metric": "staleness", "edges": edges, "counts": counts})
    if st["codes"] is not None:
        vals = code_values(spec, st["code_mode"], st["codes"].shape[0])
        for code, (_, moved, value_only, code_only, both) in enumerate(st["codes"]):
            count = moved + value_only + code_only + both
            if count:
                out["per_code"].append({"config": name, "state": s, "code": code, "code_unit": st["code_mode"],
                                        "code_value": _f(vals[code]), "count": int(count),
                                        "stall_rate": float((value_only + both) / count),
                                        "code_stall_rate": float((code_only + both) / count)})
    out["per_tensor"] += per_tensor_rows(name, s, layout, st, upd, n_steps)
    out["dim_scaling"] += [{"config": name, "state": s, "d": int(d), "rms_sum": _f(math.sqrt(m))}
                           for d, m in zip(st["dims"], st["dim_ms"])]


def _rank(records: list[dict]) -> None:
    """rank 1 = the configuration whose update direction is closest to fp32's."""
    score = {}
    for r in records:
        score[r["config"]] = r["update_rel_error"] if r["update_rel_error"] is not None else float("inf")
    order = {name: i + 1 for i, name in enumerate(sorted(score, key=score.get))}
    for r in records:
        r["rank"] = order[r["config"]]
