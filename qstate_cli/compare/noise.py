"""Timing verdicts that survive a noisy machine (`qstate compare`, kind kernels).

On a shared runner the machine itself changes speed between runs by tens of percent, and
every sample of one run shares that state, so a test that treats a run's repetitions as
independent draws (Mann-Whitney on samples_ms) calls a quieter machine an improvement
with p = 1e-150. Rows written by `bench kernels` with rounds (bench/group.py) carry what
is needed to judge the code rather than the machine:

- basis: `time_rel_copy` (the step's time over a copy of its own bytes timed in the same
  rounds) when both sides have it, else the raw `time_ms`; ratio = new / baseline on the
  basis, and `raw_ratio` = new / baseline of time_ms beside it;
- rounds: the basis per round (`rel_copy_rounds`, else `round_ms`), R values per side;
- dispersion of one side d = (max - min) / median of its rounds; the noise floor
  F = 1 + max(d_baseline, d_new): what this row moved by within one run;
- cpu_share (bench/timing.py): CPU time / wall time of a busy loop around the rounds,
  the lowest probe of the group; compare judges a row with its run's lowest share
  (meta.cpu_share) when that is lower, so a shared run is noisy in every row.

The rule, in order:
1. `noisy` when either side's cpu_share < 0.75 (the process got under 3/4 of a core: the
   machine was shared, and a shared CPU slows some paths far more than their references);
   never a regression or an improvement (unless compare's --strict-timing: then a
   regression, the status staying `noisy`);
   also `noisy` when the basis is `time_rel_copy` and the ratio and the raw ratio
   disagree by more than REFERENCE_MOVED (4x) either way: raw_ratio / ratio is how much
   the same-run copy reference itself moved between the runs (time_rel_copy = time_ms /
   ref_copy_ms on both sides), and a copy that stalled (0.006 ms in one run, 8 ms in the
   next: a probe on a 2-core runner saw ratio 0.001 against a raw ratio of 0.9) makes the
   time relative to it meaningless. 4x: between quiet runs of one machine the copy moved
   by 1.25x at most, under two busy loops by up to ~2x (a 2x slower machine is the case
   the relative metric exists for), while the stalls seen were ~380x and more; and a change
   of the code that changes a row's own bytes (the copy's size) moves it by ~2x at most
   (fp32 states instead of 4-bit ones about double the bytes an AdamW step moves);
2. `same` when the ratio is within the threshold (1/T <= ratio <= T, T = --threshold);
3. `regressed` / `improved` only when the rounds do not overlap (every round of NEW
   slower than every round of the baseline, or faster) AND the ratio is beyond the
   noise floor as well (ratio > max(T, F), or < 1 / max(T, F));
4. otherwise `insignificant`, and `why` says which condition failed.

Full separation of R rounds against R is an exact rank test: under no change each of the
C(2R, R) orders is equally likely, so the one-sided chance is 1 / C(2R, R) (R=3: 1/20,
R=5: 1/252); the noise floor keeps a shift that is real but smaller than what the row
does by itself within a run from counting. Rows without rounds (older files) keep the
old test: ratio beyond T and a two-sided Mann-Whitney U on samples_ms with p < alpha.

Others: asv (`asv compare`, `asv continuous`) flags a change when the ratio passes its
factor (default 1.1) and its statistics say the two results differ (a Mann-Whitney test
on the raw samples where it has them, else overlapping confidence intervals), and
`--interleave-processes` interleaves benchmarks across processes against slow background
drift; benchstat marks a delta "~" unless a U test gives p < 0.05; Bencher's thresholds
put bounds (t-test, z-score, percentage, ...) on a metric from a window of its history.
The A/B mode (ab.py) asks one process to time both configurations in the same rounds and
judges the paired per-round ratios with the same rule (`judge_paired`).
"""
from __future__ import annotations

import math
from statistics import median

from ..results import is_finite_number
from .evidence import unreadable

