"""`qstate bench kernels` and `qstate bench memory` (the `bench` group; `bench_app` is
importable so that other modules can add subcommands to it, e.g. `bench train`).

Results: a table on stdout (or --json - for the JSON document on stdout); --json PATH
and --csv PATH are rewritten atomically after every row, so Ctrl-C keeps finished rows
(exit code 130). Progress and one line per row go to stderr.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..bench import headline as headline_engine
from ..bench import kernels as kernels_engine
from ..bench import memory as memory_engine
from ..bench import summary
from ..bench.shapes import parse_count
from ..bench.sink import RowSink
from ..errors import CheckFailed
from ..results import environment
from . import bench_train_cmd, new_group, output

bench_app = new_group("bench", "Time optimizer steps against the memory roofline; count optimizer-state memory; "
                               "train a small model with each state format.")
bench_app.command("train")(bench_train_cmd.train)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


def split_list(values: Optional[List[str]]) -> list[str]:
    """Repeatable options that also take comma-separated lists: --dtype fp32,bf16."""
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]


@contextmanager
def _progress(total: int):
    """A progress bar on stderr; yields (on_start, on_row) callbacks for the engines."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=output.stderr) as prog:
        task = prog.add_task("bench", total=total)

        def on_start(label: str, done: int, n: int) -> None:
            prog.update(task, description=label, completed=done)

        def log(row: dict) -> None:
            prog.update(task, advance=1)
            prog.console.print(_row_line(row), highlight=False, markup=False)

        yield on_start, log


def _row_line(row: dict) -> str:
    size = row.get("model") or f"{row.get('numel') or row.get('params'):,}"
    head = f"{row['name']} [{row['path']}] {size} {row.get('param_dtype') or ''}".strip()
    if row["status"] != "ok":
        return f"{head}: {row['status']}: {row.get('reason')}"
    if "time_ms" in row:
        pct = f", {row['pct_of_copy']:.1f}% of copy" if row.get("pct_of_copy") is not None else ""
        return f"{head}: {row['time_ms']:.4g} ms, {row['gbps']:.3g} GB/s{pct}"
    return f"{head}: {row['bytes_per_param']:.4f} bytes/param"


def _run(kind: str, p, engine, meta: dict, json_path, csv_path, show, summary=None) -> RowSink:
    """Measure every row of plan `p`, writing the files after each one; `summary(rows)`
    (optional) adds top-level entries to the document once every row is in."""
    to_stdout = json_path is not None and str(json_path) == "-"
    env = environment(str(p.device))
    sink = RowSink(kind, None if to_stdout else json_path, csv_path, meta, env)
    output.stderr.print(f"bench {kind} on {env['device']} ({env['device_name']}, torch threads {env['torch_threads']}, "
                        f"torch {env['torch']}): {p.total_rows} rows", highlight=False, markup=False)
    try:
        with _progress(p.total_rows) as (on_start, on_row):
            engine.run(p, on_row=lambda r: (sink.add(r), on_row(r)), on_start=on_start)
        if summary is not None:
            sink.doc.update(summary(sink.records))
            sink.writer.flush()
    finally:  # also on Ctrl-C: show what was measured, then the boundary exits 130
        if to_stdout:
            output.print_json(sink.doc)
        elif sink.records:
            show(sink.records)
    return sink


KERNELS_HELP = "Time optimizer steps (ours and baselines) over a size sweep or a model's shapes, against the copy roofline."


@bench_app.command("kernels", help=KERNELS_HELP)
def kernels(
    bits: int = typer.Option(4, "--bits", help="State bit width whose configs to time (4: nearest/sr/bred/torchao-4bit; 8: nearest/sr/bred/bnb-8bit)."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, lion, sgd or muon."),
    config: Optional[List[str]] = typer.Option(None, "--config", "-c", help="Config or preset name (repeatable); overrides --bits/--rounding."),
    rounding: Optional[List[str]] = typer.Option(None, "--rounding", "-r", help="Keep configs with this rounding: nearest, stochastic, bred."),
    numel: Optional[List[str]] = typer.Option(None, "--numel", "-n", help="Tensor sizes (repeatable or comma list; 1e6, 2^20). Default: the device's sweep."),
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="Whole-model shapes: gpt2-small, gpt2-medium, llama-1b, tinyllama-1.1b, llama-7b, tiny-lm, small-lm, or 768x3072*12,768."),
    dtype: Optional[List[str]] = typer.Option(None, "--dtype", help="Parameter and gradient dtype: fp32, bf16, fp16 (repeatable). Default: fp32 on CPU; fp32 and bf16 on CUDA."),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu."),
    baseline: Optional[List[str]] = typer.Option(None, "--baseline", help="Baselines (repeatable): torch-fused, torch-foreach, bf16-states, bnb-adamw8bit, torchao-adamw8bit, torchao-adamw4bit, all, none."),
    backend: Optional[List[str]] = typer.Option(None, "--backend", help="Our optimizers' backend: auto, reference, triton (repeatable)."),
    warmup_ms: Optional[float] = typer.Option(None, "--warmup-ms", help="Warm-up time per row (default: 10 on CPU, 25 on CUDA)."),
    rep_ms: Optional[float] = typer.Option(None, "--rep-ms", help="Timed repetitions per row, in ms (at least 5 reps; default 100)."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help="Capture each step in a CUDA graph and time its replays."),
    copy_numel: Optional[str] = typer.Option(None, "--copy-numel", help="fp32 elements of the copy that measures bandwidth (default: 2^26 on CPU, 2^28 on CUDA)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results JSON here (rewritten after every row); '-' prints it to stdout instead of the table."),
    csv_path: Optional[Path] = typer.Option(None, "--csv", help="Write the rows as CSV here (rewritten after every row)."),
):
    opts = kernels_engine.KernelsOptions(
        bits=bits, optimizer=optimizer.lower(), config=list(config or []), rounding=split_list(rounding),
        numel=[parse_count(n) for n in split_list(numel)], model=list(model or []), dtype=split_list(dtype),
        device=device, baseline=split_list(baseline), backend=split_list(backend), warmup_ms=warmup_ms,
        rep_ms=rep_ms, cuda_graph=cuda_graph, copy_numel=parse_count(copy_numel) if copy_numel else None)
    p = kernels_engine.plan(opts)

    def show(rows):
        title = f"Optimizer step time ({p.optimizer}, {p.device.type}; roofline = measured copy bandwidth)"
        output.stdout.print(output.table(title, summary.kernel_display_rows(rows), summary.KERNEL_COLUMNS,
                                         summary.KERNEL_FORMATS, summary.KERNEL_HEADERS))

    _run("kernels", p, kernels_engine, kernels_engine.options_meta(opts, p), json_path, csv_path, show)


