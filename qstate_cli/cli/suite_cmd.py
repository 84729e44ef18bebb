"""`qstate run SUITE.yaml`, `qstate suite validate`, `qstate suite schema` (thin; see qstate_cli/suites)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Optional

import typer

from . import output
from .group import new_group

suite_app = new_group("suite", "Check YAML suites and print their JSON Schema.")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.add_typer(suite_app)


def resume_command(suite, sets, out) -> str:
    """The command that continues an interrupted `qstate run`: the same suite and every
    --set (a resumed run must expand to the same points), shell-quoted, plus --resume."""
    words = ["qstate", "run", str(suite)]
    for value in sets or []:
        words += ["--set", value]
    words += ["--out", str(out), "--resume"]
    return " ".join(shlex.quote(w) for w in words)


def _check_inputs_kept(loaded, suite: Path, out: Path, report: bool) -> None:
    """No file the run writes (OUT/<run>.json, the report) may be one it reads: the suite
    file (`run sy2/m.json --out sy2` replaced a run `m`'s suite with its results) or a trace."""
    inputs = [("SUITE", suite)] + [("trace", point.params["trace"]) for _, points in loaded.points()
                                   for point in points if isinstance(point.params.get("trace"), str)]
    outputs = [("--out", out / f"{r['name']}.json") for r in loaded.runs]
    if report:
        outputs += [("--out", out / "report.html"), ("--out", out / "report.md")]
    output.check_outputs(outputs, inputs)


def run(
    suite: Path = typer.Argument(..., help="The suite file (YAML), e.g. suites/quick.yaml."),
    sets: Optional[List[str]] = typer.Option(None, "--set", help="Override KEY=VALUE (YAML value): a parameter "
                                             "of the runs that name it, else of every run (device=cpu), or a path "
                                             "(runs.kernels.axes.numel=[4096]); docs/reports.md."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for the results (default results/<suite>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run: skip the points already done."),
    report: bool = typer.Option(True, "--report/--no-report", help="Also write OUT/report.html and OUT/report.md."),
):
    """Run a suite: every point of its axes, results written as each one finishes."""
    from ..progress import Progress
    from ..results import check_folder
    from ..suites import load_suite
    from ..suites.runner import run_suite

    loaded = load_suite(suite, sets or [])
    for note in loaded.notes:
        output.stderr.print(f"[dim]note: {note}[/]")
    out = out or Path("results") / loaded.name
    check_folder(out, "--out")  # before any work
    _check_inputs_kept(loaded, suite, out, report)
    view = output.progress_view(loaded.name)  # a bar on a terminal, a line per point in a log
    progress = Progress(on_begin=lambda total, _: view.begin(total),  # once the files are open: an input
                        on_start=view.unit, on_log=view.log)          # error is one line
    finished = False
    try:
        try:
            runs = run_suite(loaded, out, resume=resume, progress=progress)
            finished = True
        finally:
            view.stop(finished)
    except KeyboardInterrupt:
        output.stderr.print(f"interrupted: finished points are kept in {out}/; continue with "
                            f"`{resume_command(suite, sets, out)}`", markup=False, highlight=False, soft_wrap=True)
        raise
    rows = [{"run": r.name, "kind": r.kind, "points": len(r.state["points"]), "done": len(r.state["done"]),
             "failed": len(r.state["failed"]), "rows": len(r.doc["records"]), "file": str(r.path)} for r in runs]
    written = []
    if report:  # before the table: a stdout that fails (`> /dev/full`, `| true`) still leaves the report
        from ..report import write_report

        written = write_report([r.doc for r in runs], out / "report.html", out / "report.md",
                               sources=[str(r.path) for r in runs], title=f"qstate suite {loaded.name}",
                               picked_in=out)  # names qstate picks: regular files in OUT (atomic.py)
    output.stdout.print(output.table(f"Suite {loaded.name}", rows))
    if report:
        output.stderr.print("report: " + ", ".join(str(p) for p in written))
    _exit_on_failed_points(rows, resume_command(suite, sets, out))


def _exit_on_failed_points(rows: list[dict], retry: str) -> None:
    """Exit 1 (CheckFailed), once every file is written, when a point failed (a row `status:
    failed`: it crashed, or ran out of memory at one size), with one stderr line saying how
    many and in which files. The sweep goes on past a failed point, but its exit code must not say all
    is well: `qstate run suites/ci.yaml --out reports/ci-baseline` wrote a baseline with
    failed rows, exit 0, and a CI step that runs a suite could not tell. A row "unavailable"
    or "skipped" (a peer library not installed here) is expected, and no failure."""
    failed = sum(row["failed"] for row in rows)
    if not failed:
        return
    from ..errors import CheckFailed

    where = ", ".join(f"{row['failed']} in {row['file']}" for row in rows if row["failed"])
    raise CheckFailed(f"{failed} of {sum(row['points'] for row in rows)} points failed ({where}: rows with status "
                      f"failed, whose reason says why); `{retry}` retries them")


@suite_app.command("validate")
def validate(
    suites: List[Path] = typer.Argument(..., help="Suite files to check."),
    sets: Optional[List[str]] = typer.Option(None, "--set", help="Override KEY=VALUE as `qstate run --set` does "
                                             "(checks what that run would run)."),
):
    """Check suites: every problem of the first check that finds any (the schema, the runs,
    their parameters, each point's values) as FILE:LINE: KEY: message (or --set TEXT: KEY:
    message for a value an override gave)."""
    from ..errors import QstateError
    from ..suites import SuiteError, load_suite

    failed = 0
    for path in suites:
        try:
            loaded = load_suite(path, sets or [])
        except SuiteError as exc:
            failed += 1
            for issue in exc.issues:
                typer.echo(issue, err=True)
            continue
        except QstateError as exc:  # not a suite at all (a folder, no file, a bad --set): the next one
            failed += 1
            typer.echo(str(exc), err=True)
            continue
        n = sum(len(points) for _, points in loaded.points())
        runs = ", ".join(f"{r['name']} ({r['kind']})" for r in loaded.runs)
        typer.echo(f"ok: {path}: {len(loaded.runs)} run(s), {n} points: {runs}")
        for note in loaded.notes:
            typer.echo(f"note: {path}: {note}", err=True)
    if failed:
        raise typer.Exit(2)


@suite_app.command("schema")
def schema():
    """Print the suite JSON Schema (for editors: yaml-language-server, VS Code)."""
    try:
        from ..suites.schema import json_schema
    except ImportError as exc:  # no pydantic, or one too old (the GPU machine has none)
        from ..errors import QstateError
        from ..suites.load import _no_schema

        raise QstateError("suite schema: " + _no_schema(exc).split(":")[0] + "; the schema is pydantic's "
                          "(pip install 'pydantic>=2.5')") from None
    output.print_json(json_schema())
