"""Headline measurement of the fused 4-bit AdamW step (issue 3, "Measure"; BRIEF §2).

In one run on one device, at `numel` elements (>= 1e8 for the headline):

    copy                  device-to-device copy: gbps = 2 * bytes / time (read + write),
                          the bandwidth every other row is compared with
    nearest-4bit, bred-4bit   the fused AdamW kernel alone (kernels/adamw.py), one tensor,
                          4-bit states with block 128, for each parameter dtype
    qstate-step           AdamW(states="bred-4bit").step() on the kernel path: the kernel
                          plus the host work of a step (scalars, launch table lookup)
    torch-fused-adamw     torch.optim.AdamW(fused=True), fp32 parameters and fp32 states

Bytes moved per element (the model, BRIEF §2): 2p + g + 2 * (bits/8) * states + 8 * states / B
(fp32 scales read and written); 4-bit AdamW, B=128: 8.125 (bf16 p, g) or 14.125 (fp32);
torch AdamW with fp32 states: 28 (fp32 p, g). gbps = bytes moved / median time.

Timing (`time_ms`): CUDA events around each repetition, a 256 MiB buffer zeroed before
each one so no repetition starts with a warm L2, warm-up first, median of the samples;
the kernel rows replay a CUDA graph of the launch (no host launch cost in the number)
when capture works. On CPU (tests) the host clock and Triton's interpreter stand in.

    python -m qstate_cli.kernels.headline --out DIR [--numel 100000000]

writes DIR/headline.json (results kind "kernels", docs/results.md; one row at a time,
so a failure keeps the rows already measured) with the summary under "headline".
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

BLOCK = 128
FLUSH_MIB = 256
# The presets keep v on the no-zero code book lin4nz (a 16-entry table lookup); these rows
# time the same step with v on the plain linear grid uint4, to show what the lookup costs.
LINEAR_V = (("m=int4:nearest:b128,v=uint4:nearest:b128:sqrt", "nearest"),
            ("m=int4:bred:b128,v=uint4:bred:b128:sqrt", "bred"))
TARGETS = {"pct_of_copy_min": 85.0, "bred_overhead_pct_max": 3.0, "speedup_vs_torch_min": 1.8}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def bytes_per_element(p_bytes: int, g_bytes: int, bits: int, states: int, block: int | None) -> float:
    """2p + g + 2 * (bits/8) * states + 8 * states / B  (no scales when block is None)."""
    return 2 * p_bytes + g_bytes + 2 * (bits / 8) * states + (8 * states / block if block else 0.0)


# ---- timing ------------------------------------------------------------------------------------
def time_ms(fn, device, reps: int = 50, warmup: int = 5, graph: bool = False, flush_mib: int = FLUSH_MIB):
    """Samples (ms) of `fn` and how they were taken ('cuda-graph', 'cuda-events', 'host-clock')."""
    dev = torch.device(device)
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return samples, "host-clock"
    torch.cuda.synchronize(dev)
    run, mode = fn, "cuda-events"
    if graph:
        try:
            run, mode = _capture(fn, dev).replay, "cuda-graph"
        except Exception:  # noqa: BLE001 - not capturable: time the plain launches
            torch.cuda.synchronize(dev)
    flush = torch.empty(flush_mib * 2**20, dtype=torch.uint8, device=dev)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()  # evict the previous repetition's data from L2
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(dev)
    return [start.elapsed_time(end) for start, end in events], mode


def _capture(fn, dev):
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def timing_fields(samples: list[float], mode: str) -> dict:
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    median = statistics.median(samples)
    return {"time_ms": median, "time_ms_iqr": q[2] - q[0], "time_ms_min": min(samples),
            "samples_ms": [round(s, 5) for s in samples], "noisy": (q[2] - q[0]) / median > 0.1 if median else False,
            "timing": mode}


# ---- the things measured ---------------------------------------------------------------------------
def fused_adamw_launch(numel: int, dtype: torch.dtype, states: str, device):
    """A ready-to-call fused AdamW launch over one tensor (state written at step 9, step 10)."""
    from ..optim import rules
    from ..quant import QuantizedState, parse_config
    from . import adamw, launch

    cfg = parse_config(states)
    p = torch.randn(numel, device=device).to(dtype)
    g = (torch.randn(numel, device=device) * 1e-3).to(dtype)
    qs = {n: QuantizedState(cfg.spec(n), (numel,), device=device) for n in "mv"}
    member = launch.Member(p, g, {n: (q.codes, q.scales) for n, q in qs.items()},
                           torch.zeros((), dtype=torch.int64, device=device), 0)
    batch = launch.build_batch([member], cfg.m.block)
    scal = rules.pack_scalars(rules.step_scalars(1e-3, 0.01, 0.9, 0.999, 10, device))
    lm, lv = launch.kernel_layout(cfg.m), launch.kernel_layout(cfg.v)
    kind = launch.VALUE_KINDS[dtype]

    def step(keep=(p, g, qs, member)):  # the launch table holds addresses only: keep the tensors alive
        adamw.adamw_step(batch, scal, lm, lv, p_kind=kind, g_kind=kind, step=10, written=(9, 9),
                         fresh=(False, False), beta1=0.9, beta2=0.999, eps=1e-8,
                         tables=(lm.table(device), lv.table(device)))
    return step


def qstate_optimizer_step(numel: int, dtype: torch.dtype, device):
    from ..optim import AdamW

    p = torch.nn.Parameter(torch.randn(numel, device=device).to(dtype))
    p.grad = (torch.randn(numel, device=device) * 1e-3).to(dtype)
    opt = AdamW([p], lr=1e-3, states="bred-4bit", min_quant_numel=0, backend="triton")
    path = opt.path_for(p)
    return opt.step, path


def torch_fused_adamw(numel: int, device):
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn(numel, device=device) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    opt.step()  # allocate the fp32 states
    return opt.step


# ---- the run --------------------------------------------------------------------------------------
def run(numel: int = 10**8, device: str = "cuda", dtypes=("bf16", "fp32"), reps: int = 50, warmup: int = 5,
        writer=None, log=print) -> list[dict]:
    """Measure every row (see module docstring); a row that fails is kept with its reason."""
    from ..results import device_info

    info = device_info(device)
    base = {"numel": int(numel), "n_tensors": 1, "device": device, "device_name": info.get("device_name")}
    rows: list[dict] = []
    copy_gbps = None

    def measure(row: dict, make, graph: bool):
        nonlocal copy_gbps
        row = {**base, "status": "ok", "reason": None, **row}
        log(f"measuring {row['name']} ({row.get('param_dtype')}, {numel:,} elements)")
        try:
            made = make()
            fn, path = made if isinstance(made, tuple) else (made, row.get("path"))
            samples, mode = time_ms(fn, device, reps=reps, warmup=warmup, graph=graph)
            row.update(path=path, **timing_fields(samples, mode))
            row["gbps"] = row["bytes_moved"] / (row["time_ms"] * 1e-3) / 1e9
            if row["name"] == "copy":
                copy_gbps = row["gbps"]
        except Exception as exc:  # noqa: BLE001 - one failed row must not lose the others
            row.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
            log(traceback.format_exc())
        finally:
            _release(device)
        row["copy_gbps"] = copy_gbps
        row["pct_of_copy"] = 100.0 * row["gbps"] / copy_gbps if copy_gbps and row.get("gbps") else None
        rows.append(row)
        if writer is not None:
            writer.add(row)
        return row

    nbytes = int(numel) * 8
    measure({"name": "copy", "optimizer": None, "config": "copy", "path": "copy", "bytes_moved": 2 * nbytes,
             "param_dtype": None, "grad_dtype": None},
            lambda: _copy_fn(nbytes, device), graph=True)
    kernel_path = "triton" if torch.device(device).type == "cuda" else "triton-interpreter"
    for dname in dtypes:
        dtype = DTYPES[dname]
        size = torch.empty((), dtype=dtype).element_size()
        model = bytes_per_element(size, size, 4, 2, BLOCK)
        for preset, rounding in (("nearest-4bit", "nearest"), ("bred-4bit", "bred")) + LINEAR_V:
            name = preset if "=" not in preset else f"{rounding}-4bit-uint4v"
            measure({"name": name, "optimizer": "adamw", "config": preset, "rounding": rounding, "bits": 4,
                     "param_dtype": dname, "grad_dtype": dname, "path": kernel_path,
                     "bytes_per_element": model, "bytes_moved": model * numel},
                    lambda: fused_adamw_launch(numel, dtype, preset, device), graph=True)
        measure({"name": "qstate-step", "optimizer": "adamw", "config": "bred-4bit", "rounding": "bred", "bits": 4,
                 "param_dtype": dname, "grad_dtype": dname, "bytes_per_element": model, "bytes_moved": model * numel},
                lambda: qstate_optimizer_step(numel, dtype, device), graph=False)
    model = bytes_per_element(4, 4, 32, 2, None)
    measure({"name": "torch-fused-adamw", "optimizer": "adamw", "config": "fp32", "rounding": None, "bits": 32,
             "param_dtype": "fp32", "grad_dtype": "fp32", "path": "torch-fused", "bytes_per_element": model,
             "bytes_moved": model * numel},
            lambda: torch_fused_adamw(numel, device), graph=False)
    return rows


def _copy_fn(nbytes: int, device):
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _release(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def summarize(rows: list[dict]) -> dict:
    """The headline numbers, per parameter dtype, with the issue's targets beside them."""
    ok = {(r["name"], r.get("param_dtype")): r for r in rows if r["status"] == "ok"}
    torch_row = ok.get(("torch-fused-adamw", "fp32"))
    out = {"targets": TARGETS, "copy_gbps": ok.get(("copy", None), {}).get("gbps")}
    for dname in sorted({r.get("param_dtype") for r in rows if r["name"] == "bred-4bit"}):
        bred, nearest = ok.get(("bred-4bit", dname)), ok.get(("nearest-4bit", dname))
        entry = {"bred_gbps": bred and bred["gbps"], "bred_pct_of_copy": bred and bred["pct_of_copy"],
                 "nearest_pct_of_copy": nearest and nearest["pct_of_copy"]}
        if bred and nearest:
            entry["bred_overhead_pct"] = 100.0 * (bred["time_ms"] / nearest["time_ms"] - 1.0)
        if bred and torch_row:
            entry["speedup_vs_torch_fp32"] = torch_row["time_ms"] / bred["time_ms"]
        entry["meets"] = {
            "pct_of_copy": _meets(entry["bred_pct_of_copy"], TARGETS["pct_of_copy_min"], above=True),
            "bred_overhead": _meets(entry.get("bred_overhead_pct"), TARGETS["bred_overhead_pct_max"], above=False),
            "speedup_vs_torch": _meets(entry.get("speedup_vs_torch_fp32"), TARGETS["speedup_vs_torch_min"], above=True),
        }
        out[dname] = entry
    return out


