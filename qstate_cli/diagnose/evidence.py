"""Which reset period the corpus supports for minifloat v: the staleness model's or the published one.

The staleness model's period (theory.reset_period: 90% of the steady stall probability)
comes out 1.2-6x shorter than the periods the paper reports at beta2 = 0.999 (bf16 827 vs
1000, e4m3 64 vs 300, e2m2 33 vs 200). Which to recommend is a question for the replay:
each row below is one `qstate diagnose corpus:NAME -c PRESET` (validate.py replays no reset,
the model's period and the published one against the fp32 optimizer without resets) and
records the mean relative update error |u - u_fp32| / |u_fp32| of each. docs/diagnose.md
("Which period for minifloats: the model's or the published one") shows the runs.

`supported(spec, beta)` counts, per option (no reset, the model's period, the published
one), the traces on which it had the lowest error, a period counting only where it beat no
reset by `MIN_GAIN` (validate.py's rule); the option with most traces wins (a tie goes to
the lower median error relative to no reset). Rows are keyed on the whole spec the corpus
replayed (format, rounding, block, scale, sqrt: the fp8 rows say nothing about te-fp8's
tensor scale or an unscaled e4m3). A row whose error without resets is above `BROKEN`
is no evidence: its v was read back as 0 and blew the update up, whatever the period.
Without evidence for the spec at this beta the model's period stands. `qstate diagnose` still
replays the candidates on the user's own trace (validate.py); this is the advice given
without that replay (`--skip-reset-check`, `--reset auto` excepted) and the order in which
the evidence is cited.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import theory

MIN_GAIN = 0.01  # a period pays when it lowers the update error by at least 1% relative
BROKEN = 10.0  # a mean relative update error above this without resets: a broken state, not a stale one
EVIDENCE_BETA = 0.999


@dataclass(frozen=True)
class Row:
    """One replay: the update error with no reset, a reset every `model` and every `published` steps."""

    trace: str
    config: str
    steps: int
    model: int
    published: int
    error_none: float
    error_model: float
    error_published: float

    def best(self) -> str:
        """'none', 'model' or 'published': the lowest error, a period only where it pays."""
        errors = {"model": self.error_model, "published": self.error_published}
        pick = min(errors, key=errors.get)
        return pick if errors[pick] < (1 - MIN_GAIN) * self.error_none else "none"


# canonical v spec -> rows; measured with `qstate diagnose corpus:NAME -c bf16 -c bf16-sr -c fp8 -c fp4`
# (docs/diagnose.md; every recorded step, AdamW, beta2 = 0.999; tiny-lm for bf16 only). fp8's and fp4's rows keep
# v on block-scaled grids with a zero level, and their errors without resets (12 to 8771) are over BROKEN: kept
# so the docs' table and this one agree, counted by no advice. `model` is the period replayed (bf16-sr's 776: the
# model says 777 since theory.py's quadrature weights were fixed; the advice names the model's own).
EVIDENCE: dict[str, list[Row]] = {
    "bf16:nearest": [Row("synthetic-heavy", "bf16", 3000, 827, 1000, 0.2219, 0.547, 0.3825),
                     Row("digits-cnn", "bf16", 2000, 827, 1000, 0.188, 1.76, 0.8283),
                     Row("tiny-lm", "bf16", 2000, 827, 1000, 0.04286, 0.5053, 0.4114)],
    "bf16:stochastic": [Row("synthetic-heavy", "bf16-sr", 3000, 776, 1000, 0.01969, 0.5565, 0.4007),
                        Row("digits-cnn", "bf16-sr", 2000, 776, 1000, 0.02225, 1.959, 0.9544),
                        Row("tiny-lm", "bf16-sr", 2000, 776, 1000, 0.01366, 0.506, 0.4017)],
    "e4m3:nearest:b256": [Row("synthetic-heavy", "fp8", 3000, 64, 300, 1472, 330.8, 686.3),
                          Row("digits-cnn", "fp8", 2000, 64, 300, 12.21, 29.54, 16.05)],
    "e2m2:nearest:b128": [Row("synthetic-heavy", "fp4", 3000, 33, 200, 7598, 931.9, 2875),
                          Row("digits-cnn", "fp4", 2000, 33, 200, 8771, 6035, 1.064e4)],
}


def supported(spec, beta: float, evidence=None) -> tuple[str, int | None, str] | None:
    """(option, period or None, the evidence in words) for a float v, or None without evidence."""
    evidence = EVIDENCE if evidence is None else evidence
    rows = [r for r in evidence.get(str(spec), []) if r.error_none <= BROKEN]
    if beta != EVIDENCE_BETA or not rows:
        return None
    model_period = theory.reset_period(spec, beta)
    wins = {"none": 0, "model": 0, "published": 0}
    for r in rows:
        wins[r.best()] += 1
    ratio = {"none": 1.0,
             "model": float(np.median([r.error_model / r.error_none for r in rows])),
             "published": float(np.median([r.error_published / r.error_none for r in rows]))}
    option = max(("none", "model", "published"), key=lambda o: (wins[o], -ratio[o]))
    period = {"none": None, "model": model_period, "published": rows[0].published}[option]
    shown = "; ".join(f"{r.trace} ({r.config}, {r.steps} steps): none {r.error_none:.4g}, every {r.model} "
                      f"{r.error_model:.4g}, every {r.published} {r.error_published:.4g}" for r in rows)
    said = {"none": "no reset", "model": f"the model's {model_period} steps",
            "published": f"the published {rows[0].published} steps"}[option]
    tie = sum(w == wins[option] for w in wins.values()) > 1
    text = (f"on the trace corpus {said} had the lowest update error vs fp32 on {wins[option]} of {len(rows)} "
            f"traces{' (a tie, decided by the median error relative to no reset)' if tie else ''} ({shown})")
    return option, period, text


def published_period(spec, beta: float) -> int | None:
    """The paper's period for this float format at beta2 = 0.999, else None."""
    if spec.fmt.kind == "float" and beta == EVIDENCE_BETA:
        return theory.REPORTED_PERIODS.get(spec.fmt.name)
    return None
