"""Benchmark (not a test): the replay's throughput per configuration, fused CPU path
(`--backend auto`) against the reference (`--backend reference`), on the demo trace and on a
large synthetic trace (docs/diagnose.md, "Replay throughput").

    PYTHONPATH=$PWD nice python scripts/bench_replay.py [--configs bred-4bit nearest-4bit] [--config-threads 2]
        [--numel 262144] [--steps 100] [--demo-steps 2000] [--repeats 3] [--backends auto reference]

Traces: `demo` (the cached demo trace, `qstate trace demo`) and a synthetic-heavy trace
(trace/recipes.HeavyTailedGradients: 4 tensors of --numel elements, so 4 x 262144 =
1,048,576 recorded elements per step, --steps steps, bf16 gradients), recorded once and
cached in qstate's cache folder (runtime.cache_dir) next to the demo trace.

For each trace and backend, diagnose.run.diagnose replays the configurations together
(profile on: every statistic and the staleness model, as `qstate diagnose --profile`), each
repeat in another order (`rotated`: the first configuration of a replay step is slower; since
2026-12-07 the replay also starts each step at the next configuration, replay.step_order);
a configuration's throughput is

    M element-steps/s = recorded elements x steps / (seconds of its own phase) / 1e6

(its phase: rule step, encode + read back, statistics, staleness model; the gradient
gather and the fp32 shadow are shared by all configurations and printed as their own
rows), per wall second and per CPU second of the process (all threads; on a machine other
jobs share, the steadier of the two). With --repeats R each number is the median of R
replays. The last column is the ratio auto / reference of the wall throughputs. Two lines
give the machine's state before and after the timed replays (host_now: copy bandwidth and
CPU share): the same code's M/s moved 20-30% from run to run on one host. numba's first compilation (cached on disk) is
paid by a short warm-up replay of each trace before anything is timed (warming up on the demo
alone left the large trace's own kernels to load or compile inside its first timed replay,
charged to its first configuration: nearest-4bit read 55-58 M instead of ~100). A last line
per trace checks the issue's target on the `auto` backend's wall rates (`targets`): every
configuration at >= 100 M element-steps/s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from qstate_cli import __version__, runtime
from qstate_cli.diagnose import replay as replay_module
from qstate_cli.diagnose.run import diagnose, select_configs
from qstate_cli.results import host_cpus
from qstate_cli.runtime import cache_dir
from qstate_cli.trace import load_trace
from qstate_cli.trace.recipes import SYNTH_TENSORS, record_synthetic


def synthetic_trace(numel: int, steps: int, folder: Path | None = None) -> Path:
    """The cached synthetic-heavy trace of SYNTH_TENSORS x numel elements and `steps` steps."""
    folder = folder or cache_dir()
    path = folder / f"bench-synthetic-heavy-{SYNTH_TENSORS}x{numel}-{steps}steps-seed0-qstate{__version__}.pt"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.pt")
        print(f"recording {path.name} (once)", file=sys.stderr)
        record_synthetic(tmp, steps, 0, numel=numel)
        tmp.replace(path)
    return path


class CpuTimer(runtime.Timer):
    """runtime.Timer that also sums the process's CPU seconds per phase (all threads): on a
    machine shared with other jobs a phase that waits for a core costs wall time, not CPU."""

    last: "CpuTimer | None" = None
    per_thread = False  # --config-threads > 1: a phase's CPU seconds are its own thread's (time.thread_time)

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.cpu: dict[str, float] = {}
        CpuTimer.last = self

    @contextmanager
    def __call__(self, name: str):
        clock = time.thread_time if self.per_thread else time.process_time
        c0 = clock()
        with super().__call__(name):
            yield
        took = clock() - c0
        with self._lock:  # --config-threads > 1 times phases side by side (runtime.Timer's lock)
            self.cpu[name] = self.cpu.get(name, 0.0) + took


def time_replay(trace, configs, backend: str, steps: int | None, config_threads: int = 1) -> dict:
    """One replay: {phase: wall seconds}, {phase: CPU seconds}, element-steps, wall and CPU
    seconds of the step loop."""
    _, raw = diagnose(trace, configs, steps_limit=steps, device="cpu", profile_phases=True, backend=backend,
                      config_threads=config_threads)
    return {"phases": dict(raw.timings_s), "cpu": dict(CpuTimer.last.cpu),
            "element_steps": raw.layout.n_valid * raw.n_steps, "wall": raw.wall_s, "loop_cpu": raw.cpu_s,
            "codec": {str(c.cfg): c.codec for c in raw.configs}}


def rotated(configs: list, r: int) -> list:
    """The configurations starting at the r-th (mod their count): repeat r's order (the
    rotation replay.step_order gives step r)."""
    return replay_module.step_order(configs, r)


def bench(trace, name: str, configs, backends, steps, repeats: int, config_threads: int = 1) -> list[dict]:
    """Rows: per phase and backend, the median seconds and M element-steps/s. Repeat r replays
    the configurations in `rotated(configs, r)`'s order: a replay step's first configuration
    runs ~20 us a step slower on the demo for its place alone (docs/diagnose.md, "Subnormal
    tails"). With R >= 3 repeats of at least R configurations none is first more than once,
    so no configuration's median is a first place's."""
    runs = {b: [time_replay(trace, rotated(configs, r), b, steps, config_threads) for r in range(repeats)]
            for b in backends}
    rows = []
    el = runs[backends[0]][0]["element_steps"]
    for phase in ["gather", "shadow"] + [str(c) for c in configs] + ["loop"]:
        row = {"trace": name, "phase": phase, "element_steps": el}
        for b in backends:
            secs = [r["wall"] if phase == "loop" else r["phases"][phase] for r in runs[b]]
            cpu = [r["loop_cpu"] if phase == "loop" else r["cpu"][phase] for r in runs[b]]
            row[b], row[b + " cpu"] = statistics.median(secs), statistics.median(cpu)
        rows.append(row)
    for c in configs:
        paths = {b: runs[b][0]["codec"][str(c)] for b in backends}
        rows.append({"trace": name, "phase": f"  codec of {c}", "paths": paths})
    return rows


def show(rows, backends) -> None:
    head = f"{'trace':<14} {'phase':<28}" + "".join(
        f" {b[:4] + ' s':>9} {b[:4] + ' M/s':>9} {b[:4] + ' cpu-s':>10} {b[:4] + ' M/cpu-s':>12}" for b in backends)
    if "auto" in backends and "reference" in backends:
        head += f" {'auto/ref':>9}"
    print(head)
    for r in rows:
        if "paths" in r:
            print(f"{r['trace']:<14} {r['phase']:<28} " + "; ".join(
                f"{b}: " + ", ".join(f"{s}={p[0]}" for s, p in r["paths"][b].items()) for b in backends))
            continue
        line = f"{r['trace']:<14} {r['phase']:<28}"
        rate = {}
        for b in backends:
            rate[b] = r["element_steps"] / r[b] / 1e6 if r[b] > 0 else float("nan")
            c = r[b + " cpu"]
            # three significant digits: a tiny trace's phase (ms, < 0.1 M/s on a loaded machine) reads as
            # what it took, not 0.000 s or 0.0 M/s
            line += f" {r[b]:>9.3g} {rate[b]:>9.3g} {c:>10.3g} {r['element_steps'] / c / 1e6 if c > 0 else 0:>12.3g}"
        if "auto" in rate and "reference" in rate:
            line += f" {rate['auto'] / rate['reference']:>9.3g}"
        print(line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["bred-4bit", "nearest-4bit"])
    ap.add_argument("--numel", type=int, default=262144, help="elements per synthetic tensor (4 tensors)")
    ap.add_argument("--steps", type=int, default=100, help="synthetic trace steps")
    ap.add_argument("--demo-steps", type=int, default=None, help="replay only the first N demo steps")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--backends", nargs="+", default=["auto", "reference"], choices=["auto", "reference"])
    ap.add_argument("--traces", nargs="+", default=["demo", "synthetic"], choices=["demo", "synthetic"])
    ap.add_argument("--cache", type=Path, default=None, help="folder of the synthetic trace (default: qstate's cache)")
    ap.add_argument("--config-threads", type=int, default=1,
                    help="configurations replayed at once (qstate diagnose --config-threads)")
    args = ap.parse_args(argv)
    CpuTimer.per_thread = args.config_threads > 1
    replay_module.Timer = CpuTimer  # CPU seconds per phase too (the replay's own Timer otherwise)
    configs = select_configs(args.configs)
    traces = []
    if "demo" in args.traces:
        traces.append(("demo", load_trace(diagnose_path("demo")), args.demo_steps))
    if "synthetic" in args.traces:
        path = synthetic_trace(args.numel, args.steps, args.cache)
        traces.append((f"synth-{SYNTH_TENSORS * args.numel // 1024}k", load_trace(path), None))
    t0 = time.perf_counter()
    for _, trace, _ in traces:  # numba compiles (or loads its disk cache) here, untimed: each trace, since
        for b in args.backends:  # a layout of another size takes other kernels (run_parts' and not numba's team)
            time_replay(trace, configs, b, 2)
    print(f"# {host_cpus()}, torch threads {torch.get_num_threads()}, "
          f"configuration threads {args.config_threads}, warm-up {time.perf_counter() - t0:.1f} s, "
          f"median of {args.repeats}; M/s = M element-steps/s of the phase")
    print(f"# host before: {host_now()}")
    rows = []
    for name, trace, steps in traces:
        rows += bench(trace, name, configs, args.backends, steps, args.repeats, args.config_threads)
    print(f"# host after:  {host_now()}")
    show(rows, args.backends)
    for line in targets(rows):
        print(line)
    return 0


TARGET_M = 100.0  # M element-steps/s per configuration, every statistic on


def targets(rows: list[dict], backend: str = "auto") -> list[str]:
    """Per trace, whether every configuration's wall rate on `backend` (bench's rows: the
    shared gather, shadow and loop rows and the codec lines left aside) reaches TARGET_M,
    with the lowest; nothing where the backend was not run."""
    out = {}
    for r in rows:
        if "paths" in r or r["phase"] in ("gather", "shadow", "loop") or backend not in r or r[backend] <= 0:
            continue
        rate = r["element_steps"] / r[backend] / 1e6
        if r["trace"] not in out or rate < out[r["trace"]][1]:
            out[r["trace"]] = (r["phase"], rate)
    return [f"targets, {trace}: every configuration >= {TARGET_M:g} M element-steps/s ({backend}): "
            f"{'yes' if rate >= TARGET_M else 'NO'} (lowest {phase} {rate:.3g})"
            for trace, (phase, rate) in out.items()]


def host_now() -> str:
    """The machine's state at this moment, to read a run's M/s against another's: a copy of
    2**26 fp32 (timing.copy_bandwidth, median GB/s) on one torch thread and on all, and the CPU
    share of a busy loop (timing.cpu_share: ~1.0 unless the VM's core is shared). The same code
    read 0.95 and 1.26 s for bnb-8bit's phase within an hour on one host, its CPU seconds up
    too; such readings explained one slow run of six there (docs/diagnose.md, "Fewer bytes
    are not the lever"), so they say what the machine was doing, not why a run was slow."""
    from qstate_cli.bench.timing import copy_bandwidth, cpu_share

    threads, cpu = torch.get_num_threads(), torch.device("cpu")
    gbps = []
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        timing, moved = copy_bandwidth(cpu, 1 << 26, 50, 400)
        gbps.append(f"{moved / timing.stats.median / 1e6:.1f} GB/s on {n} thread{'s' * (n > 1)}")
    torch.set_num_threads(threads)
    got, wall = cpu_share()
    return f"copy {', '.join(gbps)}; CPU share {got / wall:.2f}"


def diagnose_path(name: str) -> Path:
    from qstate_cli.diagnose.run import resolve_trace

    return resolve_trace(name)


if __name__ == "__main__":
    sys.exit(main())
