"""The CPU path's threads beside torch's: a qstate step right after one of torch's parallel ops.

At more than one thread, torch's OpenMP workers keep spinning for a while after each parallel
op (libgomp's default wait policy), on the cores the step's pool threads need next. This
script times one optimizer step over one fp32 tensor in four situations, and a small training
iteration (matmul forward, backward, step) with torch's fused AdamW and with qstate:

    alone             steps back to back, nothing else running
    after torch op    a parallel torch op (x.mul_(1.0) over the tensor) right before each step
    ... + 2 ms        the same with a 2 ms pause between them
    after 20 ms idle  a 20 ms pause before each step

Run it as is, then under OMP_WAIT_POLICY=PASSIVE (or GOMP_SPINCOUNT=10000), which libgomp reads
when torch loads it, to compare (docs/cpu.md, "Two threads beside torch's"). A benchmark, not
a test: it prints medians of wall and CPU (all threads) milliseconds.

    python scripts/cpu_threads.py [--numel 4194304] [--preset sr-4bit] [--steps 60] [--batch 32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from qstate_cli.optim import AdamW


def timed(step, before=None, pause: float = 0.0, steps: int = 60) -> tuple[float, float]:
    """(median wall ms, median CPU ms of the process) of step(), each after before() and a pause."""
    wall, cpu = [], []
    for _ in range(steps):
        if before is not None:
            before()
        if pause:
            time.sleep(pause)
        c, t = time.process_time(), time.perf_counter()
        step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=4194304)
    ap.add_argument("--preset", default="sr-4bit")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32, help="rows of the training iteration's input")
    args = ap.parse_args()
    policy = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    print(f"torch threads {torch.get_num_threads()}, {args.numel} fp32 elements, {args.preset}, "
          f"env {policy or 'default'}")
    p = torch.nn.Parameter(torch.randn(args.numel))
    p.grad = torch.randn(args.numel)
    opt = AdamW([p], states=args.preset)
    opt.step()  # the first step compiles (or loads) the kernel
    x = torch.randn(args.numel)
    for label, before, pause in (("alone", None, 0.0), ("after torch op", lambda: x.mul_(1.0), 0.0),
                                 ("after torch op + 2 ms", lambda: x.mul_(1.0), 0.002),
                                 ("after 20 ms idle", None, 0.02)):
        wall, cpu = timed(opt.step, before, pause, args.steps)
        print(f"  step {label:22s} {wall:6.2f} ms wall  {cpu:6.2f} ms cpu")
    side = int(args.numel ** 0.5)
    data = torch.randn(args.batch, side)
    for name, make in (("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, fused=True)),
                       (f"qstate {args.preset}", lambda ps: AdamW(ps, states=args.preset))):
        layer = torch.nn.Linear(side, side, bias=False)
        step_opt = make(list(layer.parameters()))

        def iteration():
            layer(data).square().mean().backward()
            step_opt.step()
            step_opt.zero_grad()

        iteration()
        wall, cpu = timed(iteration, steps=args.steps)
        print(f"  train iteration, {name:20s} {wall:6.2f} ms wall  {cpu:6.2f} ms cpu")


if __name__ == "__main__":
    main()
