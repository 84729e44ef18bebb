"""`qstate report` and `qstate compare` (thin; see qstate_cli/report and qstate_cli/compare)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import CheckFailed
from . import output


def register(app: typer.Typer) -> None:
    app.command("report")(report)
    app.command("compare")(compare)


def report(
    results: List[Path] = typer.Argument(..., help="Results files, or folders of them (e.g. results/quick)."),
    html: Optional[Path] = typer.Option(None, "--html", help="Write the HTML report here."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Write the Markdown report here."),
    out_dir: Path = typer.Option(Path("reports"), "--out", "-o", help="Folder for the reports not named by "
                                 "--html/--markdown."),
    plots: bool = typer.Option(False, "--plots", help="Also save the plots as PNG next to the Markdown and link them."),
    title: Optional[str] = typer.Option(None, "--title", help="Report title."),
):
    """Make one self-contained HTML report and a GitHub Markdown report from results."""
    from ..report import load_documents, write_report
    from ..results import check_folder, check_writable

    stem = results[0].stem if results[0].is_file() else results[0].name
    if html is None and markdown is None:
        html, markdown = out_dir / f"{stem}.html", out_dir / f"{stem}.md"
    plots_dir = (Path(markdown).parent / f"{Path(markdown).stem}-plots") if plots and markdown else None
    for flag, path in (("--html", html), ("--markdown", markdown)):  # before any work
        if path is not None:
            check_writable(path, flag)
    if plots_dir is not None:
        check_folder(plots_dir, "--plots")
    docs, sources = load_documents(results)
    for path in write_report(docs, html, markdown, sources=sources, title=title, plots_dir=plots_dir):
        output.stderr.print(f"wrote {path}")


def compare(
    baseline: Path = typer.Argument(..., help="Baseline results (a file or a folder of them)."),
    new: Path = typer.Argument(..., help="New results (a file or a folder of them)."),
    threshold: float = typer.Option(1.10, "--threshold", help="Timing: a median ratio above this may regress."),
    alpha: float = typer.Option(0.01, "--alpha", help="Timing: Mann-Whitney significance level."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write github-action-benchmark JSON "
                                             "(customSmallerIsBetter) here."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the Markdown verdict table here."),
    results_path: Optional[Path] = typer.Option(None, "--results", help="Write the verdicts as a results file "
                                                "(kind compare, for `qstate report`)."),
):
    """Compare NEW against BASELINE: verdict table on stdout; exit 1 on any regression."""
    from ..compare import compare_paths, verdict_markdown
    from ..results import check_writable, write_json_atomic, write_text_atomic

    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    for flag, path in (("--markdown", markdown), ("--json", json_path), ("--results", results_path),
                       ("GITHUB_STEP_SUMMARY", summary)):  # before any work
        if path:
            check_writable(path, flag)
    verdict = compare_paths(baseline, new, threshold, alpha)
    text = verdict_markdown(verdict)
    typer.echo(text, nl=False)
    if markdown:
        write_text_atomic(markdown, text)
    if json_path:
        write_json_atomic(json_path, verdict.benchmark())
    if results_path:
        write_json_atomic(results_path, verdict.document())
    if summary:
        with open(summary, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if verdict.regressions:
        names = sorted({f"{r['kind']}: {r['name']}" for r in verdict.regressions})
        raise CheckFailed(f"{len(verdict.regressions)} regression(s): " + "; ".join(names[:5])
                          + (f"; and {len(names) - 5} more" if len(names) > 5 else ""))