NOISY_CPU_SHARE = 0.75
REFERENCE_MOVED = 4.0  # ratio vs raw ratio: beyond this the copy reference itself moved (docstring, rule 1)
SHARED_WHY = "the machine was shared"
REFERENCE_WHY = "the same-run copy reference moved"


def _finite_float(v) -> float | None:
    """v as a float where it is a finite number (not a bool), else None."""
    return float(v) if is_finite_number(v) else None


def _values(v) -> list[float]:
    if not isinstance(v, (list, tuple)):
        return []
    out = [_finite_float(x) for x in v]
    return [x for x in out if x is not None and x > 0]


def dispersion(values: list[float]) -> float:
    """(max - min) / median of one row's per-round values (0 for fewer than 2)."""
    if len(values) < 2:
        return 0.0
    m = median(values)
    return (max(values) - min(values)) / m if m > 0 else math.inf


def basis(b: dict, n: dict) -> str:
    """`time_rel_copy` when both rows have it, else `time_ms`."""
    ok = all(_finite_float(r.get("time_rel_copy")) is not None and _finite_float(r.get("time_rel_copy")) > 0 for r in (b, n))
    return "time_rel_copy" if ok else "time_ms"


def rounds_of(row: dict, on: str) -> list[float]:
    """The row's per-round values on basis `on`."""
    return _values(row.get("rel_copy_rounds" if on == "time_rel_copy" else "round_ms"))


def shares(*rows: dict) -> float | None:
    """The lowest cpu_share of the rows (None when none has one)."""
    got = [_finite_float(r.get("cpu_share")) for r in rows]
    got = [s for s in got if s is not None]
    return min(got) if got else None


def decide(ratio: float, separated: bool, floor: float, threshold: float, share: float | None,
           apart: str) -> tuple[str, str]:
    """(status, why) by the rule in the module docstring; `apart` says how the rounds were
    found apart (for `why`)."""
    if share is not None and share < NOISY_CPU_SHARE:
        return "noisy", f"cpu share {share:.2f} below {NOISY_CPU_SHARE}: {SHARED_WHY}"
    if 1 / threshold <= ratio <= threshold:
        return "same", f"within the threshold {threshold:g}"
    if not separated:
        return "insignificant", "rounds overlap"
    limit = max(threshold, floor)
    if 1 / limit <= ratio <= limit:
        return "insignificant", f"within the noise floor {floor:.3g}"
    return ("regressed" if ratio > 1 else "improved"), f"{apart}, beyond the noise floor {floor:.3g}"


def reference_moved(ratio: float, raw: float) -> str | None:
    """Why a ratio on `time_rel_copy` is meaningless (None: it is not): the copy reference
    moved raw / ratio times between the runs, more than REFERENCE_MOVED either way."""
    if not (ratio > 0 and raw > 0):
        return None
    moved = raw / ratio  # NEW's copy reference over the baseline's
    factor = max(moved, 1 / moved)
    if factor <= REFERENCE_MOVED:
        return None
    times = f"{factor:,.0f}" if factor >= 100 else f"{factor:.3g}"
    return (f"{REFERENCE_WHY} {times}x between the runs ({'slower' if moved > 1 else 'faster'} in NEW; "
            f"ratio {ratio:.3g} vs raw ratio {raw:.3g}): the time relative to it is no measure of the code")


