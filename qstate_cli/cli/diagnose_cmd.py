"""`qstate diagnose TRACE` and `qstate diagnose --theory`: thin wrappers over qstate_cli.diagnose."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import QstateError
from ..results import write_json_atomic
from . import output


def register(app: typer.Typer) -> None:
    app.command("diagnose")(diagnose)


def diagnose(
    trace: Optional[Path] = typer.Argument(None, help="Trace file or directory of shards (from `qstate trace demo` or the Recorder); 'demo': the cached demo trace, made on first use."),
    config: List[str] = typer.Option([], "--config", "-c", help="Configuration to replay (repeatable): preset or m=SPEC,v=SPEC."),
    bits: List[int] = typer.Option([], "--bits", help="Add the linear presets at these bits (4, 8; repeatable)."),
    rounding: List[str] = typer.Option([], "--rounding", help="With --bits: nearest, stochastic, bred (repeatable; default all)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", "-b", help="Block size for every block-scaled state (power of two, 32..2048)."),
    reset: str = typer.Option("none", "--reset", help="Reset policy the replay applies: none, N (every N steps) or auto (staleness model)."),
    steps_limit: Optional[int] = typer.Option(None, "--steps-limit", help="Replay only the first N recorded steps."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when present), cpu or cuda."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the full result document here ('-': stdout)."),
    html: Optional[Path] = typer.Option(None, "--html", help="Write an HTML report here."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Write a Markdown report here."),
    profile: bool = typer.Option(False, "--profile", help="Print replay throughput (element-steps per second) per phase."),
    theory: bool = typer.Option(False, "--theory", help="Only the staleness model: predicted stall probabilities and reset periods."),
    fmt: List[str] = typer.Option([], "--format", "-f", help="With --theory: float formats (default bf16, e4m3, e2m2)."),
    beta2: float = typer.Option(0.999, "--beta2", help="With --theory: the second-moment beta."),
):
    """Replay a gradient trace through quantized optimizer states.

    Measures drift, error variance, stalling, staleness and update fidelity per
    configuration and state, with the staleness model's prediction beside what was
    observed, and recommends a reset period."""
    from .. import diagnose as engine

    if theory:
        doc = engine.theory_document(fmt or engine.run.THEORY_FORMATS, beta2)
        _emit(doc, json_path, html, markdown, lambda: _print_theory(doc))
        return
    if trace is None:
        raise QstateError("diagnose needs a TRACE (or --theory); make one with `qstate trace demo`")
    configs = engine.select_configs(config, bits, rounding, block_size)
    with _progress(f"replaying {len(configs)} configurations") as advance:
        doc, _ = engine.diagnose(trace, configs, reset=reset, steps_limit=steps_limit, device=device,
                                 progress=advance, profile_phases=profile)
    _emit(doc, json_path, html, markdown, lambda: _print_summary(doc, profile))


@contextmanager
def _progress(label: str):
    """A transient progress bar on stderr; yields advance(done, total)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=output.stderr, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def advance(done: int, total: int) -> None:
            if done == 1 or done == total or done % 10 == 0:
                bar.update(task, completed=done, total=total)

        yield advance


def _emit(doc: dict, json_path, html, markdown, show) -> None:
    if json_path is not None and str(json_path) == "-":
        output.print_json(doc)
    else:
        show()
        if json_path is not None:
            write_json_atomic(json_path, doc)
            output.stderr.print(f"wrote {json_path}")
    if html is not None or markdown is not None:
        try:
            from ..report import write_report
        except ImportError:
            raise QstateError("HTML/Markdown reports need qstate_cli.report") from None
        write_report([doc], html, markdown)
        for p in (html, markdown):
            if p is not None:
                output.stderr.print(f"wrote {p}")


def _print_summary(doc: dict, profile: bool) -> None:
    from ..diagnose.tables import profile_rows, summary_columns, summary_rows

    rows = summary_rows(doc)
    meta = doc["meta"]
    title = (f"qstate diagnose: {meta['trace']} ({meta['optimizer']}, {meta['steps']} steps x "
             f"{meta['recorded_elements']} elements; ranked by update error vs fp32 states)")
    cols, fmts, heads = summary_columns(rows)
    output.stdout.print(output.table(title, rows, cols, fmts, heads))
    for r in rows:
        output.stdout.print(f"reset {r['config']}: {r['reset_reason']}")
    if meta.get("nonfinite_grads"):
        output.stdout.print(f"non-finite gradient elements: {meta['nonfinite_grads']} (counted, replayed as 0)")
    for note in meta.get("notes", []):
        output.stdout.print(f"note: {note}")
    if profile:
        prof_rows, prof_title = profile_rows(meta["profile"])
        output.stdout.print(prof_title)
        output.stdout.print(output.table(None, prof_rows, formats={"seconds": ".2f", "M_element_steps_per_s": ".2f"}))


def _print_theory(doc: dict) -> None:
    rows = doc["theory"]
    cols = ["format", "rounding", "beta2", "fraction_bits", "rho", "p_stall_t10", "p_stall_t100",
            "p_stall_t1000", "p_stall_steady", "reset_period", "reported_period"]
    output.stdout.print(output.table(
        f"Staleness model (Topollai & Choromanska): P(stall) of v after t steps from a reset, "
        f"beta2={doc['meta']['beta2']}", rows, cols,
        headers={"fraction_bits": "p", "reported_period": "paper"}))
    output.stdout.print("reset_period: first step at which P(stall) reaches 90% of its steady state; "
                        "BReD never stalls (P = 0).")
