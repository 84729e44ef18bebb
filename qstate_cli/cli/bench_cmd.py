"""`qstate bench kernels|memory|headline|train` (the `bench` group).

Each command is its engine's options (bench/*.py, train/study.py) plus output flags; the
output layer (output.py) writes --json/--csv after every row, so Ctrl-C keeps finished
rows (exit code 130; SIGTERM 143), and prints the table (or the JSON with --json -). Progress and one
line per row go to stderr.
"""
from __future__ import annotations

import typer

from ..bench import headline as headline_engine
from ..bench import kernels as kernels_engine
from ..bench import memory as memory_engine
from ..bench import summary
from ..errors import CheckFailed
from ..results import env_cpus
from . import output
from .group import new_group
from .bench_train_cmd import register_train
from .commands import options_command
from .output import Destinations

bench_app = new_group("bench", "Time optimizer steps against the memory roofline; count optimizer-state memory; "
                               "train a small model with each state format.")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


def row_line(row: dict) -> str:
    """One line per finished row, on stderr."""
    size = row.get("model") or f"{row.get('numel') or row.get('params'):,}"
    head = f"{row['name']} [{row['path']}] {size} {row.get('param_dtype') or ''}".strip()
    if row["status"] != "ok":
        return f"{head}: {row['status']}: {row.get('reason')}"
    if "time_ms" in row:
        pct = f", {row['pct_of_copy']:.1f}% of copy" if row.get("pct_of_copy") is not None else ""
        if row.get("cache_resident"):
            rel = row.get("time_rel_copy")
            pct = ", cache-resident" + (f" ({rel:.3g}x a copy of its own bytes)" if rel is not None else "")
        return f"{head}: {row['time_ms']:.4g} ms, {row['gbps']:.3g} GB/s{pct}"
    return f"{head}: {row['bytes_per_param']:.4f} bytes/param"


def header(command: str):
    """The first line on stderr: what runs where."""
    def line(total: int, doc: dict) -> str:
        env = doc["env"]
        isa = f", {env['cpu_isa']}" if env["device"] == "cpu" and env.get("cpu_isa") else ""
        cpus = env_cpus(env) if env["device"] == "cpu" else ""  # "1 of 2 CPUs on 2 cores" under taskset
        isa += f", {cpus}" if cpus else ""
        return (f"bench {command} on {env['device']} ({env['device_name']}{isa}, torch threads "
                f"{env['torch_threads']}, torch {env['torch']}): {total} rows")
    return line


KERNELS_HELP = ("Time optimizer steps (ours and baselines) over a size sweep or a model's shapes, against the copy "
                "roofline; exit 1 if a row failed.")


ONE_ROUND_WARNING = ("warning: --rounds {rounds}: compare can then only test the samples as independent draws, "
                     "which a shared or drifting machine breaks (use --rounds 3 or more)")  # < 160: one line


@options_command(bench_app, "kernels", kernels_engine.KernelsOptions, help=KERNELS_HELP, outputs=("json", "csv"))
def kernels(opts: kernels_engine.KernelsOptions, out: Destinations) -> None:
    def show(doc: dict) -> None:
        title = (f"Optimizer step time ({opts.optimizer}, {doc['env']['device']}; "
                 f"roofline = measured copy bandwidth)")
        output.stdout.print(output.table(title, summary.kernel_display_rows(doc["records"]), summary.KERNEL_COLUMNS,
                                         summary.KERNEL_FORMATS, summary.KERNEL_HEADERS))

    def head(total: int, doc: dict) -> str:  # after the options were checked: a usage error stays one line
        line = header("kernels")(total, doc)
        return line + "\n" + ONE_ROUND_WARNING.format(rounds=opts.rounds) if opts.rounds < 2 else line

    doc = output.run_engine(kernels_engine.execute, opts, out, show, row_line=row_line, header=head)
    output.exit_on_failed_rows(doc, "bench kernels")


MEMORY_HELP = ("Optimizer-state bytes per parameter (exact accounting) and the peak memory of a step per "
               "parameter (torch.cuda allocator on CUDA, process RSS on a Linux CPU); exit 1 if a row failed.")


@options_command(bench_app, "memory", memory_engine.MemoryOptions, help=MEMORY_HELP, outputs=("json", "csv"))
def memory(opts: memory_engine.MemoryOptions, out: Destinations) -> None:
    def show(doc: dict) -> None:
        device = doc["env"]["device"]
        title = f"Optimizer-state memory ({opts.optimizer}, {opts.dtype} parameters, {device}"
        rows = summary.memory_display_rows(doc["records"])
        source = summary.memory_source(rows)
        if source == "process-rss":
            title += "; peaks: process RSS over RSS before, per parameter)"
        elif source == "cuda-allocator":
            title += "; peaks: torch.cuda allocated bytes over those before, per parameter)"
        else:
            title += "; measured columns need CUDA, or Linux /proc on a CPU)"
        output.stdout.print(output.table(title, rows, summary.memory_columns(rows),
                                         summary.MEMORY_FORMATS, summary.MEMORY_HEADERS))

    doc = output.run_engine(memory_engine.execute, opts, out, show, row_line=row_line, header=header("memory"))
    output.exit_on_failed_rows(doc, "bench memory")


HEADLINE_HELP = ("The headline preset: the fused 4-bit AdamW kernel at 1e8 elements (nearest, BReD, v on uint4) "
                 "and a qstate step, against the copy bandwidth and torch's fused AdamW; exit 1 if a row failed.")


@options_command(bench_app, "headline", headline_engine.HeadlineOptions, help=HEADLINE_HELP,
                 outputs=("json", "csv"), output_help={"json": "Write the results JSON here (rewritten after every "
                                                               "row; the summary under 'headline'); '-': stdout."})
def headline(opts: headline_engine.HeadlineOptions, out: Destinations) -> None:
    def show(doc: dict) -> None:
        title = f"Headline: fused 4-bit AdamW step, {opts.numel:,} elements on {doc['env']['device']} (roofline = copy)"
        columns = [c for c in summary.KERNEL_COLUMNS if c not in ("x_fused", "compile_ms", "note")]
        output.stdout.print(output.table(title, summary.kernel_display_rows(doc["records"]),
                                         columns + ["timing", "note"], summary.KERNEL_FORMATS, summary.KERNEL_HEADERS))
        for line in headline_engine.summary_lines(headline_engine.summarize(doc["records"])):
            output.stdout.print(line, highlight=False, markup=False)

    doc = output.run_engine(headline_engine.execute, opts, out, show, row_line=row_line, header=header("headline"))
    failed = [r["name"] for r in doc["records"] if r["status"] != "ok"]
    if failed:
        raise CheckFailed(f"{len(failed)} headline row(s) failed: {', '.join(failed)}")


register_train(bench_app)
