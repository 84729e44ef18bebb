"""`qstate trace demo` and `qstate trace info`: thin wrappers over qstate_cli.trace."""
from __future__ import annotations

from pathlib import Path

import typer

from . import completion, output
from .group import new_group

trace_app = new_group("trace", "Gradient traces: record a demo trace, summarize a trace.")


def register(app: typer.Typer) -> None:
    app.add_typer(trace_app, name="trace")


@trace_app.command("demo")
def demo(
    out: Path = typer.Option(Path("trace.pt"), "--output", "-o", help="Where to write the trace."),
    steps: int = typer.Option(2000, "--steps", help="Training steps to run and record (~40-60 steps/s on one CPU core)."),
    model: str = typer.Option("tiny-lm", "--model", help="Built-in model: tiny-lm or small-lm.",
                              autocompletion=completion.trained_models),
    blocks_per_tensor: int = typer.Option(1, "--blocks-per-tensor", help="2048-element blocks recorded per tensor."),
    grad_dtype: str = typer.Option("bf16", "--grad-dtype", help="Recorded gradient precision: bf16 or fp32.",
                                   autocompletion=completion.grad_dtypes),
    seed: int = typer.Option(0, "--seed", help="Seed of the model, the data order and the block sampling."),
):
    """Train a tiny byte-level LM on Python's own help text (CPU) and record its gradients."""
    from ..options import parse_seed
    from ..results import check_writable
    from ..trace.demo import DemoSettings, run_demo

    seed = parse_seed(seed)
    settings = DemoSettings(steps=steps, model=model, blocks_per_tensor=blocks_per_tensor,
                            grad_dtype=grad_dtype, seed=seed)
    _check_demo(settings)
    check_writable(out, "--output")  # before the training
    summary = run_demo(out, settings, log=output.stderr.print)
    output.stdout.print(output.table(f"wrote {out}", [summary]))
    output.stderr.print(f"next: qstate diagnose {out}")


def _check_demo(s) -> None:
    """What the recording would refuse, in the command's terms, before any training: the
    flags' values, and a trace over the recorder's size cap (its `max_mib`)."""
    import inspect

    from ..errors import QstateError
    from ..models import tiny_lm
    from ..quant.formats import suggest
    from ..trace.recorder import Recorder
    from ..trace.schema import GRAD_DTYPES

    if s.steps < 1:
        raise QstateError(f"--steps {s.steps}: must be >= 1")
    if s.blocks_per_tensor < 1:
        raise QstateError(f"--blocks-per-tensor {s.blocks_per_tensor}: must be >= 1")
    if s.grad_dtype not in GRAD_DTYPES:
        raise QstateError(f"--grad-dtype {s.grad_dtype!r}: choose from {', '.join(GRAD_DTYPES)}")
    if s.model not in tiny_lm.SIZES:
        raise QstateError(f"--model {s.model!r}: unknown{suggest(s.model, tiny_lm.SIZES)}")
    import torch

    model = tiny_lm.build(s.model, s.seed)  # a fraction of a second: what the recorder would take
    plan = Recorder(torch.optim.AdamW(model.parameters()), None, model=model, blocks_per_tensor=s.blocks_per_tensor,
                    seed=s.seed, grad_dtype=s.grad_dtype, partial=False)
    cap = inspect.signature(Recorder).parameters["max_mib"].default
    mib = s.steps * plan.row_mib
    if mib > cap:
        most = int(cap // plan.row_mib)
        raise QstateError(f"--steps {s.steps}: the trace would be {mib:,.0f} MiB, over the {cap:,.0f} MiB cap on a "
                          f"trace; use at most {most:,} steps" + (" (or fewer --blocks-per-tensor)"
                                                                   if s.blocks_per_tensor > 1 else ""))


@trace_app.command("info")
def info(
    trace: Path = typer.Argument(..., autocompletion=completion.traces, help="Trace file or directory of shards; `demo` or `corpus:NAME` "
                                           "(recorded on first use)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary and tensor rows as JSON."),
):
    """Summarize a trace: optimizer, steps, tensors, recorded blocks, gradient RMS, NaN/Inf."""
    from ..trace import load_trace
    from ..trace.corpus import resolve
    from ..trace.demo import info as trace_info

    loaded = load_trace(resolve(trace, log=output.stderr.print))
    summary, rows = trace_info(loaded)
    if as_json:  # the hyper-parameters as an object (the table shows them as one line of text)
        output.print_json({"summary": {**summary, "hparams": dict(loaded.hparams)}, "tensors": rows})
        return
    output.stdout.print(output.table(f"trace {trace}", [{"field": k, "value": v} for k, v in summary.items()]))
    output.stdout.print(output.table("tensors", rows, formats={"grad_rms": ".3e"}))


@trace_app.command("corpus")
def corpus(
    record: list[str] = typer.Option([], "--record", help="Record these corpus traces now if not cached "
                                                          "(repeatable; 'all': every one)."),
    sha256: bool = typer.Option(False, "--sha256", help="Also load each cached trace and print the sha256 of its "
                                                        "gradients (equal for the same seed, torch build and CPU)."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
):
    """The trace corpus: named traces usable as `corpus:NAME` wherever a trace path is (recorded on first use)."""
    from ..trace import corpus as corpus_lib

    names = list(corpus_lib.ENTRIES) if "all" in record else record
    for name in names:
        corpus_lib.entry(name)  # every name checked before any recording starts
    for name in names:
        corpus_lib.cached_trace(name, log=output.stderr.print)
    rows = corpus_lib.listing(with_fingerprint=sha256)
    for row in rows:  # no package needed: null, as the other fields say nothing (the table shows "-")
        row["needs"] = ", ".join(corpus_lib.entry(row["name"][len(corpus_lib.PREFIX):]).needs) or None
    if as_json:
        output.print_json(rows)
        return
    output.stdout.print(output.table(f"trace corpus (cache: {corpus_lib.cache_dir()})", rows))
