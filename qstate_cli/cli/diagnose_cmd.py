"""`qstate diagnose TRACE` and `qstate diagnose --theory`: the options of diagnose/run.py
plus --json/--html/--markdown, shown as the ranked summary (diagnose/tables.py)."""
from __future__ import annotations

import typer

from ..diagnose import distributed
from ..errors import QstateError
from ..diagnose import run as engine
from . import output
from .commands import options_command
from .output import Destinations

HELP = ("Replay a gradient trace through quantized optimizer states.\n\nMeasures drift, error variance, stalling, "
        "staleness and update fidelity per configuration and state, with the staleness model's prediction beside "
        "what was observed, and recommends a reset period.")


def register(app: typer.Typer) -> None:
    @options_command(app, "diagnose", engine.DiagnoseOptions, help=HELP, outputs=("json", "html", "markdown"),
                     inputs=("trace",), output_help={"json": "Write the full result document here ('-': stdout)."})
    def diagnose(opts: engine.DiagnoseOptions, out: Destinations) -> None:
        if not opts.theory and not opts.trace:  # the engine's message also speaks of suite points
            raise QstateError("diagnose needs a TRACE (a trace file, `demo` or `corpus:NAME`), or --theory; make "
                              "one with `qstate trace demo`")
        if distributed.launched() and distributed.rank() != 0:
            if not opts.theory:
                engine.execute(opts)  # under torchrun: replay this rank's share; rank 0 writes everything
            return
        show = _print_theory if opts.theory else (lambda doc: _print_summary(doc, opts.profile))
        output.run_engine(engine.execute, opts, out, show, transient=True)


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
    failed = (meta.get("gradient_checks") or {}).get("failed")
    if failed:  # said whether or not a prediction missed: the Gaussian columns rest on it
        output.stdout.print(f"gradient checks: the Gaussian model's assumptions do not hold on this trace: "
                            f"{'; '.join(failed)} (the empirical model, 'emp', takes the trace's own gradients)")
    for r in doc["records"]:
        if r.get("model_warning"):
            output.stdout.print(f"model warning {r['config']} {r['state']}: {r['model_warning']}")
    if meta.get("nonfinite_grads"):
        output.stdout.print(f"non-finite gradient elements: {meta['nonfinite_grads']} (counted, replayed as 0)")
    for note in meta.get("notes", []):
        output.stdout.print(f"note: {note}")
    if profile:
        prof_rows, prof_title = profile_rows(meta["profile"])
        output.stdout.print(prof_title)
        formats = {"seconds": ".2f", "compiling_s": ".2f", "loading_s": ".2f", "first_step_setup_s": ".3f",
                   "M_element_steps_per_s": ".2f"}
        output.stdout.print(output.table(None, prof_rows, formats=formats))


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
