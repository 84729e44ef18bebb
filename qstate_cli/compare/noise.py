"""Timing verdicts that survive a noisy machine (`qstate compare`, kind kernels).

On a shared runner the machine itself changes speed between runs by tens of percent, and
every sample of one run shares that state, so a test that treats a run's repetitions as
independent draws (Mann-Whitney on samples_ms) calls a quieter machine an improvement
with p = 1e-150. Rows written by `bench kernels` with rounds (bench/group.py) carry what
is needed to judge the code rather than the machine:

- basis: `time_rel_copy` (the step's time over a copy of its own bytes timed in the same
  rounds) when both sides have it, else the raw `time_ms`; ratio = new / baseline on the
  basis, and `raw_ratio` = new / baseline of time_ms beside it;
- rounds: the basis per round (`rel_copy_rounds`, else `round_ms`), Rb and Rn values;
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
   except (rule 1b, `shared_bound`) a slowdown that sharing cannot explain: a share s is
   the fraction of a core the process got, and a baseline timed on a shared CPU only ran
   slower itself. A step's time is the median of single calls: under time slicing (slice
   q, each turn of the others (1/s - 1) q) a call of d CPU-ms waits one turn per slice it
   crosses, so a median call takes at most d (2/s - 1): d/s + (1/s - 1) q with q <= d, and
   for d < q the median call waits a turn only when more than half of the calls do, i.e.
   when d > q/2. Not 1/s: a 2-core Xeon (2026-12-07) timed the same commit pinned beside one
   to five busy loops at shares 0.48, 0.36, 0.25 and 0.14 with raw ratios 2.24, 3.53, 4.85
   and 8.44 (1.07-1.27x beyond 1/s: the turns, and the caches the others disturb; 2/s - 1
   is 3.20, 4.56, 7.03 and 12.9), and the 1/s bound called the unchanged code regressed.
   With s the lowest share of NEW
   (its rows' and its run's), the raw ratio r (time_ms: the copy reference is distorted
   under sharing too), F' the noise floor of the raw rounds or of the basis, the larger,
   and c = NEW's copy reference over the baseline's (raw / ratio on `time_rel_copy`, at
   least 1; else 1: the memory's own slowdown, which the share cannot see), the machine
   explains a slowdown up to B = max(T, F') * c * (2/s - 1). A row whose raw rounds are
   all apart (every NEW round slower than every baseline round) and whose r > B is
   `regressed` on a shared run too, `why` giving the bound ("39.2x slower in time ...,
   beyond the 8.97x that a 0.34 CPU share can explain"): the probe that planted a 39x and
   a 10x slowdown on its shared 2-core runner (cpu share 0.34 in NEW, 0.29 in the
   baseline; floors 1.85 and 1.03, NEW's copy 1.01x the baseline's: bounds 8.97x and
   5.30x) saw both pass as
   `noisy`, exit 0, the heading of a run without the change. Only when NEW's step ran on
   ONE thread (`threads`: the row's own, else its suite point's meta.threads, else the
   document's meta.threads, which `bench kernels --threads` sets, else env.torch_threads,
   the process's torch count the rows ran with; the cpu-numba path splits over the same
   count; `run_threads`): with several, threads that spin-wait (OpenMP's, torch's and
   numba's) on an oversubscribed CPU slow a step far beyond that (docs/reports.md: 62 ms
   against 10.7 ms on one thread, one busy process beside torch's 2 threads on 2 cores),
   so such a row (or one whose thread count is not recorded) stays `noisy`, its `why`
   saying it slowed `BEYOND_WHY` (notes.py names it: rerun on a quiet machine). Never
   `improved` on a shared run: a quieter moment is not bounded the same way. Not applied
   where the copy reference moved beyond 4x (above), nor to rows without rounds, nor to
   A/B verdicts (ab.py: both configurations share each round's machine);
2. within the threshold (1/T <= ratio <= T, T = --threshold): `same` when F <= T, else
   `insignificant` (the row moves by more than T within one run: a change below F cannot
   be seen, so "same" would claim what the row cannot resolve; an A/A probe on a 2-core
   runner had 394 of 674 `same` rows with F > T, up to 2.46);
3. `regressed` / `improved` only when the rounds do not overlap (every round of NEW
   slower than every round of the baseline, or faster) AND the ratio is beyond the
   noise floor as well (ratio > max(T, F), or < 1 / max(T, F)) AND, on `time_rel_copy`,
   the raw time moved the same way (raw_ratio > 1 for regressed, < 1 for improved): a
   3-7 us copy reference moves 1.4x between quiet runs (inside the 4x of rule 1), and
   in that A/A probe 17 of 26 false regressions had a raw ratio within 1.1;
4. otherwise `insignificant`, and `why` says which condition failed.

p_value (rounds rows): the exact one-sided rank-sum (Mann-Whitney) p of NEW's rounds
against the baseline's in the direction of the ratio: the share of the C(Rb + Rn, Rb)
equally likely orders of the pooled rounds (no change) whose U is at least the one seen
(`rank_p`). Full separation, which rule 3 needs, is its smallest value 1 / C(Rb + Rn, Rb)
(3 vs 3: 1/20, 5 vs 5: 1/252): the chance that identical code is called slower, fixed by
the round counts whatever --alpha says (`null_chance`); over many rows these add up
(notes.py states the expected number of false regressions). Rows without rounds (older
files, `bench kernels --rounds 1`) keep the old test: ratio beyond T and a two-sided
Mann-Whitney U on samples_ms with p < alpha, which takes the samples as independent draws.

Others: asv (`asv compare`, `asv continuous`) flags a change when the ratio passes its
factor (default 1.1) and its statistics say the two results differ (a Mann-Whitney test
on the raw samples where it has them, else overlapping confidence intervals), and
`--interleave-processes` interleaves benchmarks across processes against slow background
drift; benchstat marks a delta "~" unless a U test gives p < 0.05; Bencher's thresholds
put bounds (t-test, z-score, percentage, ...) on a metric from a window of its history.
The A/B mode (ab.py) asks one process to time both configurations in the same rounds and
judges the paired per-round ratios with the same rule (`judge_paired`); its p_value is the
one-sided sign test's, P(at least k of R paired ratios on the ratio's side) = 1/2^R when
all R are.
"""
from __future__ import annotations

