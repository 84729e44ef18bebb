"""`qstate audit`: what every parameter's optimizer states become when sharded (FSDP2).

For a model's shapes sharded on dim 0 at --world-size: per parameter and state, the
whole and local shape, format (chosen from the whole tensor), bytes on the rank, whether
its blocks are the whole tensor's (codes equal single-process) or local to the shard, and
why (optim/audit.py). A live optimizer answers the same with `optimizer.audit()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import typer

from ..bench.shapes import model_named_shapes
from ..errors import QstateError
from ..options import Options, lower, option
from ..quant.config import StateConfig, parse_config
from ..optim.audit import plan_shapes, summary_line
from ..optim import rule_traits
from ..optim.registry import names_text, optimizer_info
from ..results import document, environment, write_json_atomic, write_text_atomic
from . import output
from .commands import options_command
from .output import Destinations

HELP = ("Audit optimizer states under FSDP2 sharding: per parameter and state, global and local shape, format, "
        "bytes, whether its blocks are the whole tensor's (bit-equal to single-process) or the shard's, and why.")
COLUMNS = ["rank", "name", "state", "global_shape", "local_shape", "path", "format", "local_bytes", "blocks",
           "world_independent", "reason"]
MAX_ROWS = 250_000  # every rank's rows (no --rank): ~20 s on one CPU core; more is unreadable and slow
HEADERS = {"global_shape": "global", "local_shape": "local", "local_bytes": "bytes",
           "world_independent": "any world"}


MAX_WORLD_SIZE = 65_536  # the largest training jobs shard over tens of thousands of ranks; more is a typo


@dataclass
class AuditOptions(Options):
    """`qstate audit`: a model's parameters sharded on dim 0 (FSDP2) at a world size."""

    COMMAND = "audit"

    model: str = option("small-lm", "Built-in model (gpt2-small, llama-1b, small-lm, ...) or shapes such as "
                                    "4096x4096*2,4096.", "--model", "-m")
    states: StateConfig = option("bred-4bit", "State configuration (preset or m=...,v=...).", "--states", "-c",
                                 parse=parse_config, type=str)
    optimizer: str = option("adamw", f"{names_text()} (which states it keeps).", parse=lower)
    world_size: int = option(2, "Ranks the parameters are sharded over (dim 0, as fully_shard does).",
                             "--world-size", "-w")
    rank: int = option(None, "Show this rank only (default: every rank).", type=int)
    min_quant_numel: int = option(4096, "Tensors with fewer elements keep fp32 states (0: quantize all).")

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise QstateError(f"audit: --world-size {self.world_size}: use 1 to {MAX_WORLD_SIZE:,} ranks")
        if self.rank is not None and not 0 <= self.rank < self.world_size:
            raise QstateError(f"audit: --rank {self.rank} is not a rank of world size {self.world_size}")
        if self.min_quant_numel < 0:
            raise QstateError(f"audit: --min-quant-numel must be >= 0, got {self.min_quant_numel}")


def register(app: typer.Typer) -> None:
    @options_command(app, "audit", AuditOptions, help=HELP, outputs=("json", "csv"),
                     output_help={"json": "Write the audit JSON here ('-': stdout)."})
    def audit(opts: AuditOptions, out: Destinations) -> None:
        out.check()
        names, shapes = zip(*model_named_shapes(opts.model))
        info = optimizer_info(opts.optimizer)
        states = info.states
        ranks = [opts.rank] if opts.rank is not None else range(opts.world_size)
        n_rows = len(ranks) * len(shapes) * len(states)
        if n_rows > MAX_ROWS:  # counted before any row is built
            raise QstateError(f"audit: {len(ranks):,} ranks x {len(shapes):,} tensors x {len(states)} states is "
                              f"{n_rows:,} rows; the limit is {MAX_ROWS:,}: show one rank with --rank")
        rows = [r for rank in ranks for r in plan_shapes(shapes, opts.states, states, opts.world_size, rank,
                                                         opts.min_quant_numel, names, optimizer=info.cls.__name__,
                                                         elementwise=rule_traits.elementwise(info.cls))]
        records = [r.record() for r in rows]
        doc = document("audit", records, {"options": opts.to_params(), "summary": summary_line(rows)},
                       environment("cpu"))
        if out.json_file is not None:
            write_json_atomic(out.json_file, doc)
        if out.csv is not None:
            write_text_atomic(out.csv, output.to_csv(records))
        if out.json_to_stdout:
            output.print_json(doc)
            return
        title = f"Sharding audit: {opts.model}, {opts.states}, world size {opts.world_size} (dim 0, FSDP2)"
        fmt = {"world_independent": lambda v: "yes" if v else "no", "local_bytes": ","}
        output.stdout.print(output.table(title, records, COLUMNS, fmt, HEADERS))
        output.stdout.print(summary_line(rows), highlight=False, markup=False)
