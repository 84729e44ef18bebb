"""`qstate bench headline`: the headline measurement of the fused 4-bit AdamW step.

A fixed preset of `bench`: in one run on one device, at `numel` elements (1e8 by default),

    copy                      a device-to-device copy of 2 x numel fp32 values: the
                              bandwidth every other row is compared with (timing.copy_bandwidth)
    nearest-4bit, bred-4bit   the fused AdamW kernel launch alone (kernels/adamw.py), one
                              tensor, 4-bit states at block 128, per parameter dtype
    *-4bit-uint4v             the same with v on the plain linear grid uint4 (sqrt): what
                              the presets' 16-entry lin4nz table lookup costs
    qstate-step               AdamW(states="bred-4bit").step() on the kernel path: the
                              kernel plus a step's host work (scalars, launch table lookup)
    torch-fused-adamw         torch.optim.AdamW(fused=True), fp32 parameters and states

Bytes moved per element, the model of bytes_model.py (BRIEF §2):
2p + g + 2 * (bits/8 + 4/B) per state: 8.125 (bf16 p, g) or 14.125 (fp32) for 4-bit AdamW
at B = 128; 28 for torch's AdamW with fp32 states. `bytes_moved` = that x numel;
gbps = bytes_moved / median time; pct_of_copy = 100 x gbps / the copy row's gbps.

Timing is bench/timing.py's, with a fixed count: `warmup` calls (the first included),
then `reps` samples; on CUDA an L2 flush of twice the device's L2 before each sample,
CUDA events around it, and the kernel rows replay a CUDA graph of the launch (no host
launch cost in the number) where capture works (`timing` says which clock was used).
Rows are kind "kernels" records (docs/results.md) plus `timing`; `summarize` gives the
headline numbers beside the targets of issue 3.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import QstateError
from ..options import Options, many, option
from ..quant.config import StateConfig, parse_config
from ..progress import Progress
from ..results import Result, device_info
from ..runtime import free_memory, resolve_device
from .bytes_model import DTYPES, bytes_per_element
from .kernels import FIELDS, fill_timing, streamed
from .shapes import parse_count
from .timing import CaptureFailed, measure

PRESETS = tuple((name, parse_config(text)) for name, text in (
    ("nearest-4bit", "nearest-4bit"), ("bred-4bit", "bred-4bit"),
    # v on the plain linear grid: the presets' lin4nz is a 16-entry table lookup
    ("nearest-4bit-uint4v", "m=int4:nearest:b128,v=uint4:nearest:b128:sqrt"),
    ("bred-4bit-uint4v", "m=int4:bred:b128,v=uint4:bred:b128:sqrt")))
STEP_CONFIG = parse_config("bred-4bit")
TARGETS = {"pct_of_copy_min": 85.0, "bred_overhead_pct_max": 3.0, "speedup_vs_torch_min": 1.8}
HEADLINE_FIELDS = FIELDS + ("timing",)


@dataclass
class HeadlineOptions(Options):
    """`qstate bench headline`: sizes and rows are the preset's; these are its knobs."""

    COMMAND = "bench headline"

    numel: int = option(10**8, "Elements of the one tensor stepped (1e8, 2^27).", "--numel", "-n", parse=parse_count)
    device: str = option("auto", "auto, cuda or cpu.")
    dtype: list[str] = many("Parameter and gradient dtypes.", default=("bf16", "fp32"))
    reps: int = option(50, "Timed repetitions per row.")
    warmup: int = option(5, "Warm-up calls per row (the first call included).")


@dataclass
class HeadlinePlan:
    device: torch.device
    numel: int
    dtypes: list[str]
    reps: int
    warmup: int

    @property
    def total_rows(self) -> int:
        return 2 + len(self.dtypes) * (len(PRESETS) + 1)