import math
from statistics import median

from ..report.labels import point_part
from ..results import is_finite_number
from .evidence import unreadable

NOISY_CPU_SHARE = 0.75
REFERENCE_MOVED = 4.0  # ratio vs raw ratio: beyond this the copy reference itself moved (docstring, rule 1)
SHARED_WHY = "the machine was shared"
REFERENCE_WHY = "the same-run copy reference moved"
BEYOND_WHY = "beyond what sharing explains if single-threaded"  # rule 1b, several threads: notes.py counts it


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


EXACT_MAX = 2500  # Rb * Rn up to which rank_p counts exactly (50 rounds a side: ~10 ms); beyond, scipy's normal
# approximation (a results file's rounds are not bounded: 1000 a side took ~2 minutes a row counted exactly)


def _u_counts(m: int, n: int) -> list[int]:
    """How many of the C(m + n, m) orders of m values against n give each U = 0 .. m*n (the
    coefficients of the Gaussian binomial [m + n, m]_q = prod_i (1 - q^(n+i)) / (1 - q^i))."""
    c = [1] + [0] * (m * n + m)
    for i in range(1, m + 1):
        for u in range(len(c) - 1, n + i - 1, -1):  # times (1 - q^(n+i))
            c[u] -= c[u - n - i]
        for u in range(i, len(c)):  # over (1 - q^i)
            c[u] += c[u - i]
    return c[:m * n + 1]


def rank_p(base: list[float], new: list[float], slower: bool) -> float:
    """The exact one-sided rank-sum p that NEW's rounds are slower (`slower`) or faster than
    the baseline's: P(U >= u) over the C(Rb + Rn, Rb) equally likely orders, U counting the
    (new, base) pairs in that direction (a tie counts 1/2). 1 / C(Rb + Rn, Rb) when apart."""
    u = sum((x > y if slower else x < y) + 0.5 * (x == y) for x in new for y in base)
    if len(new) * len(base) > EXACT_MAX:  # the exact count costs ~(Rb Rn)^1.5 big-integer steps
        from scipy.stats import mannwhitneyu

        side = "greater" if slower else "less"
        return float(mannwhitneyu(new, base, alternative=side, method="asymptotic").pvalue)
    counts = _u_counts(len(new), len(base))
    return sum(counts[math.ceil(u - 1e-9):]) / math.comb(len(new) + len(base), len(new))