@bench_app.command("memory", help="Optimizer-state bytes per parameter (exact accounting; measured on CUDA) and the peak extra memory of a step.")
def memory(
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="Model shapes (default: small-lm on CPU, gpt2-small on CUDA)."),
    numel: Optional[List[str]] = typer.Option(None, "--numel", "-n", help="Single tensors of these sizes instead of / besides --model."),
    config: Optional[List[str]] = typer.Option(None, "--config", "-c", help="Configs (repeatable). Default: bred-4bit, torchao-4bit, bred-8bit, bnb-8bit."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, lion, sgd or muon."),
    dtype: str = typer.Option("fp32", "--dtype", help="Parameter dtype: fp32, bf16, fp16."),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu."),
    baseline: Optional[List[str]] = typer.Option(None, "--baseline", help="Baselines (repeatable), all (default) or none."),
    backend: str = typer.Option("auto", "--backend", help="Our optimizers' backend: auto, reference, triton."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results JSON here; '-' prints it to stdout."),
    csv_path: Optional[Path] = typer.Option(None, "--csv", help="Write the rows as CSV here."),
):
    opts = memory_engine.MemoryOptions(
        model=list(model or []), numel=[parse_count(n) for n in split_list(numel)], config=list(config or []),
        optimizer=optimizer.lower(), dtype=dtype, device=device, baseline=split_list(baseline), backend=backend)
    p = memory_engine.plan(opts)

    def show(rows):
        title = f"Optimizer-state memory ({p.optimizer}, {p.dtype} parameters, {p.device.type}"
        title += "; measured columns need CUDA)" if p.device.type != "cuda" else ")"
        output.stdout.print(output.table(title, summary.memory_display_rows(rows), summary.MEMORY_COLUMNS,
                                         summary.MEMORY_FORMATS, summary.MEMORY_HEADERS))

    _run("memory", p, memory_engine, memory_engine.options_meta(opts, p), json_path, csv_path, show)


HEADLINE_HELP = ("The headline preset: the fused 4-bit AdamW kernel at 1e8 elements (nearest, BReD, v on uint4) "
                 "and a qstate step, against the copy bandwidth and torch's fused AdamW; exit 1 if a row failed.")


@bench_app.command("headline", help=HEADLINE_HELP)
def headline(
    numel: str = typer.Option("1e8", "--numel", "-n", help="Elements of the one tensor stepped (1e8, 2^27)."),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu."),
    dtype: Optional[List[str]] = typer.Option(None, "--dtype", help="Parameter and gradient dtypes (default bf16,fp32)."),
    reps: int = typer.Option(50, "--reps", help="Timed repetitions per row."),
    warmup: int = typer.Option(5, "--warmup", help="Warm-up calls per row (the first call included)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results JSON here (rewritten after "
                                             "every row; the summary under 'headline'); '-' prints it to stdout."),
    csv_path: Optional[Path] = typer.Option(None, "--csv", help="Write the rows as CSV here."),
):
    opts = headline_engine.HeadlineOptions(numel=parse_count(numel), device=device,
                                           dtype=split_list(dtype) or ["bf16", "fp32"], reps=reps, warmup=warmup)
    p = headline_engine.plan(opts)

    def show(rows):
        title = f"Headline: fused 4-bit AdamW step, {p.numel:,} elements on {p.device.type} (roofline = copy)"
        columns = [c for c in summary.KERNEL_COLUMNS if c not in ("x_fused", "compile_ms", "note")]
        output.stdout.print(output.table(title, summary.kernel_display_rows(rows), columns + ["timing", "note"],
                                         summary.KERNEL_FORMATS, summary.KERNEL_HEADERS))
        for line in headline_engine.summary_lines(headline_engine.summarize(rows)):
            output.stdout.print(line, highlight=False, markup=False)

    sink = _run("kernels", p, headline_engine, headline_engine.options_meta(opts, p), json_path, csv_path, show,
                summary=lambda rows: {"headline": headline_engine.summarize(rows)})
    failed = [r["name"] for r in sink.records if r["status"] != "ok"]
    if failed:
        raise CheckFailed(f"{len(failed)} headline row(s) failed: {', '.join(failed)}")
