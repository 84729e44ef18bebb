"""`qstate report` and `qstate compare` (thin; see qstate_cli/report and qstate_cli/compare)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import CheckFailed, QstateError
from ..optim.registry import names_text
from . import completion, output


def register(app: typer.Typer) -> None:
    app.command("report")(report)
    app.command("compare")(compare)


def report(
    results: List[Path] = typer.Argument(..., help="Results files, or folders of them (e.g. results/quick)."),
    html: Optional[Path] = typer.Option(None, "--html", help="Write the HTML report here."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Write the Markdown report here."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for both reports, STEM.html and "
                                           "STEM.md (STEM: the first RESULTS' name), when neither --html nor "
                                           "--markdown is given (default: reports).", show_default=False),
    plots: bool = typer.Option(False, "--plots", help="Also save the plots as PNG next to the Markdown and link them."),
    title: Optional[str] = typer.Option(None, "--title", help="Report title."),
):
    """Make one self-contained HTML report and a GitHub Markdown report from results."""
    from ..atomic import WRITE_ERRNOS
    from ..report import load_documents, write_report
    from ..results import check_folder, check_inside, check_writable, writes_in_place

    stem = results[0].stem if results[0].is_file() else results[0].name
    if out_dir is not None and (html is not None or markdown is not None):  # it would be ignored
        named = " and ".join(flag for flag, path in (("--html", html), ("--markdown", markdown)) if path is not None)
        raise QstateError(f"--out {out_dir}: not used with {named} (--out is the folder of both reports when "
                          f"neither --html nor --markdown is given): drop --out, or put the folder in {named}'s path")
    picked_in = None  # the folder in which qstate names the reports (atomic.py: written as regular files there)
    if html is None and markdown is None:
        out_dir = picked_in = Path("reports") if out_dir is None else out_dir
        html, markdown = out_dir / f"{stem}.html", out_dir / f"{stem}.md"
    # the PNGs go in MARKDOWN's folder, as MARKDOWN-plots/ (a device at a name qstate picked is replaced: atomic.py)
    if plots and (markdown is None or (picked_in is None and writes_in_place(markdown))):
        raise QstateError("--plots saves the PNGs beside the Markdown report: give --markdown a file in a folder"
                          + ("" if markdown is None else f" ({markdown} is a device or a pipe)"))
    plots_dir = (Path(markdown).parent / f"{Path(markdown).stem}-plots") if plots and markdown else None
    for flag, path in (("--html", html), ("--markdown", markdown)):  # before any work
        if path is not None:
            check_writable(path, flag, picked_in)
    output.check_outputs((("--html", html), ("--markdown", markdown)),
                         [pair for path in results for pair in _read("RESULTS", path)])
    if plots_dir is not None:
        check_folder(check_inside(plots_dir, plots_dir.parent), "--plots")
    docs, sources = load_documents(results)
    try:
        written = write_report(docs, html, markdown, sources=sources, title=title, plots_dir=plots_dir,
                               picked_in=picked_in)
    except OSError as exc:  # the PNGs (the reports themselves are atomic writes, which name their file)
        if exc.errno not in WRITE_ERRNOS:
            raise
        raise QstateError(f"{exc.filename or plots_dir}: cannot write ({exc.strerror or exc})") from None
    for path in written:
        output.stderr.print(f"wrote {path}")


def _read(label: str, path: Path) -> list[tuple[str, Path]]:
    """The results files a path stands for (a folder: its *.json, as report.load_documents
    reads them), labelled for output.check_outputs."""
    path = Path(path)
    files = sorted(f for f in path.glob("*.json") if not f.name.startswith(".")) if path.is_dir() else [path]
    return [(label, f) for f in files]


def _append(path, text: str) -> None:
    """Append to $GITHUB_STEP_SUMMARY, creating its folder as --markdown's write does
    (check_writable vetted it before any work)."""
    from ..results import write_target, writes_in_place

    try:
        if not writes_in_place(path):
            write_target(Path(path)).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise QstateError(f"GITHUB_STEP_SUMMARY {path}: cannot write ({exc.strerror or exc})") from None


def compare(
    baseline: Path = typer.Argument(..., help="Baseline results (a file or a folder of them); with --ab, a "
                                    "configuration."),
    new: Path = typer.Argument(..., help="New results (a file or a folder of them); with --ab, a configuration."),
    threshold: float = typer.Option(1.10, "--threshold", help="Timing: a median ratio above this may regress."),
    alpha: float = typer.Option(0.01, "--alpha", help="Timing, rows without rounds only (older files, bench "
                                "kernels --rounds 1): two-sided Mann-Whitney significance level. Rows with rounds "
                                "regress only when their rounds are fully apart, an exact one-sided test whose level "
                                "the round counts fix: 1/C(2R, R) for R rounds a side (0.05 at 3, 1/252 at 5); "
                                "--ab: the sign test of R paired rounds, 1/2^R."),
    allow_missing: Optional[List[str]] = typer.Option(None, "--allow-missing", metavar="NAME", help="A baseline row "
                                                      "NEW lacks or could not run (a peer not installed here) is "
                                                      "no regression when NAME names it: its name or config, or a "
                                                      "glob (bnb-*); repeatable. Failed rows still fail."),
    strict_timing: bool = typer.Option(False, "--strict-timing", help="For a dedicated runner: a timing row that "
                                       "could not be judged (noisy: a shared CPU, a copy reference that moved) is a "
                                       "regression."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write github-action-benchmark JSON "
                                             "(customSmallerIsBetter) here; noisy rows are left out."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the Markdown verdict table here."),
    results_path: Optional[Path] = typer.Option(None, "--results", help="Write the verdicts as a results file "
                                                "(kind compare, for `qstate report`)."),
    ab: bool = typer.Option(False, "--ab", help="A/B: time the configurations BASELINE and NEW alternately in this "
                            "process (paired rounds) instead of comparing result files."),
    numel: Optional[List[str]] = typer.Option(None, "--numel", "-n", help="--ab: tensor sizes (default 2^16 on CPU, "
                                              "2^24 on CUDA)."),
    dtype: Optional[List[str]] = typer.Option(None, "--dtype", autocompletion=completion.dtypes, help="--ab: parameter dtype (default fp32)."),
    optimizer: str = typer.Option("adamw", "--optimizer", autocompletion=completion.optimizers, help=f"--ab: {names_text()}."),
    backend: str = typer.Option("auto", "--backend", autocompletion=completion.backends, help="--ab: auto, reference, triton or cpu (the numba path)."),
    device: str = typer.Option("auto", "--device", autocompletion=completion.devices, help="--ab: auto, cuda or cpu."),
    rounds: int = typer.Option(5, "--rounds", help="--ab: paired rounds."),
    rep_ms: Optional[float] = typer.Option(None, "--rep-ms", help="--ab: timed ms per configuration (default 100)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="--ab: CPU threads for torch."),
):
    """Compare NEW against BASELINE: verdict table on stdout; exit 1 on any regression."""
    from ..compare import compare_paths, verdict_markdown
    from ..results import check_writable, write_json_atomic, write_text_atomic

    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    written = (("--markdown", markdown), ("--json", json_path), ("--results", results_path),
               ("GITHUB_STEP_SUMMARY", summary))
    for flag, path in written:  # before any work
        if path:
            check_writable(path, flag)
    read = [] if ab else _read("BASELINE", baseline) + _read("NEW", new)  # --ab: configurations, not files
    output.check_outputs(written[:3], read)
    output.check_outputs([("GITHUB_STEP_SUMMARY", summary or None)], read)  # appended to: may be --markdown too
    if ab and allow_missing:
        raise QstateError("--allow-missing applies to result files: drop --ab, or drop --allow-missing")
    if any(not str(p).strip() for p in allow_missing or ()):  # before any file is read
        raise QstateError("--allow-missing '': name the rows NEW may lack (a name or glob, e.g. bnb-*)")
    if ab:
        from ..compare.ab import ABOptions, run_ab

        opts = ABOptions(base=str(baseline), new=str(new), numel=numel or [], dtype=dtype or [], optimizer=optimizer,
                         backend=backend, device=device, rounds=rounds, rep_ms=rep_ms, threads=threads)
        from ..progress import Progress
        from .bench_cmd import row_line

        verdict, _ = run_ab(opts, threshold, Progress(on_row=lambda r: output.stderr.print(
            row_line(r), highlight=False, markup=False)), strict_timing)
    else:
        given = [flag for flag, value, default in (("--numel", numel, None), ("--dtype", dtype, None),
                                                   ("--optimizer", optimizer, "adamw"), ("--backend", backend, "auto"),
                                                   ("--device", device, "auto"), ("--rounds", rounds, 5),
                                                   ("--rep-ms", rep_ms, None), ("--threads", threads, None))
                 if value not in (default, [])]
        if given:
            raise QstateError(f"{given[0]} is an A/B option: add --ab (qstate compare --ab BASE_CONFIG NEW_CONFIG)")
        verdict = compare_paths(baseline, new, threshold, alpha, allow_missing or (), strict_timing)
    text = verdict_markdown(verdict)
    typer.echo(text, nl=False)
    if markdown:
        write_text_atomic(markdown, text)
    if json_path:
        write_json_atomic(json_path, verdict.benchmark())
    if results_path:
        write_json_atomic(results_path, verdict.document())
    if summary:
        _append(summary, text + "\n")
    if verdict.regressions:
        names = sorted({f"{r['kind']}: {r['name']}" for r in verdict.regressions})
        raise CheckFailed(f"{len(verdict.regressions)} regression(s): " + "; ".join(names[:5])
                          + (f"; and {len(names) - 5} more" if len(names) > 5 else ""))