def sign_p(q: list[float], slower: bool) -> float:
    """The one-sided sign test's p of paired ratios q: P(at least k of R on the side of 1 seen),
    k counting the ratios above 1 (`slower`) or below; 1 / 2^R when all R are."""
    q = [x for x in q if x != 1]  # a tie tells neither way: dropped, as the sign test does
    k = sum((x > 1) if slower else (x < 1) for x in q)
    return sum(math.comb(len(q), j) for j in range(k, len(q) + 1)) / 2 ** len(q)


def null_chance(rec: dict) -> float | None:
    """The chance that identical code is called slower on this verdict's test: full separation
    of its rounds (1 / C(Rb + Rn, Rb)) or all R paired ratios above 1 (1 / 2^R); None for
    other tests (rows without rounds: their nominal alpha / 2 assumes independent samples)."""
    rounds = rec.get("rounds")
    if rec.get("test") == "rounds" and rounds:
        return 1 / math.comb(rounds[0] + rounds[1], rounds[0])
    if rec.get("test") == "paired" and rounds:
        return 0.5 ** rounds[0]
    return None


def decide(ratio: float, separated: bool, floor: float, threshold: float, share: float | None,
           apart: str, overlap: str = "rounds overlap") -> tuple[str, str]:
    """(status, why) by rules 1-4 of the module docstring (rule 3's raw-time condition is the
    caller's); `apart` and `overlap` say how the rounds were found apart or not (for `why`)."""
    if share is not None and share < NOISY_CPU_SHARE:
        return "noisy", f"cpu share {share:.2f} below {NOISY_CPU_SHARE}: {SHARED_WHY}"
    if 1 / threshold <= ratio <= threshold:
        if floor > threshold:
            return "insignificant", (f"within the threshold {threshold:g}, but this row moves by up to {floor:.3g}x "
                                     "within one run: a change below that cannot be seen")
        return "same", f"within the threshold {threshold:g}"
    if not separated:
        return "insignificant", overlap
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


