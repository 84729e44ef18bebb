"""`qstate bench train`: train the same small LM with each state configuration."""
from __future__ import annotations

from typing import List, Optional

import typer

from ..errors import QstateError
from ..train.study import DEFAULT_CONFIGS, TrainSettings
from . import output

SUMMARY_COLUMNS = ["config", "reset_period", "final_val_loss_mean", "best_val_loss_mean", "gap_to_fp32_mean",
                   "gap_to_fp32_std", "diverged", "diverged_at_step_min", "steps_per_s_mean", "bytes_per_param"]
HEADERS = {"reset_period": "reset every", "final_val_loss_mean": "final val", "best_val_loss_mean": "best val",
           "gap_to_fp32_mean": "gap to fp32", "gap_to_fp32_std": "gap std", "diverged_at_step_min": "at step",
           "steps_per_s_mean": "steps/s", "bytes_per_param": "state B/param"}
FORMATS = {"final_val_loss_mean": ".4f", "best_val_loss_mean": ".4f", "gap_to_fp32_mean": "+.4f",
           "gap_to_fp32_std": ".4f", "steps_per_s_mean": ".1f", "bytes_per_param": ".3f"}


def train(
    config: Optional[List[str]] = typer.Option(
        None, "--config", "-c", help="Run CONFIG[@reset=none|N|auto][@lr=X]; repeat for several. "
        f"Default: {' '.join(DEFAULT_CONFIGS)}. fp32 is always run: gaps are measured against it."),
    optimizer: str = typer.Option("adamw", "--optimizer", "-o", help="adamw | adam | lion | sgd | muon."),
    steps: int = typer.Option(500, "--steps", "-n", help="Training steps per run."),
    model: str = typer.Option("tiny-lm", "--model", "-m", help="tiny-lm (0.14 M params) | small-lm (0.9 M)."),
    seeds: int = typer.Option(1, "--seeds", "-k", help="Seeds per run (init, data order, random streams)."),
    seed: int = typer.Option(0, "--seed", help="First seed."),
    reset: str = typer.Option("none", "--reset", help="Reset policy for runs that name none: none | N | auto."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default per optimizer)."),
    batch_size: int = typer.Option(16, "--batch-size", "-b", help="Sequences per step."),
    eval_every: int = typer.Option(25, "--eval-every", help="Steps between validation evaluations."),
    min_quant_numel: int = typer.Option(0, "--min-quant-numel",
                                        help="Tensors smaller than this keep fp32 states (bitsandbytes: 4096)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda[:N]."),
    backend: str = typer.Option("auto", "--backend", help="Optimizer backend: auto | reference | triton."),
    threads: int = typer.Option(1, "--threads", help="torch CPU threads per run (0: torch's default). One is "
                                "fastest for these small models, and robust on a busy machine."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the results JSON here ('-': to stdout)."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a loss-curve plot (PNG, SVG or PDF) here."),
):
    """Train the same model, init and data with each state configuration; report loss,
    gap to fp32, divergence, speed and state bytes."""
    from ..train import plot as plotting
    from ..train.study import run_study

    if plot and not plot.lower().endswith((".png", ".svg", ".pdf")):
        raise QstateError(f"--plot {plot}: name a .png, .svg or .pdf file")
    settings = TrainSettings(model=model, optimizer=optimizer.lower(), steps=steps, batch_size=batch_size, lr=lr,
                             eval_every=eval_every, seeds=seeds, seed=seed, reset=reset,
                             min_quant_numel=min_quant_numel, device=device, backend=backend,
                             threads=threads or None)
    doc = run_study(settings, config, json_path=None if json_path in (None, "-") else json_path,
                    progress=lambda line: output.stderr.print(line, highlight=False))
    if plot:
        plotting.save_loss_curves(doc, plot)
        output.stderr.print(f"plot written to {plot}", highlight=False)
    if json_path == "-":
        output.print_json(doc)
        return
    title = (f"bench train: {settings.model}, {settings.optimizer}, {settings.steps} steps x {settings.batch_size} "
             f"seqs, {settings.seeds} seed(s), on {doc['meta']['device']}")
    output.stdout.print(output.table(title, doc["summary"], SUMMARY_COLUMNS, FORMATS, HEADERS))
    if json_path:
        output.stderr.print(f"results written to {json_path}", highlight=False)
