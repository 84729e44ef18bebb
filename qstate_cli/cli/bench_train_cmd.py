"""`qstate bench train`: train the same small LM with each state configuration."""
from __future__ import annotations

import typer

from ..train import study
from . import output
from .commands import options_command
from .output import Destinations

SUMMARY_COLUMNS = ["config", "reset_period", "final_val_loss_mean", "best_val_loss_mean", "gap_to_fp32_mean",
                   "gap_to_fp32_std", "diverged", "diverged_at_step_min", "steps_per_s_mean", "bytes_per_param"]
HEADERS = {"reset_period": "reset every", "final_val_loss_mean": "final val", "best_val_loss_mean": "best val",
           "gap_to_fp32_mean": "gap to fp32", "gap_to_fp32_std": "gap std", "diverged_at_step_min": "at step",
           "steps_per_s_mean": "steps/s", "bytes_per_param": "state B/param"}
FORMATS = {"final_val_loss_mean": ".4f", "best_val_loss_mean": ".4f", "gap_to_fp32_mean": "+.4f",
           "gap_to_fp32_std": ".4f", "steps_per_s_mean": ".1f", "bytes_per_param": ".3f"}
HELP = ("Train the same model, init and data with each state configuration; report loss, gap to fp32, divergence, "
        "speed and state bytes; exit 1 if a run failed.")


def register_train(bench_app: typer.Typer) -> None:
    @options_command(bench_app, "train", study.TrainSettings, help=HELP, outputs=("json", "plot"),
                     output_help={"plot": "Write a loss-curve plot (PNG, SVG or PDF) here."})
    def train(settings: study.TrainSettings, out: Destinations) -> None:
        def show(doc: dict) -> None:
            title = (f"bench train: {settings.model}, {settings.optimizer}, {settings.steps} steps x "
                     f"{settings.batch_size} seqs, {settings.seeds} seed(s), on {doc['meta']['device']}")
            output.stdout.print(output.table(title, doc["summary"], SUMMARY_COLUMNS, FORMATS, HEADERS))

        doc = output.run_engine(study.execute, settings, out, show, transient=True)
        if out.plot is not None:
            from ..train import plot as plotting

            plotting.save_loss_curves(doc, out.plot)
            output.say(f"plot written to {out.plot}")
        output.exit_on_failed_rows(doc, "bench train")
