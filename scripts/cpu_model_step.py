"""Benchmark (not a test): the CPU path's optimizer step on the models `bench train` uses,
beside torch's fused AdamW (docs/cpu.md, "One launch per step").

    python scripts/cpu_model_step.py [--models tiny-lm small-lm] [--presets nearest-4bit sr-4bit]
                                     [--threads 1] [--reps 200] [--min-quant-numel 0]

For each model's parameters (random gradients, kept between steps), the median wall time of
`opt.step()` over --reps steps after 3 warm-up steps, and of it the time inside the kernel
calls (kernels/cpu/adamw.run_members); then a training loop on tiny-lm (a real forward and
backward before each step, `zero_grad()` after it: gradients allocated anew every step), the
median of `step()` + `zero_grad()` over 50 steps after 10.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qstate_cli.kernels.cpu import adamw
from qstate_cli.models import tiny_lm
from qstate_cli.optim import AdamW

# the kernel calls timed: one per launch (host.run_members); one per tensor before 450e3a1 (run_blocks),
# so the script also measures the previous code in a worktree
KERNEL_CALL = "run_members" if hasattr(adamw, "run_members") else "run_blocks"


def build_opt(params, preset: str, min_quant_numel: int):
    if preset == "torch-fused":
        return torch.optim.AdamW(params, fused=True)
    return AdamW(params, states=preset, backend="cpu", min_quant_numel=min_quant_numel)


def step_times(model: str, preset: str, reps: int, min_quant_numel: int) -> tuple[float, float, int]:
    """(median step ms, median ms inside the kernels, tensors) on `model`'s parameters."""
    params = list(tiny_lm.build(model).parameters())
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = build_opt(params, preset, min_quant_numel)
    inside = [0.0]
    call = getattr(adamw, KERNEL_CALL)

    def timed(*args):
        t = time.perf_counter()
        out = call(*args)
        inside[0] += time.perf_counter() - t
        return out

    setattr(adamw, KERNEL_CALL, timed)
    try:
        for _ in range(3):
            opt.step()
        steps, kernels = [], []
        for _ in range(reps):
            inside[0] = 0.0
            t = time.perf_counter()
            opt.step()
            steps.append(time.perf_counter() - t)
            kernels.append(inside[0])
    finally:
        setattr(adamw, KERNEL_CALL, call)
    return statistics.median(steps) * 1e3, statistics.median(kernels) * 1e3, len(params)


def training_loop(preset: str, min_quant_numel: int) -> tuple[float, float]:
    """(median forward+backward ms, median step()+zero_grad() ms) of tiny-lm training."""
    torch.manual_seed(0)
    model = tiny_lm.build("tiny-lm")
    opt = build_opt(list(model.parameters()), preset, min_quant_numel)
    x = torch.randint(0, 64, (16, 64))
    fwd, step = [], []
    for i in range(60):
        t0 = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if i >= 10:
            fwd.append(t1 - t0)
            step.append(t2 - t1)
    return statistics.median(fwd) * 1e3, statistics.median(step) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-lm", "small-lm"])
    ap.add_argument("--presets", nargs="+", default=["nearest-4bit", "sr-4bit"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--min-quant-numel", type=int, default=0, help="bench train's default: 0")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {args.threads}, min_quant_numel {args.min_quant_numel}, median of {args.reps} steps (ms)")
    for model in args.models:
        for preset in args.presets + ["torch-fused"]:
            step, inside, n = step_times(model, preset, args.reps, args.min_quant_numel)
            kernels = "" if preset == "torch-fused" else f", in the kernels {inside:6.3f}"
            print(f"{model} ({n} tensors) {preset:>13}: step {step:6.3f}{kernels}")
    for preset in args.presets + ["torch-fused"]:
        fwd, step = training_loop(preset, args.min_quant_numel)
        print(f"tiny-lm training loop {preset:>13}: forward+backward {fwd:6.2f}, step+zero_grad {step:6.3f}")


if __name__ == "__main__":
    main()
