"""Benchmark (not a test): the replay's fused CPU codec alone (kernels/cpu/replay.py), ns per
element of one encode + read back, one thread, per state spec (docs/diagnose.md, "The
replay codec without reference counts").

    PYTHONPATH=$PWD python scripts/bench_replay_codec.py int4:bred:b128 lin4nz:bred:b128 bf16:nearest
        [--numel 262144] [--steps 100] [--calls 40]

The layout is that of scripts/bench_replay.py's synthetic trace (4 x --numel recorded
elements, recorded once into qstate's cache folder), the state is encoded from |N(0, 1)| *
1e-3 at a new step each call (new random bits, the same work), and the number is the
minimum over --calls calls of the thread CPU time divided by the layout's elements. The
first call compiles (or loads from numba's disk cache) and is not timed.
"""
from __future__ import annotations

import argparse
import time

import torch

from bench_replay import synthetic_trace
from qstate_cli.diagnose.layout import Layout
from qstate_cli.errors import QstateError
from qstate_cli.diagnose.step import stream_for
from qstate_cli.kernels.cpu import replay as cpu_replay
from qstate_cli.quant import parse_spec
from qstate_cli.trace import load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+", help="state specs, e.g. int4:bred:b128 lin4nz:stochastic:b128 bf16:nearest")
    ap.add_argument("--numel", type=int, default=262144)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    layout = Layout(load_trace(synthetic_trace(args.numel, args.steps)), 128, "cpu")
    x = torch.randn(layout.n, generator=torch.Generator().manual_seed(0)).abs() * 1e-3
    for text in args.specs:
        try:
            spec = parse_spec(text)
        except QstateError as exc:
            print(f"{text:28s} {exc}")
            continue
        state, why = cpu_replay.fused_state(spec, layout, stream_for(layout, spec, 0, 1))
        if state is None:
            print(f"{text:28s} reference path: {why}")
            continue
        state.encode(x, 1)
        times = []
        for step in range(2, args.calls + 2):
            t = time.thread_time()
            state.encode(x, step)
            times.append(time.thread_time() - t)
        print(f"{text:28s} {layout.n:,} elements: {min(times) * 1e9 / layout.n:.2f} ns per element "
              f"(minimum of {args.calls} calls, 1 thread)")


if __name__ == "__main__":
    main()
