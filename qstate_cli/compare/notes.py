"""The notes of a compare verdict (markdown list and meta.notes): what the table alone
does not say about how far its timing verdicts can be trusted.

- `timing_notes`: how many timing rows were `noisy` (not judged) and why; when all were,
  that the verdict says nothing about speed; first, by name, the noisy rows that slowed
  beyond what sharing explains if single-threaded (noise.py, rule 1b) but ran on several
  threads: not judged, but no run to pass quietly either (rerun on a quiet machine);
- `chance_notes`: the false regressions to expect between identical code: each judged
  (not noisy) timing row's test has a fixed chance of calling identical code slower
  (noise.null_chance: 1 / C(Rb + Rn, Rb) for full separation of the rounds, 1 / 2^R for
  R paired rounds of one sign), so E = sum of them over the judged rows; and how many
  rows had no rounds and were judged by Mann-Whitney on samples taken as independent draws
  (a shared or drifting machine breaks that: an A/A probe failed 14 of 20 pairs);
- `run_notes`: each difference between the runs' `env` or bench `meta` that changes timing
  (machine, versions, torch threads, bench options): a ratio then compares those too.
  A different git_sha is the point of a compare, and says nothing;
- `moved_paths`, `moved_reason`, `path_notes`: rows that ran on another code path in NEW
  (kernels' `path`: cpu-numba in the baseline, reference in NEW where numba is missing)
  are missing and new, as rows match by path; these say so, and what env.numba says.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from ..kinds import KINDS
from ..report.labels import show
from .metrics import COMPARED as TIMED, compared_kinds, metrics  # a timing row measured on both sides
from .noise import BEYOND_WHY, NOISY_CPU_SHARE, REFERENCE_MOVED, REFERENCE_WHY, null_chance

JUDGED = ("regressed", "improved", "same", "insignificant")


def is_timing(rec: dict) -> bool:
    """Whether a verdict record is of a timing metric (kernels' time_ms)."""
    kind = rec.get("kind")
    return kind in compared_kinds() and any(m.timing and m.field == rec.get("metric") for m in metrics(kind))


def timing_notes(records: list[dict], strict: bool = False) -> list[str]:
    """The note saying how many timing rows measured on both sides were noisy (not judged)
    and why; when all of them were, that the verdict says nothing about timing."""
    timed = [r for r in records if is_timing(r) and r["status"] in TIMED]
    noisy = [r for r in timed if r["status"] == "noisy"]
    if not noisy:
        return []
    return beyond_notes(noisy) + _noisy_notes(timed, noisy, strict)


BEYOND_SHOWN = 3  # rows named in the note of rows slowed beyond what sharing explains


def beyond_notes(noisy: list[dict]) -> list[str]:
    """The note naming the noisy rows that slowed beyond what sharing explains if
    single-threaded (noise.shared_bound) but ran on several threads."""
    beyond = [r for r in noisy if BEYOND_WHY in str(r.get("why"))]
    if not beyond:
        return []
    shown = [f"{r['kind']}: {r['name']}" + (f" ({r['raw_ratio']:.3g}x)" if r.get("raw_ratio") else "")
             for r in beyond[:BEYOND_SHOWN]]
    more = f" and {len(beyond) - BEYOND_SHOWN} more" if len(beyond) > BEYOND_SHOWN else ""
    many = len(beyond) > 1
    return [f"{_rows(len(beyond))} slowed {BEYOND_WHY}, every round apart: {'; '.join(shown)}{more}; but "
            f"{'each' if many else 'it'} ran on several threads (or on a count not recorded), which spin-wait on a "
            f"shared CPU and can slow a step further, so {'they stay' if many else 'it stays'} noisy, not judged: "
            "rerun on a quiet machine (or bench with --threads 1, where the bound holds)"]


def _noisy_notes(timed: list[dict], noisy: list[dict], strict: bool) -> list[str]:
    moved = sum(REFERENCE_WHY in str(r.get("why")) for r in noisy)
    why = ", ".join(f"{n} {what}" for n, what in (
        (len(noisy) - moved, f"timed on a shared CPU with cpu share below {NOISY_CPU_SHARE:g}"),
        (moved, f"beside a same-run copy reference that moved more than {REFERENCE_MOVED:g}x between the runs")) if n)
    if len(noisy) < len(timed):
        return [f"{len(noisy)} of {len(timed)} timing rows could not be judged ({why}): status noisy, "
                + ("each a regression under --strict-timing" if strict else "no verdict either way on their times")]
    which = ("the one timing row could not be judged" if len(timed) == 1 else
             f"none of the {len(timed)} timing rows could be judged")
    return [f"timing NOT judged: {which} ({why}), so this verdict says nothing about speed; "
            + ("--strict-timing counts each as a regression" if strict else
               "rerun on a quiet machine, or add --strict-timing on a dedicated runner to fail such a run")]


def timing_unjudged(records: list[dict]) -> bool:
    """Timing rows were measured on both sides, and every one of them is noisy."""
    timed = [r for r in records if is_timing(r) and r["status"] in TIMED]
    return bool(timed) and all(r["status"] == "noisy" for r in timed)


def _rows(n: int) -> str:
    return f"{n} timing row{'s' * (n != 1)}"


def _test(test: str, rb: int, rn: int) -> str:
    if test == "paired":
        return f"all {rb} paired rounds of one sign"
    return f"separation of {rb} rounds" if rb == rn else f"separation of {rb} vs {rn} rounds"


def chance_notes(records: list[dict]) -> list[str]:
    """The expected false regressions between identical code over the judged timing rows, and
    the rows judged without rounds (module docstring)."""
    judged = [r for r in records if is_timing(r) and r["status"] in JUDGED]
    groups = Counter((r["test"], *r["rounds"]) for r in judged if null_chance(r) is not None)
    notes = []
    if groups:
        chance = {g: null_chance({"test": g[0], "rounds": g[1:]}) for g in groups}
        expected = sum(n * chance[g] for g, n in groups.items())
        total = sum(groups.values())
        if len(groups) == 1:
            (g, n), = groups.items()
            what = (f"{_rows(n)} judged by {_test(*g)}, {'each ' * (n > 1)}with a 1-in-{round(1 / chance[g])} "
                    "chance of calling identical code slower")
        else:
            parts = "; ".join(f"{n} by {_test(*g)}: 1 in {round(1 / chance[g])}" for g, n in sorted(groups.items()))
            what = f"{_rows(total)} judged ({parts}), each with that chance of calling identical code slower"
        hint = ""
        if any(t == "rounds" and max(rb, rn) < 5 for t, rb, rn in groups):
            hint = "; --rounds 5 makes it 1 in 252 a row"
        elif any(t == "paired" and rb < 8 for t, rb, _ in groups):
            hint = "; --rounds 8 makes it 1 in 256 a row"
        notes.append(f"{what}: about {expected:.2g} false regression{'s' * (expected != 1)} expected between "
                     f"identical code if the machine keeps its speed from run to run (more where it drifts){hint}")
    samples = sum(r.get("test") == "samples" for r in judged)
    if samples:
        notes.append(f"{_rows(samples)} without rounds (older files, or `bench kernels --rounds 1`) judged by "
                     "Mann-Whitney on samples_ms taken as independent draws, which a shared or drifting machine "
                     "breaks: bench with --rounds 3 or more")
    return notes


# What differs between two runs and changes their times: (where, key, how a note says it).
MACHINE = ("device", "device_name")
ENV = (("torch", "torch"), ("triton", "triton"), ("python", "python"), ("cuda", "CUDA"), ("cpu_isa", "CPU ISA"))
BENCH = ("warmup_ms", "rep_ms", "rounds", "copy_numel", "cuda_graph")


def _values(docs: list[dict], get) -> set[str]:
    out = set()
    for d in docs:
        v = get(d)
        if v is not None:
            out.add(show(v))
    return out


def _bench(d: dict, key: str):
    """A bench option of a document: its meta's (the value every point shares, in a suite run),
    else its meta.options' (a `bench kernels` file)."""
    meta = d.get("meta") or {}
    options = meta.get("options")
    return meta.get(key) if key in meta else options.get(key) if isinstance(options, dict) else None


def _machine(d: dict) -> str | None:
    env = d.get("env") or {}
    if env.get("device") is None:
        return None
    return f"{env['device']} ({env['device_name']})" if env.get("device_name") else str(env["device"])


def run_notes(base_docs: list[dict], new_docs: list[dict], kinds) -> list[str]:
    """A note per difference between BASELINE's and NEW's documents of the timing `kinds` in
    what changes a time (module docstring); a side without the field says nothing."""
    base = [d for d in base_docs if d.get("kind") in kinds]
    new = [d for d in new_docs if d.get("kind") in kinds]
    if not base or not new:
        return []
    notes = []

    def differ(get, say) -> None:
        b, n = _values(base, get), _values(new, get)
        if b and n and b != n:
            notes.append(say(", ".join(sorted(b)), ", ".join(sorted(n))))

    differ(_machine, lambda b, n: f"BASELINE was timed on {b}, NEW on {n}: timing ratios compare machines, not code")
    for key, name in ENV:
        differ(lambda d, k=key: (d.get("env") or {}).get(k), lambda b, n, name=name: (
            f"BASELINE was timed with {name} {b}, NEW with {name} {n}: timing ratios measure that change too, "
            "not the code alone"))
    differ(lambda d: (d.get("env") or {}).get("torch_threads"), lambda b, n: (
        f"BASELINE ran torch on {b} threads, NEW on {n}: timing ratios compare thread counts, not code"))
    for key in BENCH:
        differ(lambda d, k=key: _bench(d, k), lambda b, n, key=key: (
            f"BASELINE was benched with {key} {b}, NEW with {key} {n}: timing ratios measure the bench settings "
            "too, not the code alone"))
    return notes


def missing_device(row: dict, new_devices: set) -> str | None:
    """Why a baseline row has no NEW counterpart when NEW ran on other devices only (rows
    are matched by device): None when NEW has rows of its device, or none at all."""
    device = row.get("device")
    if device is None or not new_devices or show(device) in new_devices:
        return None
    return f"NEW has no {show(device)} rows (it ran on {', '.join(sorted(new_devices))}): rows match by device"



def moved_paths(kind: str, only_base: list, only_new: list) -> dict:
    """{key: (path, the other side's paths)} for each key (identity.keyed_rows) that one side
    has alone and that equals a key the other side has alone in every identity field but
    `path` (kernels): the same measurement on another code path, which compare cannot pair
    (rows match by path), but should not leave unexplained: a fresh run without numba gave
    6 rows "not in NEW" beside 6 "not in the baseline"."""
    fields = KINDS[kind].identity
    if "path" not in fields:
        return {}
    i = fields.index("path")

    def rest(key):
        return key[0][:i] + key[0][i + 1:], key[1]

    out = {}
    for mine, other in ((only_base, only_new), (only_new, only_base)):
        theirs = defaultdict(set)
        for key in other:
            theirs[rest(key)].add(key[0][i])
        for key in mine:
            if rest(key) in theirs:
                out[key] = (key[0][i], sorted(theirs[rest(key)]))
    return out


def _numba_hint(base_paths, new_paths) -> str:
    """Where only one side ran the fused CPU path (cpu-numba), the likely reason ("" else)."""
    if "cpu-numba" in base_paths and "cpu-numba" not in new_paths:
        return "numba missing in NEW?"
    if "cpu-numba" in new_paths and "cpu-numba" not in base_paths:
        return "numba missing in the baseline?"
    return ""


def moved_reason(side: str, subject: str, path: str, others: list[str]) -> str:
    """Why a row of `side` (baseline: missing in NEW; NEW: new) has no counterpart: the
    other side ran `subject` (the row's name field) on `others` (moved_paths)."""
    base, new = ([path], others) if side == "baseline" else (others, [path])
    hint = _numba_hint(base, new)
    return (f"NEW ran {subject} on [{', '.join(new)}], the baseline on [{', '.join(base)}]"
            f"{': ' + hint if hint else ''} (rows match by path)")


def path_notes(moves: list[tuple[str, str, tuple[str, ...]]], base_docs: list[dict],
               new_docs: list[dict]) -> list[str]:
    """One note per (kind, baseline path, NEW paths) of the rows that moved (one per baseline
    row), with each side's env.numba where the two differ (null: not installed)."""
    notes = []
    for (kind, b, n), count in sorted(Counter(moves).items()):
        numba = ""
        if "cpu-numba" in (b, *n):
            seen = [sorted({"null" if d["env"]["numba"] is None else show(d["env"]["numba"]) for d in docs
                            if d.get("kind") == kind and "numba" in (d.get("env") or {})})
                    for docs in (base_docs, new_docs)]
            if all(seen) and seen[0] != seen[1]:
                numba = f"; env.numba: baseline {', '.join(seen[0])}, NEW {', '.join(seen[1])}"
        hint = _numba_hint([b], n)
        notes.append(f"{count} {kind} row{'s' * (count != 1)} ran on another code path, [{b}] in the baseline and "
                     f"[{', '.join(n)}] in NEW{f' ({hint})' if hint else ''}: each is missing in NEW and new, not "
                     f"compared, as rows match by path{numba}")
    return notes