def _count(v) -> int | None:
    """v as a thread count (a whole number >= 1, not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def run_threads(doc: dict, row: dict) -> int | None:
    """The CPU threads row's timed step ran on (rule 1b): the row's own `threads` where it has
    one, else its suite point's meta.threads (meta.suite.points[row.point].meta), else the
    document's meta.threads (`bench kernels --threads`; None there: the process's count was
    left as it was), else env.torch_threads (torch's count in the process; `bench kernels
    --threads` writes its own there). The fused CPU path (cpu-numba) splits a step over the
    same count (kernels/cpu/host.threads: torch's). None where nothing says."""
    own = _count(row.get("threads"))
    if own is not None:
        return own
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    point_meta = point_part(doc, row, "meta")
    if point_meta is not None and _count(point_meta.get("threads")) is not None:
        return point_meta["threads"]
    if point_meta is None and _count(meta.get("threads")) is not None:
        return meta["threads"]
    env = doc.get("env") if isinstance(doc.get("env"), dict) else {}
    return _count(env.get("torch_threads"))


def shared_bound(b: dict, n: dict, on: str, ratio: float, raw: float, floor: float,
                 threshold: float) -> tuple[str, str] | None:
    """Rule 1b of the module docstring, for a row that rule 1 found shared: (`regressed`, why)
    where NEW's raw time slowed beyond what sharing explains and its step ran on one thread,
    (`noisy`, why naming BEYOND_WHY) where it slowed that much on several threads (or an
    unknown count); None where sharing can explain it, or nothing bounds it (no share of NEW,
    no raw rounds, rounds that overlap, not slower): the row stays as rule 1 says."""
    s = shares(n)
    if s is None or s <= 0 or not raw > 1:
        return None
    br, nr = _values(b.get("round_ms")), _values(n.get("round_ms"))
    if len(br) < 2 or len(nr) < 2 or min(nr) <= max(br):
        return None
    moved = raw / ratio if on == "time_rel_copy" and ratio > 0 else 1.0  # NEW's copy reference over the baseline's
    if not 1 / REFERENCE_MOVED <= moved <= REFERENCE_MOVED:
        return None  # the reference stalled: nothing here measures the machine's stretch
    s = min(s, 1.0)
    f = max(floor, 1 + max(dispersion(br), dispersion(nr)))
    copy = max(1.0, moved)
    bound = max(threshold, f) * copy * (2 / s - 1)
    if raw <= bound:
        return None
    how = f"max(threshold {threshold:g}, noise floor {f:.3g})" + (f" x copy {copy:.3g}" if copy > 1 else "")
    threads = n.get("threads")
    if _count(threads) == 1:
        return "regressed", (f"{raw:.3g}x slower in time, rounds apart ({len(nr)} vs {len(br)}), beyond the "
                             f"{bound:.3g}x that a {s:.2f} CPU share can explain ({how} x (2 / {s:.2f} - 1)): the machine "
                             "was shared, but not enough to slow one thread this much")
    ran = f"NEW ran {threads} threads" if _count(threads) else "NEW's thread count is not recorded"
    return "noisy", (f"cpu share {s:.2f} below {NOISY_CPU_SHARE}: {SHARED_WHY}; {raw:.3g}x slower in time, rounds "
                     f"apart, {BEYOND_WHY} ({bound:.3g}x at that share), but {ran}, and threads that spin-wait on "
                     "a shared CPU can slow a step further: rerun on a quiet machine")


def raw_disagrees(status: str, ratio: float, raw: float) -> str | None:
    """Why a change on `time_rel_copy` is not one (rule 3): the raw time did not move its way."""
    if (status == "regressed" and raw <= 1) or (status == "improved" and raw >= 1):
        return (f"{'slower' if status == 'regressed' else 'faster'} relative to its copy ({ratio:.4g}x) but not in "
                f"time (raw {raw:.4g}x): the copy reference moved between the runs")
    return None


def judge_rows(b: dict, n: dict, field: str, threshold: float, alpha: float) -> dict:
    """The verdict fields of one timing metric (`field`, time_ms) of baseline row `b` and
    NEW row `n`: baseline, new (raw ms), ratio (on the basis), raw_ratio, basis,
    noise_floor, p_value, threshold, cpu_share, test (rounds | samples | None: what judged
    it), rounds ([Rb, Rn]), status, why, regression."""
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
           "p_value": None, "noise_floor": None, "basis": on, "test": None, "rounds": None}
    if len(br) >= 2 and len(nr) >= 2:
        ratio = (_finite_float(n.get(on)) / _finite_float(b.get(on))) if on == "time_rel_copy" else raw
        floor = 1 + max(dispersion(br), dispersion(nr))
        separated = min(nr) > max(br) if ratio > 1 else max(nr) < min(br)
        p = rank_p(br, nr, ratio > 1)
        status, why = decide(ratio, separated, floor, threshold, share,
                             f"rounds apart ({len(nr)} vs {len(br)}, p = {p:.2g} one-sided)",
                             f"rounds overlap (p = {p:.2g} one-sided)")
        moved = reference_moved(ratio, raw) if on == "time_rel_copy" else None
        if status == "noisy" and moved is None:  # shared (rule 1): unless sharing cannot explain it (1b)
            status, why = shared_bound(b, n, on, ratio, raw, floor, threshold) or (status, why)
        elif moved is not None and status != "noisy":
            status, why = "noisy", moved
        elif on == "time_rel_copy" and raw_disagrees(status, ratio, raw):
            status, why = "insignificant", raw_disagrees(status, ratio, raw)
        out.update(ratio=ratio, noise_floor=floor, p_value=p, test="rounds", rounds=[len(br), len(nr)])
    else:
        ratio, p = raw, None
        out["basis"] = "time_ms"
        if len(bs) >= 2 and len(ns) >= 2:
            from scipy.stats import mannwhitneyu

            p = float(mannwhitneyu(bs, ns, alternative="two-sided").pvalue)
            out["test"] = "samples"
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
    the same side of 1; p_value = the one-sided sign test's (`sign_p`: 1 / 2^R when
    separated); noise floor = 1 + dispersion(q)."""
    q = [nr / br for br, nr in zip(base_rounds, new_rounds) if br > 0 and nr > 0]
    if not q:
        return {"status": "failed", "why": "no paired rounds", "regression": False}
    ratio = median(q)
    floor = 1 + dispersion(q)
    separated = all(x > 1 for x in q) if ratio > 1 else all(x < 1 for x in q)
    p = sign_p(q, ratio > 1)
    status, why = decide(ratio, separated, floor, threshold, share,
                         f"all {len(q)} paired rounds {'slower' if ratio > 1 else 'faster'} (sign test p = {p:.2g} "
                         "one-sided)", f"paired rounds disagree in sign (p = {p:.2g} one-sided)")
    return {"ratio": ratio, "noise_floor": floor, "paired_ratios": [float(f"{x:.6g}") for x in q],
            "p_value": p, "test": "paired", "rounds": [len(q), len(q)], "cpu_share": share, "threshold": threshold,
            "status": status, "why": why, "regression": status == "regressed"}
