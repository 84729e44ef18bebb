"""Which codec the replay's quantized states encode and decode through.

    backend "reference"  quant.QuantizedState: the eager reference (40-60 torch ops per
                         encode + decode; docs/diagnose.md "Replay throughput")
    backend "auto"       a fused codec where one covers the state on the layout's device,
                         bit-identical to the reference (same codes, scales and values read
                         back, so the same records); else the reference, with the reason

A fused codec is a QuantizedState subclass (same fields: codes, scales, written; same
encode(x, step) / decode() / reset()), made by the factory FUSED[device type]:
factory(spec, layout, stream, reduce_absmax) -> (state, None) or (None, why not).

The update rule goes the same way (`replay_rule`): under auto on CPU, the fused AdamW/Adam
rule (kernels/cpu/replay_rule.py, bit for bit Recursion.step), else Recursion.step.
"""
from __future__ import annotations

from typing import Callable

from ..errors import QstateError
from ..quant import QuantizedState

BACKENDS = ("auto", "reference")
REFERENCE = "reference"

# device type -> factory(spec, layout, stream, reduce_absmax) -> (state | None, why_reference | None)
FUSED: dict[str, Callable] = {}


def _triton(spec, layout, stream, reduce_absmax):
    from ..kernels import unavailable_reason
    from ..kernels.launch import why_no_codec  # neither Triton nor numba there

    why = why_no_codec(spec) or unavailable_reason(layout.device)
    if why is not None:
        return None, why
    from .codec_triton import triton_state  # imports Triton on first use

    return triton_state(spec, layout, stream, reduce_absmax)


FUSED["cuda"] = _triton  # the Triton codec kernel (codec_triton.py, kernels/codec.py)


def _cpu(spec, layout, stream, reduce_absmax):
    from ..kernels.cpu.replay import fused_state  # imports numba only when a state is covered
    return fused_state(spec, layout, stream, reduce_absmax)


FUSED["cpu"] = _cpu


def check_backend(backend: str) -> str:
    name = str(backend).strip().lower()
    if name not in BACKENDS:
        raise QstateError(f"--backend {backend}: choose auto or reference")
    return name


def replay_state(spec, layout, stream, reduce_absmax, backend: str = "auto") -> tuple[QuantizedState, str, str | None]:
    """(the state the replay stores one state in, its path, why the reference runs or None)."""
    plain = QuantizedState(spec, (layout.n,), stream, device=layout.device, reduce_absmax=reduce_absmax)
    if check_backend(backend) == REFERENCE:
        return plain, REFERENCE, "--backend reference"
    if spec.fmt.kind == "identity":
        return plain, REFERENCE, "an fp32 state is stored as is"
    factory = FUSED.get(layout.device.type)
    if factory is None:
        return plain, REFERENCE, f"no fused replay codec on {layout.device.type}"
    state, why = factory(spec, layout, stream, reduce_absmax)
    if state is None:
        return plain, REFERENCE, why
    return state, getattr(state, "PATH", "fused"), None


def replay_rule(rec, backend: str, device) -> Callable:
    """The replay's update-rule step, (g, x_hat, since, first) -> (direction, new states):
    the fused CPU rule where `backend` is auto and one covers the optimizer, else rec.step."""
    if check_backend(backend) != REFERENCE and device.type == "cpu":
        from .recursions import fused_rule  # numba is imported when the rule first steps

        rule, _ = fused_rule(rec, device)
        if rule is not None:
            return rule.step
    return rec.step
