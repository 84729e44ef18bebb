"""TEMPORARY minimal `bench` group for the `train` branch (the real bench_cmd.py, with
`bench kernels` and `bench memory`, comes from the bench branch; keep only the
`bench_train_cmd` import and the `bench_app.command("train")` line when merging)."""
from __future__ import annotations

import typer

from . import bench_train_cmd, new_group

bench_app = new_group("bench", "Benchmark optimizer states: training runs.")
bench_app.command("train")(bench_train_cmd.train)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
