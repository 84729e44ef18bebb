"""Benchmark (not a test): one AdamW step on one fp32 tensor on the CPU, qstate's fused CPU
path against torch fused AdamW, torchao AdamW4bit and bitsandbytes AdamW8bit in the same
run; median wall time of `--reps` steps after two warm-up steps (the first compiles).

    python scripts/bench_cpu.py [--numel 4194304] [--reps 10]

Prints ms/step and the ratio to torch fused AdamW; peers that do not import are skipped
with the reason. The machine may be shared: the load average is printed with the numbers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from qstate_cli.optim import AdamW


def median_ms(opt, reps: int) -> float:
    opt.step()
    opt.step()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def subjects():
    yield "torch AdamW fused (fp32 states)", lambda ps: torch.optim.AdamW(ps, fused=True), "torch-fused"
    for preset in ("nearest-4bit", "sr-4bit", "bred-4bit", "torchao-4bit", "bnb-8bit"):
        yield f"qstate {preset}", (lambda pr: lambda ps: AdamW(ps, states=pr, backend="cpu"))(preset), None
    yield "torchao AdamW4bit (compiled)", lambda ps: __import__("torchao.optim").optim.AdamW4bit(ps), "torchao"
    yield "bitsandbytes AdamW8bit", lambda ps: __import__("bitsandbytes").optim.AdamW8bit(ps), "bnb"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=4194304)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    print(f"numel {args.numel}, fp32, torch threads {torch.get_num_threads()}, load average before {os.getloadavg()}")
    base = None
    print(f"{'optimizer':34s} {'path':12s} {'ms/step':>9s} {'x torch fused':>14s}")
    for name, build, path in subjects():
        p = torch.nn.Parameter(torch.randn(args.numel))
        p.grad = torch.randn(args.numel)
        try:
            opt = build([p])
            path = path or opt.path_for(p)
            ms = median_ms(opt, args.reps)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is skipped, with why
            print(f"{name:34s} skipped: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        base = base or ms
        print(f"{name:34s} {path:12s} {ms:9.1f} {ms / base:14.1f}")
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