def plan(opts: HeadlineOptions) -> HeadlinePlan:
    """Validate the options (QstateError on bad input)."""
    device = resolve_device(opts.device)
    from ..kernels import unavailable_reason

    why = unavailable_reason(device)
    if why is not None:
        raise QstateError(f"bench headline times the Triton kernels on {device.type}, and {why}; on a CPU, "
                          f"`qstate bench kernels --device cpu --bits 4` times the fused CPU path")
    if opts.numel < 1:
        raise QstateError("--numel must be >= 1")
    if opts.reps < 1 or opts.warmup < 1:
        raise QstateError("--reps and --warmup must be >= 1")
    for dt in opts.dtype:
        if dt not in DTYPES:
            raise QstateError(f"unknown dtype {dt!r}: choose from {', '.join(DTYPES)}")
    return HeadlinePlan(device, int(opts.numel), list(opts.dtype), int(opts.reps), int(opts.warmup))


# ---- the things measured -------------------------------------------------------------------
def fused_adamw_launch(numel: int, dtype: torch.dtype, cfg: StateConfig, device) -> Callable[[], None]:
    """A ready-to-call fused AdamW launch over one tensor (states written at step 9; step 10)."""
    from ..kernels import adamw, launch
    from ..optim import rules
    from ..quant import QuantizedState

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


def qstate_optimizer_step(numel: int, dtype: torch.dtype, device) -> tuple[Callable[[], None], str]:
    """AdamW(states=STEP_CONFIG).step on the kernel path, and that path's name."""
    from ..optim import AdamW

    p = torch.nn.Parameter(torch.randn(numel, device=device).to(dtype))
    p.grad = (torch.randn(numel, device=device) * 1e-3).to(dtype)
    opt = AdamW([p], lr=1e-3, states=STEP_CONFIG, min_quant_numel=0, backend="triton")
    return opt.step, opt.path_for(p)


def torch_fused_adamw(numel: int, device) -> Callable[[], None]:
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn(numel, device=device) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    opt.step()  # allocate the fp32 states
    return opt.step


# ---- the run ---------------------------------------------------------------------------------
def _row(p: HeadlinePlan, info: dict, **fields) -> dict:
    row = dict.fromkeys(HEADLINE_FIELDS)
    row.update(numel=p.numel, n_tensors=1, device=p.device.type, device_name=info["device_name"], status="ok",
               cuda_graph=False, **fields)
    if row.get("bytes_per_elem") is not None:
        row["bytes_moved"] = row["bytes_per_elem"] * p.numel
    return row


