"""Benchmark (not a test): one AdamW step on one fp32 tensor on the CPU, qstate's fused CPU
path against torch fused AdamW, torchao AdamW4bit and bitsandbytes AdamW8bit in the same
run (or Lion / SGD with --optimizer: against torch's fused SGD with momentum, the one-state
fp32 step torch has; the peers have no 4/8-bit Lion or SGD); minimum and median wall time of `--reps` steps after two warm-up steps (the first
compiles). The subjects step in turn (one step each per round), so load from other
processes falls on all of them alike; ratios use the minimums (the least disturbed step).
The CPU columns give the process's CPU time per step (all threads): on a shared machine it
moves far less with the load than wall time does (a step that waits for a core costs wall
time, not CPU time), so its ratio is the steadier measure of the work each subject does.

    python scripts/bench_cpu.py [--numel 4194304] [--reps 10] [--presets a,b] [--no-peers]
                                [--optimizer adamw|lion|sgd]

Prints ms/step and the ratio to the torch baseline (the first row); peers that do not import are skipped
with the reason. The machine may be shared: the load average is printed with the numbers. For
AdamW a last line checks the issue's targets on the minimums (`targets`): each 4-bit preset
timed (nearest-4bit, sr-4bit, bred-4bit) at <= 2x torch fused AdamW, and faster than each peer
timed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from qstate_cli.optim import SGD, AdamW, Lion
from qstate_cli.results import host_cpus

QSTATE = {"adamw": AdamW, "lion": Lion, "sgd": SGD}


def timed_step(opt) -> tuple[float, float]:
    """(wall ms, CPU ms of the whole process: every thread's time on a core) of one step."""
    c, t = time.process_time(), time.perf_counter()
    opt.step()
    return (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3


def subjects(presets, peers: bool, optimizer: str = "adamw"):
    if optimizer == "adamw":
        yield "torch AdamW fused (fp32 states)", lambda ps: torch.optim.AdamW(ps, fused=True), "torch-fused"
    else:
        yield "torch SGD fused (fp32 momentum)", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9,
                                                                            fused=True), "torch-fused"
    cls = QSTATE[optimizer]
    label = "qstate" if optimizer == "adamw" else f"qstate {cls.__name__}"
    for preset in presets:
        yield f"{label} {preset}", (lambda pr: lambda ps: cls(ps, states=pr, backend="cpu"))(preset), None
    if not peers or optimizer != "adamw":
        return
    yield "torchao AdamW4bit (compiled)", lambda ps: __import__("torchao.optim").optim.AdamW4bit(ps), "torchao"
    yield "bitsandbytes AdamW8bit", lambda ps: __import__("bitsandbytes").optim.AdamW8bit(ps), "bnb"


TARGET_PRESETS = ("nearest-4bit", "sr-4bit", "bred-4bit")
TARGET_RATIO = 2.0
PEERS = ("torchao", "bnb")


def targets(rows: list[tuple[str, str, float]]) -> str | None:
    """The AdamW targets on rows of (name, path, minimum ms), the torch baseline first: the
    4-bit presets' worst ratio to it against TARGET_RATIO, and the slowest of them against the
    fastest peer; None when no target preset was timed."""
    base = rows[0][2]
    ours = [(n, ms) for n, path, ms in rows if path not in PEERS and n.split()[-1] in TARGET_PRESETS]
    if not ours:
        return None
    worst, worst_ms = max(ours, key=lambda r: r[1])
    line = (f"targets: 4-bit presets <= {TARGET_RATIO:g}x torch fused: "
            f"{'yes' if worst_ms / base <= TARGET_RATIO else 'NO'} (slowest {worst.split()[-1]} {worst_ms / base:.2f}x)")
    peers = [(n, ms) for n, path, ms in rows if path in PEERS]
    if peers:
        peer, peer_ms = min(peers, key=lambda r: r[1])
        line += (f"; faster than the peers: {'yes' if worst_ms < peer_ms else 'NO'} "
                 f"(fastest peer {peer} {peer_ms / worst_ms:.1f}x the slowest preset's time)")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=4194304)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--presets", default="nearest-4bit,sr-4bit,bred-4bit,torchao-4bit,bnb-8bit")
    ap.add_argument("--no-peers", action="store_true", help="skip torchao and bitsandbytes")
    ap.add_argument("--optimizer", choices=sorted(QSTATE), default="adamw",
                    help="qstate's optimizer (lion, sgd: against torch's fused SGD with momentum, no peers)")
    ap.add_argument("--settle-ms", type=float, default=50.0,
                    help="idle pause before each timed step (ms), so the previous subject's OpenMP threads "
                         "have stopped spinning")
    args = ap.parse_args()
    print(f"numel {args.numel}, fp32, {host_cpus()}, torch threads "
          f"{torch.get_num_threads()}, load average before {os.getloadavg()}")
    runs = []  # (name, path, optimizer, (wall, cpu) per step); warm-up (the first step compiles) before any timing
    for name, build, path in subjects(args.presets.split(","), not args.no_peers, args.optimizer):
        p = torch.nn.Parameter(torch.randn(args.numel))
        p.grad = torch.randn(args.numel)
        try:
            opt = build([p])
            path = path or opt.path_for(p)
            opt.step()
            opt.step()
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is skipped, with why
            print(f"{name:34s} skipped: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        runs.append((name, path, opt, []))
    for _ in range(args.reps):  # interleaved: every subject sees the same moments of a shared machine
        for _, _, opt, times in runs:
            time.sleep(args.settle_ms / 1e3)
            times.append(timed_step(opt))
    print(f"{'optimizer':34s} {'path':12s} {'min ms':>8s} {'median':>8s} {'x torch fused (min)':>20s}"
          f" {'cpu min ms':>10s} {'x torch (cpu)':>13s}")
    base, base_cpu = min(w for w, _ in runs[0][3]), min(c for _, c in runs[0][3])
    for name, path, _, times in runs:
        wall, cpu = [w for w, _ in times], [c for _, c in times]
        print(f"{name:34s} {path:12s} {min(wall):8.1f} {statistics.median(wall):8.1f} {min(wall) / base:20.2f}"
              f" {min(cpu):10.1f} {min(cpu) / base_cpu:13.2f}")
    print(f"load average after {os.getloadavg()}")
    verdict = targets([(name, path, min(w for w, _ in times)) for name, path, _, times in runs]) \
        if args.optimizer == "adamw" else None
    if verdict:
        print(verdict)


if __name__ == "__main__":
    main()