def _meets(value, target, above: bool):
    if value is None:
        return None
    return bool(value >= target) if above else bool(value <= target)


def main(argv=None) -> int:
    from ..results import ResultWriter, environment

    ap = argparse.ArgumentParser(prog="python -m qstate_cli.kernels.headline", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder (default $OUT or .)")
    ap.add_argument("--numel", type=float, default=1e8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    path = os.path.join(args.out, "headline.json")
    meta = {"numel": int(args.numel), "block": BLOCK, "reps": args.reps, "warmup": args.warmup,
            "flush_mib": FLUSH_MIB, "bytes_model": "2p + g + 2*(bits/8)*states + 8*states/B"}
    writer = ResultWriter(path, "kernels", meta=meta, env=environment(args.device))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    rows = run(int(args.numel), args.device, tuple(args.dtypes.split(",")), args.reps, args.warmup, writer, log)
    writer.doc["headline"] = summarize(rows)
    writer.flush()
    log(f"wrote {path}")
    for r in rows:
        log(f"  {r['name']:<18} {r.get('param_dtype') or '':<5} {r['status']:<6} "
            + (f"{r['time_ms']:.3f} ms  {r['gbps']:.0f} GB/s  "
               + (f"{r['pct_of_copy']:.1f}% of copy" if r.get("pct_of_copy") else "") if r["status"] == "ok"
               else str(r["reason"])))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
