"""Diagnostic (not a test): the CPU path's AdamW kernel alone, one thread, and where its time
goes (docs/cpu.md, "Profile").

    python scripts/cpu_profile.py [--preset bred-4bit] [--seconds 4] [--numel 4194304] [--perf]

Times the raw kernel (kernels/cpu/adamw.kernel_for, every block of one fp32 tensor in one
call, torch threads 1) in a loop for --seconds and prints the minimum and median of its
wall time and of its thread CPU time (time.thread_time: on a shared machine a call that
waits for a core costs wall time, not CPU time, so the CPU time is the steadier measure).
With --perf, `perf record` samples this process during the loop; the kernel is JIT code
without symbols, so the script reads its machine code from memory, disassembles it
(objdump) and prints each loop (a backward jump) with its share of the samples and its most
frequent instructions, flagging the loops that hold gathers or scatters (LLVM emits them for
indexed loads and for stores through a signed index; on a Zen 4 one row's scatter was 27% of
the replay model's pass: docs/cpu.md, "Gathers and scatters"). Needs perf and objdump on PATH.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qstate_cli.kernels.cpu import adamw
from qstate_cli.optim import AdamW


def kernel_call(preset: str, numel: int):
    """(kernel, nblocks, args) of one AdamW step on a fresh fp32 tensor (after two steps):
    kernel(0, nblocks, *args) steps every block on this thread (host.run_members' part 0)."""
    calls = []
    run_members = adamw.run_members
    adamw.run_members = lambda kernel, table, block, args: calls.append((kernel, table, args)) or run_members(
        kernel, table, block, args)
    try:
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel)
        opt = AdamW([p], states=preset, backend="cpu")
        opt.step()
        opt.step()
    finally:
        adamw.run_members = run_members
    kernel, table, args = calls[-1]
    bad = np.zeros((1, len(table.first) - 1), np.int64)
    return kernel, int(table.first[-1]), (0, table.arrays, table.first, table.skeys, bad) + args, (p, opt)


def loops(samples: collections.Counter, workdir: Path) -> list[tuple[float, str]]:
    """(share of all samples, description) of each loop in the hottest JIT pages, largest first
    (a loop: the span of a backward jump shorter than 1500 bytes; overlapping spans merged)."""
    total = sum(samples.values())
    pages = collections.Counter()
    for ip, n in samples.items():
        pages[ip & ~0xFFF] += n
    hot = sorted(a for a, n in pages.items() if n > 0.005 * total and a < 1 << 47)
    spans: list[list[int]] = []
    for a in hot:  # contiguous runs of hot pages
        if spans and a - spans[-1][1] <= 0x2000:
            spans[-1][1] = a + 0x1000
        else:
            spans.append([a, a + 0x1000])
    out = []
    for lo, hi in spans:
        (workdir / "code.bin").write_bytes(ctypes.string_at(lo, hi - lo))
        asm = subprocess.run(["objdump", "-D", "-b", "binary", "-mi386:x86-64", f"--adjust-vma={lo:#x}",
                              str(workdir / "code.bin")], capture_output=True, text=True, check=True).stdout
        ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
               re.finditer(r"^\s*([0-9a-f]+):\s+(?:[0-9a-f]{2} )+\s*(\S+)\s*(.*)$", asm, re.M)]
        ranges: list[list[int]] = []  # [start, end] of each loop, from its backward jumps
        for addr, op, arg in ins:
            target = re.match(r"0x([0-9a-f]+)", arg)
            if op.startswith("j") and target and 0 < addr - int(target.group(1), 16) < 1500:
                ranges.append([int(target.group(1), 16), addr])
        merged: list[list[int]] = []  # a loop with two back edges (LLVM's rotated loops): one range
        for start, end in sorted(ranges):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            body = [o for a, o, _ in ins if start <= a <= end]
            share = sum(n for a, n in samples.items() if start <= a <= end) / total
            ops = collections.Counter(o for o in body if o.startswith("v"))
            sg = sum(n for o, n in ops.items() if "gather" in o or "scatter" in o)
            out.append((share, f"{start:#x}: {len(body)} instructions, " +
                        " ".join(f"{o} {n}" for o, n in ops.most_common(8)) +
                        (f" | {sg} gathers/scatters" if sg else "")))
    return sorted(out, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bred-4bit")
    ap.add_argument("--numel", type=int, default=4194304)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--perf", action="store_true", help="sample with perf and print the hot loops")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernel, nblocks, kargs, _keep = kernel_call(args.preset, args.numel)
    workdir = Path(tempfile.mkdtemp(prefix="qstate-cpu-profile-"))
    perf = None
    if args.perf:
        perf = subprocess.Popen(["perf", "record", "-q", "-o", str(workdir / "perf.data"), "-p", str(os.getpid())])
        time.sleep(0.5)
    wall, cpu = [], []
    end = time.time() + args.seconds
    while time.time() < end:
        c, t = time.thread_time(), time.perf_counter()
        kernel(0, nblocks, *kargs)
        wall.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.thread_time() - c) * 1e3)
    print(f"{args.preset}, {args.numel} fp32 elements, raw kernel, 1 thread, {len(wall)} calls, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"  wall ms min {min(wall):.2f} median {statistics.median(wall):.2f} | "
          f"thread CPU ms min {min(cpu):.2f} median {statistics.median(cpu):.2f}")
    if perf is None:
        return
    perf.send_signal(signal.SIGINT)
    perf.wait()
    ips = subprocess.run(["perf", "script", "-i", str(workdir / "perf.data"), "-F", "ip"],
                         capture_output=True, text=True, check=True).stdout.split()
    samples = collections.Counter(int(x, 16) for x in ips)
    for share, what in loops(samples, workdir)[:12]:
        if share >= 0.005:
            print(f"  {100 * share:5.1f}%  loop at {what}")


if __name__ == "__main__":
    main()
