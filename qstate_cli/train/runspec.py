"""What one training run of the study is: a state configuration plus per-run options.

    RUN     := CONFIG ["@" KEY "=" VALUE]...
    KEY     := reset (none | N | auto) | lr (a float)

e.g. ``nearest-4bit@reset=auto`` (nearest 4-bit with theory-guided resets) or
``fp32@lr=0.01``. CONFIG is any configuration name (`qstate formats`); `@` never occurs
in one, so the split is unambiguous. The run's label in results is normalised:
the config's name, then `@reset=...` when the run resets (also when the policy came
from `--reset`), then `@lr=...` when it has its own lr; so one label names one run.

Theory-guided resets (`reset=auto`): the optimizers' own rule (optim/reset.py:
auto_period), the staleness model's period for the stored state that the optimizer resets
on (v for AdamW, the momentum m otherwise) at its beta; for linear, code-book (DE) and
no-zero formats, which it has no model for, the model of the float format with the same
storage width (4 bits: unsigned fp4 e2m2, p = 2; 8 bits: fp8 e4m3, p = 3; 16 bits: bf16,
p = 7), with the run's own rounding. BReD never stalls in the model (no reset); fp32 has
no stalls.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import QstateError
from ..optim.reset import ResetPolicy, auto_period
from ..quant.config import StateConfig, StateSpec, parse_config

RUN_KEYS = ("reset", "lr")


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
    """(period in steps or None, why) for a run's reset policy on the state `spec`: the
    optimizers' own rule (optim/reset.py: auto_period)."""
    policy = ResetPolicy.parse(reset)
    if not policy.auto:
        return policy.period, "none" if policy.period is None else "fixed period"
    return auto_period(spec, beta)
