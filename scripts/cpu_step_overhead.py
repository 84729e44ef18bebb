"""Benchmark (not a test): what a CPU-path optimizer step spends outside its numba kernels
(docs/cpu.md, "Step overhead").

    python scripts/cpu_step_overhead.py [--preset sr-4bit] [--reps 100] [--threads 1]

Per step: wall time of `opt.step()` minus the time inside the kernel calls
(kernels/cpu/adamw.run_members), median of --reps steps, for
- one tensor of 65,536 and of 4,194,304 elements, warm (steps back to back) and cold (a 64 MB
  sweep before each step, as a forward/backward leaves the caches);
- a model-like set: 4 x 1024^2, 2 x 4096 x 1024, 20 x 256^2 (the CPU path) and 8 x 1024
  (under min_quant_numel: fp32 states, which the reference steps), cold, beside torch fused
  AdamW on the same tensors;
- states no kernel takes (optim/small.py): 8 and 64 tensors of 1,024 elements under
  min_quant_numel (fp32 states), warm, stepped one by one by the reference (small.py switched
  off), together, and by torch fused AdamW, the three interleaved step by step.
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from unittest import mock

import torch

from qstate_cli.kernels.cpu import adamw
from qstate_cli.optim import AdamW, small

MODEL = [(1024, 1024)] * 4 + [(4096, 1024)] * 2 + [(256, 256)] * 20 + [(1024,)] * 8


def _params(shapes) -> list:
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    return ps


def measure(opt, reps: int, cold: bool) -> tuple[float, float]:
    """(median step ms, median ms outside the kernels) over `reps` steps."""
    inside = [0.0]
    run_members = adamw.run_members

    def timed(*args):
        t = time.perf_counter()
        out = run_members(*args)
        inside[0] += time.perf_counter() - t
        return out

    sweep = torch.zeros(1 << 24)  # 64 MB
    steps, outside = [], []
    adamw.run_members = timed
    try:
        for _ in range(reps):
            if cold:
                sweep.add_(1.0)
            inside[0] = 0.0
            t = time.perf_counter()
            opt.step()
            steps.append(time.perf_counter() - t)
            outside.append(steps[-1] - inside[0])
    finally:
        adamw.run_members = run_members
    return statistics.median(steps) * 1e3, statistics.median(outside) * 1e3


def small_tensors(preset: str, reps: int) -> None:
    """Median ms per warm step of `count` fp32-state tensors: one by one, together, torch fused."""
    for count in (8, 64):
        shapes = [(1024,)] * count
        subjects = {"one by one": AdamW(_params(shapes), states=preset),
                    "together": AdamW(_params(shapes), states=preset),
                    "torch AdamW fused": torch.optim.AdamW(_params(shapes), fused=True)}
        times = {name: [] for name in subjects}
        for rep in range(reps + 2):  # two warm-up rounds
            for name, opt in subjects.items():
                alone = name == "one by one"  # the reference's per-tensor step, as before optim/small.py
                with mock.patch.object(small, "steps_together", lambda *a: False) if alone else nullcontext():
                    t = time.perf_counter()
                    opt.step()
                    if rep >= 2:
                        times[name].append(time.perf_counter() - t)
        print(f"{count} tensors of 1,024 elements, fp32 states, warm: " + ", ".join(
            f"{name} {statistics.median(ts) * 1e3:.3f}" for name, ts in times.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sr-4bit")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.preset}, torch threads {args.threads}, median of {args.reps} steps (ms)")
    for n in (65536, 4194304):
        for cold in (False, True):
            opt = AdamW(_params([(n,)]), states=args.preset, backend="cpu")
            opt.step()
            opt.step()
            step, outside = measure(opt, args.reps, cold)
            print(f"one tensor of {n:>9,} elements, {'cold' if cold else 'warm'}: step {step:7.3f}, "
                  f"outside the kernel {outside:6.3f}")
    n = sum(torch.Size(s).numel() for s in MODEL)
    for name, build in ((f"qstate {args.preset}", lambda ps: AdamW(ps, states=args.preset, backend="cpu")),
                        ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, fused=True))):
        opt = build(_params(MODEL))
        opt.step()
        opt.step()
        step, outside = measure(opt, max(10, args.reps // 4), True)
        extra = f", outside the kernels {outside:6.3f}" if name.startswith("qstate") else ""
        print(f"{len(MODEL)} tensors, {n:,} elements, cold, {name}: step {step:7.3f}{extra}")
    small_tensors(args.preset, args.reps)


if __name__ == "__main__":
    main()