def judge_rows(b: dict, n: dict, field: str, threshold: float, alpha: float) -> dict:
    """The verdict fields of one timing metric (`field`, time_ms) of baseline row `b` and
    NEW row `n`: baseline, new (raw ms), ratio (on the basis), raw_ratio, basis,
    noise_floor, p_value, threshold, cpu_share, status, why, regression."""
    bs, ns = _values(b.get("samples_ms")), _values(n.get("samples_ms"))
    bv = _finite_float(b.get(field)) if _finite_float(b.get(field)) is not None else (median(bs) if bs else None)
    nv = _finite_float(n.get(field)) if _finite_float(n.get(field)) is not None else (median(ns) if ns else None)
    if bv is None or nv is None or bv <= 0 or nv <= 0:  # nothing to take a ratio of: fails closed
        return unreadable(field, bv if bv and bv > 0 else None, nv if nv and nv > 0 else None)
    raw = nv / bv
    share = shares(b, n)
    on = basis(b, n)
    br, nr = rounds_of(b, on), rounds_of(n, on)
    out = {"baseline": bv, "new": nv, "raw_ratio": raw, "threshold": threshold, "cpu_share": share,
           "p_value": None, "noise_floor": None, "basis": on}
    if len(br) >= 2 and len(nr) >= 2:
        ratio = (_finite_float(n.get(on)) / _finite_float(b.get(on))) if on == "time_rel_copy" else raw
        floor = 1 + max(dispersion(br), dispersion(nr))
        separated = min(nr) > max(br) if ratio > 1 else max(nr) < min(br)
        status, why = decide(ratio, separated, floor, threshold, share,
                             f"rounds apart ({len(nr)} vs {len(br)})")
        moved = reference_moved(ratio, raw) if on == "time_rel_copy" else None
        if moved is not None and status != "noisy":
            status, why = "noisy", moved
        out.update(ratio=ratio, noise_floor=floor)
    else:
        ratio, p = raw, None
        out["basis"] = "time_ms"
        if len(bs) >= 2 and len(ns) >= 2:
            from scipy.stats import mannwhitneyu

            p = float(mannwhitneyu(bs, ns, alternative="two-sided").pvalue)
        out.update(ratio=ratio, p_value=p)
        if share is not None and share < NOISY_CPU_SHARE:
            status, why = "noisy", f"cpu share {share:.2f} below {NOISY_CPU_SHARE}: {SHARED_WHY}"
        elif 1 / threshold <= ratio <= threshold:
            status, why = "same", f"within the threshold {threshold:g}"
        elif p is None and ratio > 1:  # nothing to test the slowdown with: it stands (fail closed)
            status, why = "regressed", "no samples to test the ratio against the threshold"
        elif p is None:
            status, why = "insignificant", "no samples to test"
        elif p >= alpha:
            status, why = "insignificant", f"Mann-Whitney p {p:.2g}, not below {alpha:g}"
        else:
            status = "regressed" if ratio > 1 else "improved"
            why = f"Mann-Whitney p {p:.2g} below {alpha:g} (no rounds: samples taken as independent)"
    out.update(status=status, why=why, regression=status == "regressed")
    return out


def judge_paired(base_rounds: list[float], new_rounds: list[float], threshold: float,
                 share: float | None) -> dict:
    """A/B in one process (ab.py): round r of both configurations ran back to back, so
    q_r = new_r / base_r is a paired ratio. ratio = median(q); separated = every q_r on
    the same side of 1 (a sign test: 2 / 2^R two-sided); noise floor = 1 + dispersion(q)."""
    q = [nr / br for br, nr in zip(base_rounds, new_rounds) if br > 0 and nr > 0]
    if not q:
        return {"status": "failed", "why": "no paired rounds", "regression": False}
    ratio = median(q)
    floor = 1 + dispersion(q)
    separated = all(x > 1 for x in q) if ratio > 1 else all(x < 1 for x in q)
    status, why = decide(ratio, separated, floor, threshold, share,
                         f"all {len(q)} paired rounds {'slower' if ratio > 1 else 'faster'}")
    if status == "insignificant" and why == "rounds overlap":
        why = "paired rounds disagree in sign"
    return {"ratio": ratio, "noise_floor": floor, "paired_ratios": [float(f"{x:.6g}") for x in q],
            "p_value": 2 * 0.5 ** len(q) if separated else None, "cpu_share": share, "threshold": threshold,
            "status": status, "why": why, "regression": status == "regressed"}
