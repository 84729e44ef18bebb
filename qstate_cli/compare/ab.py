"""`qstate compare --ab BASE NEW`: time two state configurations in one process, in the
same rounds, and judge the difference (the question users ask: "is NEW slower than BASE
on this machine?").

Both configurations are rows of one `bench kernels` group per (size, dtype): built over
the same tensors and timed interleaved (bench/group.py: A B, B A, A B, ...), so round r
of BASE and round r of NEW ran back to back on the same machine state. Each round gives
a paired ratio q_r = median(NEW, round r) / median(BASE, round r), and
noise.judge_paired applies the rule of noise.py to them: ratio = median(q); regressed
or improved only when every q_r is on the same side of 1 (a one-sided sign test: p =
1/2^R, 1/32 for the default 5 rounds, the chance that identical code is called slower;
--alpha plays no part), the ratio is beyond --threshold and beyond the noise floor
1 + (max q - min q) / median q; insignificant within the threshold when the noise floor
exceeds it; noisy when the process got under 3/4 of a CPU (cpu_share), and then a
regression only with --strict-timing. The verdict is a compare Verdict: the same table,
files and exit code (1 on a regression) as `qstate compare BASE NEW`; its meta has no
`alpha`, and `timing_test` names the sign test.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..bench import kernels
from ..bench.shapes import parse_count
from ..errors import QstateError
from ..optim.registry import names_text
from ..options import Options, lower, many, option
from ..quant.config import parse_config
from ..runtime import resolve_device
from . import Verdict, apply_strict_timing, check_threshold
from .notes import chance_notes, timing_notes
from .metrics import row_name
from .noise import judge_paired, shares

AB_COPY_NUMEL = 1 << 20  # the bandwidth row every bench run starts with; not judged here


@dataclass
class ABOptions(Options):
    """`qstate compare --ab BASE NEW`."""

    COMMAND = "compare --ab"

    base: str = option("", "Baseline configuration (preset or spec).", argument=True)
    new: str = option("", "Candidate configuration (preset or spec).", argument=True)
    numel: list[int] = many("Tensor sizes (default: 2^16 on CPU, 2^24 on CUDA).", "--numel", "-n", parse=parse_count)
    dtype: list[str] = many("Parameter and gradient dtype (default fp32).")
    optimizer: str = option("adamw", f"{names_text()}.", parse=lower)
    backend: str = option("auto", "Our optimizers' backend: auto, reference, triton or cpu (the numba path).")
    device: str = option("auto", "auto, cuda or cpu.")
    rounds: int = option(5, "Paired rounds (A B, B A, ...).")
    rep_ms: float | None = option(None, "Timed repetitions per configuration, ms over all rounds (default 100).",
                                  type=float)
    threads: int | None = option(None, "CPU threads for torch (default: unchanged).", type=int)


def kernels_options(opts: ABOptions) -> kernels.KernelsOptions:
    """The `bench kernels` run that times both configurations (QstateError on bad input)."""
    for name in (opts.base, opts.new):
        parse_config(name)  # an unknown name fails here, with the closest names
    if opts.rounds < 2:
        raise QstateError(f"--rounds {opts.rounds}: A/B needs at least 2 paired rounds")
    numel = list(opts.numel) or None
    return kernels.KernelsOptions(
        optimizer=opts.optimizer, config=[opts.base, opts.new], baseline=["none"], numel=numel or [],
        dtype=list(opts.dtype) or ["fp32"], backend=[opts.backend], device=opts.device, rounds=opts.rounds,
        rep_ms=opts.rep_ms, threads=opts.threads, copy_numel=AB_COPY_NUMEL)


def _default_numel(opts: kernels.KernelsOptions) -> kernels.KernelsOptions:
    if opts.numel:
        return opts
    device = resolve_device(opts.device)
    return opts.replace(numel=[1 << 24 if device.type == "cuda" else 1 << 16])


def verdict(rows: list[dict], opts: ABOptions, threshold: float, strict_timing: bool = False) -> Verdict:
    """Pair each group's BASE and NEW rows (in that order after the copy row) and judge."""
    timed = [r for r in rows if r.get("role") != "copy"]
    records = []
    for b, n in zip(timed[0::2], timed[1::2]):
        name = f"{opts.new} vs {opts.base} " + row_name("kernels", n).split(" ", 1)[1]
        rec = {"name": name, "kind": "kernels", "metric": "time_ms", "unit": "ms", "better": "lower",
               "baseline": b.get("time_ms"), "new": n.get("time_ms"), "ratio": None, "p_value": None,
               "threshold": threshold, "raw_ratio": None, "noise_floor": None, "why": None}
        if b.get("status") != "ok" or n.get("status") != "ok":
            bad = n if n.get("status") != "ok" else b
            rec.update(status="failed", regression=n.get("status") != "ok" and b.get("status") == "ok",
                       why=f"{bad['name']}: {bad.get('status')}: {bad.get('reason')}")
        else:
            rec.update(judge_paired(b["round_ms"], n["round_ms"], threshold, shares(b, n)))
            rec["raw_ratio"] = n["time_ms"] / b["time_ms"]
        records.append(rec)
    if strict_timing:
        apply_strict_timing(records)
    share = min((r["cpu_share"] for r in timed if r.get("cpu_share") is not None), default=None)
    notes = timing_notes(records, strict_timing) + chance_notes(records) + [
        f"A/B in one process: {opts.rounds} paired rounds per size; "
        + (f"cpu share {share:.2f}" if share is not None else "cpu share not measured")]
    rule = (f"A/B: each round timed {opts.base} and {opts.new} back to back; a regression needs every paired "
            f"round ratio above 1 (a one-sided sign test: p = 1/2^{opts.rounds}), their median above {threshold:g} "
            f"and above the noise floor (1 + their relative range); a row timed on a shared CPU (cpu share below "
            f"0.75) is noisy.")
    test = (f"A/B: one-sided sign test of the {opts.rounds} paired round ratios (all above 1: p = 1/2^{opts.rounds}), "
            "beyond the threshold and the noise floor")
    return Verdict(records, threshold, None, [opts.base], [opts.new], notes, rule, strict_timing, test)


def run_ab(opts: ABOptions, threshold: float = 1.10, progress=None,
           strict_timing: bool = False) -> tuple[Verdict, dict]:
    """Time BASE and NEW in one process; returns the verdict and the kernels results document."""
    check_threshold(threshold)
    kopts = _default_numel(kernels_options(opts))
    result = kernels.execute(kopts, progress)
    doc = result.document()
    return verdict(doc["records"], opts, threshold, strict_timing), doc
