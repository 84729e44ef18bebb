"""`qstate formats`: every state format, rounding mode and preset, with bytes."""
from __future__ import annotations

from typing import Optional

import typer

from ..optim.registry import keeps_text
from ..quant.catalog import format_rows, preset_rows, rounding_rows
from ..quant.config import MAX_BLOCK, MIN_BLOCK
from ..errors import QstateError
from . import output


def register(app: typer.Typer) -> None:
    app.command("formats")(formats)


def formats(
    block_size: Optional[int] = typer.Option(None, "--block-size", "-b",
                                             help="Block size for the scale bytes (default: 128 at 4 bits, 256 at 8; floats unscaled)."),
    as_json: bool = typer.Option(False, "--json", help="Print the same tables as JSON."),
):
    """List state formats, rounding modes and presets with bytes per element."""
    if block_size is not None and not (MIN_BLOCK <= block_size <= MAX_BLOCK and block_size % 2 == 0):
        raise QstateError(f"--block-size {block_size}: use an even size from {MIN_BLOCK} to {MAX_BLOCK}")
    fmts, rnds, presets = format_rows(block_size), rounding_rows(), preset_rows()
    if as_json:
        output.print_json({"formats": fmts, "roundings": rnds, "presets": presets})
        return
    cols = ["format", "kind", "bits", "signed", "block_size", "bytes_per_element", "purpose"]
    output.stdout.print(output.table("State formats (bytes per element include block scales)", fmts, cols,
                                     {"bytes_per_element": ".4f", "signed": lambda v: "yes" if v else "no"},
                                     {"bytes_per_element": "bytes/elem", "block_size": "block"}))
    output.stdout.print(output.table("Rounding modes", rnds))
    output.stdout.print(output.table(f"Presets ({keeps_text()})",
                                     presets, formats={"adamw_bytes_per_param": ".4f", "m_only_bytes_per_param": ".4f"},
                                     headers={"adamw_bytes_per_param": "AdamW B/param",
                                              "m_only_bytes_per_param": "m-only B/param"}))