def _kernel_path(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "triton-interpreter"


def _timed(p: HeadlinePlan, fn: Callable[[], None], graph: bool):
    """bench/timing.measure with the plan's fixed counts; a launch that cannot be captured
    into a CUDA graph is timed as plain launches (the row's `timing` says which)."""
    if graph and p.device.type == "cuda":
        try:
            return measure(fn, p.device, reps=p.reps, warmup_reps=p.warmup, cuda_graph=True)
        except CaptureFailed:
            torch.cuda.synchronize(p.device)
    return measure(fn, p.device, reps=p.reps, warmup_reps=p.warmup)


def run(p: HeadlinePlan, on_row: Callable[[dict], None] | None = None,
        on_start: Callable[[str, int, int], None] | None = None) -> list[dict]:
    """Measure every row (module docstring); a row that raises is kept, failed, with its reason."""
    info = device_info(str(p.device))
    rows: list[dict] = []
    copy_gbps = None

    def measured(row: dict, make: Callable[[], Callable[[], None] | tuple], graph: bool) -> None:
        if on_start:
            on_start(f"{row['name']} {row.get('param_dtype') or ''} {p.numel:,}".replace("  ", " "), len(rows),
                     p.total_rows)
        row["copy_gbps"] = copy_gbps
        try:
            made = make()
            fn, path = made if isinstance(made, tuple) else (made, row["path"])
            timing = _timed(p, fn, graph)
            row.update(path=path, timing=timing.clock, cuda_graph=timing.cuda_graph)
            fill_timing(row, timing)
        except Exception as exc:  # noqa: BLE001 - one failed row must not lose the others
            row.update(status="failed", reason=f"{type(exc).__name__}: {exc}".splitlines()[0])
        finally:
            free_memory(p.device)
        rows.append(row)
        if on_row:
            on_row(row)

    # copy: 2 x numel fp32 values, read and written (16 bytes per headline element)
    row = _row(p, info, name="copy", role="copy", config="copy", path="copy", param_dtype="fp32",
               bytes_per_elem=16.0)
    measured(row, lambda: _copy_fn(p), graph=True)
    if row["status"] == "ok":
        copy_gbps = row["copy_gbps"] = row["gbps"]
        row["pct_of_copy"] = 100.0
    for dname in p.dtypes:
        dtype = DTYPES[dname]
        size = torch.empty((), dtype=dtype).element_size()
        for name, cfg in PRESETS:
            measured(_row(p, info, name=name, role="config", optimizer="adamw", config=cfg.canonical(),
                          rounding=cfg.m.rounding, bits=4, param_dtype=dname, grad_dtype=dname,
                          path=_kernel_path(p.device), bytes_per_elem=bytes_per_element(size, size, [cfg.m, cfg.v])),
                     lambda c=cfg: fused_adamw_launch(p.numel, dtype, c, p.device), graph=True)
        cfg = STEP_CONFIG
        measured(_row(p, info, name="qstate-step", role="config", optimizer="adamw", config=cfg.canonical(),
                      rounding=cfg.m.rounding, bits=4, param_dtype=dname, grad_dtype=dname,
                      path=_kernel_path(p.device), bytes_per_elem=bytes_per_element(size, size, [cfg.m, cfg.v])),
                 lambda: qstate_optimizer_step(p.numel, dtype, p.device), graph=False)
    fp32 = parse_config("fp32")
    measured(_row(p, info, name="torch-fused-adamw", role="baseline", optimizer="adamw", config=fp32.canonical(),
                  bits=32, param_dtype="fp32", grad_dtype="fp32", path="torch-fused",
                  bytes_per_elem=bytes_per_element(4, 4, [fp32.m, fp32.v])),
             lambda: torch_fused_adamw(p.numel, p.device), graph=False)
    return rows


def _copy_fn(p: HeadlinePlan) -> Callable[[], None]:
    """dst.copy_(src) over 2 x numel fp32 values (random, never zeros)."""
    gen = torch.Generator(device=p.device).manual_seed(0)
    src = torch.rand(2 * p.numel, generator=gen, device=p.device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def summarize(rows: list[dict]) -> dict:
    """The headline numbers, per parameter dtype, with the targets beside them."""
    ok = {(r["name"], r.get("param_dtype")): r for r in rows if r["status"] == "ok"}
    torch_row = ok.get(("torch-fused-adamw", "fp32"))
    out = {"targets": TARGETS, "copy_gbps": ok.get(("copy", "fp32"), {}).get("gbps")}
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


def summary_lines(headline: dict) -> list[str]:
    """One line per parameter dtype: each headline number beside its target."""
    t, lines = headline["targets"], []

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for dname, e in headline.items():
        if dname in ("targets", "copy_gbps"):
            continue
        lines.append(f"{dname}: BReD at {num(e.get('bred_pct_of_copy'), '.1f')}% of copy (target >= "
                     f"{t['pct_of_copy_min']:g}), overhead over nearest {num(e.get('bred_overhead_pct'), '+.1f')}% "
                     f"(target <= {t['bred_overhead_pct_max']:g}), {num(e.get('speedup_vs_torch_fp32'), '.2f')}x "
                     f"torch fused AdamW fp32 (target >= {t['speedup_vs_torch_min']:g})")
    return lines


def _meets(value, target, above: bool):
    if value is None:
        return None
    return bool(value >= target) if above else bool(value <= target)


def options_meta(opts: HeadlineOptions, p: HeadlinePlan) -> dict:
    return {"numel": p.numel, "dtypes": p.dtypes, "block": 128, "reps": p.reps, "warmup": p.warmup,
            "bytes_model": "2p + g + 2 * (bits/8 + 4/B) per state"}



def execute(opts: HeadlineOptions, progress: Progress | None = None) -> Result:
    """`qstate bench headline` as a library call: the rows (kind "kernels") and, under
    `headline`, the summary beside the targets."""
    p = plan(opts)
    result = streamed("kernels", p, options_meta(opts, p), run, progress)
    result.extras["headline"] = summarize(result.records)
    return result
