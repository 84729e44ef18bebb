"""The instruction budget of a memory-bound fused step on an H200, and a static prediction.

A fused step keeps pace with memory when the SMs issue its instructions at least as fast
as the memory system moves its bytes. Per element, at copy bandwidth W (bytes/s) and
issue rate I (thread instructions/s):

    elements/s the memory allows   W / bytes_per_elem
    budget (instructions/elem)     I / (W / bytes_per_elem) = (I / W) * bytes_per_elem
    predicted copy fraction        min(1, budget / sass_per_elem)      (the issue model)

H200 figures (/work/.library/device, read on this workplace's H200 machines, 2026-10/11):
W = 4.3e12 B/s (a device-to-device copy through PyTorch, bytes read + written; the
datasheet's 4.8 TB/s is not reached by a copy); 132 SMs (PyTorch's multiprocessor count);
4 schedulers per SM, each issuing one warp instruction per clock; 1.98 GHz (the SM clock
nvidia-smi read under load, 1980 MHz). So I = 132 * 4 * 1.98e9 * 32 = 3.345e13 thread
instructions/s, I / W = 7.78 instructions per byte, and the budget is 63.2 at 8.125 B/elem
(4-bit AdamW, bf16 p and g) and 109.9 at 14.125 B/elem (fp32 p and g).

What the model leaves out (so the prediction is an upper bound on the issue side): the
integer/logic pipe and compares run at half the issue rate on Hopper (64 lanes/clock/SM
against 128 for fp32 add/mul), conversions and MUFU at 1/8; latency hiding needs enough
warps in flight; and the clock under a long memory-bound run may differ from 1.98 GHz.
A prediction, never a measurement: `bench headline` and `bench kernels` measure.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..quant import parse_config
from .bytes_model import bytes_per_element, dtype_bytes


@dataclass(frozen=True)
class Device:
    name: str
    copy_bytes_per_s: float
    sms: int
    schedulers_per_sm: int
    clock_hz: float
    warp: int = 32

    @property
    def thread_instructions_per_s(self) -> float:
        return self.sms * self.schedulers_per_sm * self.clock_hz * self.warp

    def budget(self, bytes_per_elem: float) -> float:
        """SASS instructions per element that keep pace with a copy: (I / W) * bytes."""
        return self.thread_instructions_per_s / self.copy_bytes_per_s * bytes_per_elem


H200 = Device("H200 (sm_90)", copy_bytes_per_s=4.3e12, sms=132, schedulers_per_sm=4, clock_hz=1.98e9)


def predicted_copy_fraction(sass_per_elem: float, bytes_per_elem: float, device: Device = H200) -> float:
    """min(1, budget / sass_per_elem): the share of copy bandwidth the issue model allows."""
    return min(1.0, device.budget(bytes_per_elem) / sass_per_elem)


# (kernel, states, parameter dtype): every fused 4-bit variant the report covers
ADAMW_STATES = ("nearest-4bit", "sr-4bit", "bred-4bit")
ONE_STATE = "m=int4:bred:b128"
VARIANTS = ([("adamw", s, d) for s in ADAMW_STATES for d in ("bf16", "fp32")]
            + [(k, ONE_STATE, d) for k in ("lion", "sgd", "muon") for d in ("bf16", "fp32")])


def kernel_bytes_per_element(kernel: str, states: str, param_dtype: str) -> float:
    """Bytes a launch moves per element: 2p + g + states (AdamW, Lion, SGD); Muon's momentum
    kernel reads g and writes an fp32 update instead of touching the parameter: g + 4 + states."""
    conf = parse_config(states)
    specs = [conf.m, conf.v] if kernel == "adamw" else [conf.m]
    p = dtype_bytes(param_dtype)
    if kernel == "muon":
        return bytes_per_element(0, p, specs) + 4
    return bytes_per_element(p, p, specs)


def record(kernel: str, states: str, param_dtype: str, by_class: dict, geometry: dict,
           device: Device = H200) -> dict:
    """One flat record: counts per element by class, bytes, budget and the prediction."""
    sass = sum(by_class.values())
    nbytes = kernel_bytes_per_element(kernel, states, param_dtype)
    out = {"kernel": kernel, "states": states, "param_dtype": param_dtype, "kind": "prediction",
           "sass_per_elem": round(sass, 2)}
    out.update({f"{k}_per_elem": round(v, 2) for k, v in by_class.items()})
    out.update({"bytes_per_elem": round(nbytes, 4), "budget_per_elem": round(device.budget(nbytes), 1),
                "predicted_copy_fraction": round(predicted_copy_fraction(sass, nbytes, device), 3),
                "device_model": device.name, "tiles_per_program": geometry["tiles"],
                "elems_per_thread": geometry["elems_per_thread"], "block": geometry["block"]})
    return out


def prediction_key(kernel: str, states: str, param_dtype: str) -> tuple:
    """(kernel, states as the kernel sees them, dtype): AdamW's m and v; one-state kernels' m."""
    conf = parse_config(states)
    return kernel, conf.canonical() if kernel == "adamw" else str(conf.m), param_dtype


def beside(measured: list[dict], predictions: list[dict]) -> list[dict]:
    """Measured `kernels` rows (bench headline / bench kernels) that a prediction covers,
    each with the measured share of copy and the predicted one side by side (the
    prediction keeps its own columns: predicted_*). Only rows the compiled Triton kernels
    stepped (path "triton"): a row that fell back to the reference, or ran in Triton's
    interpreter, is not what the SASS counts predict. A cache-resident row has no measured
    share (None)."""
    pred = {prediction_key(p["kernel"], p["states"], p["param_dtype"]): p for p in predictions}
    out = []
    for r in measured:
        if r.get("status") != "ok" or not r.get("optimizer") or not r.get("config") or r.get("path") != "triton":
            continue
        p = pred.get(prediction_key(r["optimizer"], r["config"], r.get("param_dtype")))
        if p is None:
            continue
        out.append({"name": r["name"], "kernel": p["kernel"], "states": p["states"], "param_dtype": p["param_dtype"],
                    "path": r.get("path"), "timing": r.get("timing"), "measured_pct_of_copy": r.get("pct_of_copy"),
                    "measured_gbps": r.get("gbps"), "predicted_pct_of_copy": 100 * p["predicted_copy_fraction"],
                    "predicted_sass_per_elem": p["sass_per_elem"], "predicted_budget_per_elem": p["budget_per_elem"]})
    return out
