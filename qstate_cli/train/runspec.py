"""What one training run of the study is: a state configuration plus per-run options.

    RUN     := CONFIG ["@" KEY "=" VALUE]...
    KEY     := reset (none | N | auto) | lr (a float)

e.g. ``nearest-4bit@reset=auto`` (nearest 4-bit with theory-guided resets) or
``fp32@lr=0.01``. CONFIG is any configuration name (`qstate formats`); `@` never occurs
in one, so the split is unambiguous. The run's label in results is normalised:
the config's name, then `@reset=...` when the run resets (also when the policy came
from `--reset`), then `@lr=...` when it has its own lr; so one label names one run.

Theory-guided resets (`reset=auto`): the period is `theory.reset_period` for the stored
state that the optimizer resets on (v for AdamW, the momentum m otherwise) at its beta.
The staleness model is written for floating formats with p fraction bits; for linear,
code-book (DE) and no-zero formats it has no model. There the study uses the model of
the float format with the same storage width that the staleness paper uses for it
(4 bits: unsigned fp4 e2m2, p = 2; 8 bits: fp8 e4m3, p = 3; 16 bits: bf16, p = 7), with
the run's own rounding. BReD never stalls in the model (no reset); fp32 has no stalls.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import QstateError
from ..optim.reset import ResetPolicy
from ..quant.config import StateConfig, StateSpec, parse_config, parse_spec

RUN_KEYS = ("reset", "lr")
STAND_IN_FLOAT = {4: "e2m2", 8: "e4m3", 16: "bf16"}  # same width, as the staleness paper stores v


@dataclass(frozen=True)
class RunSpec:
    label: str
    config: StateConfig
    reset: str = "none"  # as asked: none | N | auto
    lr: float | None = None  # None: the study's learning rate

    @classmethod
    def parse(cls, text: str, default_reset: str = "none") -> "RunSpec":
        head, *opts = [t.strip() for t in str(text).split("@")]
        cfg = parse_config(head)
        reset, lr = str(ResetPolicy.parse(default_reset)), None
        seen = set()
        for opt in opts:
            key, sep, val = opt.partition("=")
            key = key.strip().lower()
            if not sep or key not in RUN_KEYS:
                raise QstateError(f"in run {text!r}: expected @KEY=VALUE with KEY one of {', '.join(RUN_KEYS)}, "
                                  f"got {opt!r}")
            if key in seen:
                raise QstateError(f"in run {text!r}: @{key} given twice")
            seen.add(key)
            if key == "reset":
                reset = str(ResetPolicy.parse(val))
            else:
                try:
                    lr = float(val)
                except ValueError:
                    raise QstateError(f"in run {text!r}: lr must be a number, got {val!r}") from None
                if not 0 < lr < float("inf"):
                    raise QstateError(f"in run {text!r}: lr must be a positive finite number, got {val!r}")
        label = str(cfg) + (f"@reset={reset}" if reset != "none" else "") + (f"@lr={lr:g}" if lr else "")
        return cls(label, cfg, reset, lr)


def resolve_reset(spec: StateSpec, reset: str, beta: float) -> tuple[int | None, str]:
    """(period in steps or None, why) for a run's reset policy on the state `spec`."""
    policy = ResetPolicy.parse(reset)
    if not policy.auto:
        return policy.period, "none" if policy.period is None else "fixed period"
    from ..theory import fraction_bits_of, reset_period

    if spec.fmt.kind == "identity":
        return None, "fp32 states do not stall"
    if spec.rounding == "bred":
        return None, "theory: BReD does not stall"
    model_spec, basis = spec, f"theory: {spec.fmt.name} model"
    if fraction_bits_of(spec) is None:
        stand_in = STAND_IN_FLOAT.get(spec.fmt.bits)
        if stand_in is None:
            return None, f"theory: no model for {spec.fmt.name}"
        model_spec = parse_spec(f"{stand_in}:{spec.rounding}")
        basis = f"theory: {stand_in} model stands in for {spec.fmt.name} (same width)"
    period = reset_period(model_spec, beta)
    return period, basis + ("" if period else " predicts no stall build-up")
