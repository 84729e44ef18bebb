"""`qstate doctor CHECKPOINT [--against OTHER]`: the options of doctor/run.py plus
--json/--csv/--html/--markdown; a table of the parameters, one line per finding and
parameter group, a summary; exit 1 when a finding would change training."""
from __future__ import annotations

from collections import defaultdict

import typer

from ..doctor import run as engine
from ..errors import CheckFailed
from . import output
from .commands import options_command
from .output import Destinations
from .tables import visible

HELP = ("Check an optimizer checkpoint: state formats and bytes, v flushed to zero, non-finite values, shapes, "
        "missing states, step counters, low-bit states stored dequantized; --against compares two checkpoints "
        "element-wise.\n\nReads torch.optim, qstate, torchao and bitsandbytes states (torch.save files and "
        "torch.distributed.checkpoint directories) without running code from them. Exit 1 when a finding would "
        "change training, 2 when the input cannot be read.")
MAX_ROWS = 20
HEADERS = {"state_bytes": "bytes", "nonfinite": "non-finite", "v_flushed": "v flushed", "v_subnormal": "v subnorm",
           "errors": "err", "warnings": "warn", "against_differing": "differ", "against_max_abs_diff": "max |diff|"}


def register(app: typer.Typer) -> None:
    @options_command(app, "doctor", engine.DoctorOptions, help=HELP, outputs=("json", "csv", "html", "markdown"),
                     inputs=("checkpoint", "against"),
                     output_help={"json": "Write the result document here ('-': stdout)."})
    def doctor(opts: engine.DoctorOptions, out: Destinations) -> None:
        doc = output.run_engine(engine.execute, opts, out, _print, transient=True)
        errors = (doc or {}).get("meta", {}).get("summary", {}).get("errors", 0)
        if errors:
            raise CheckFailed(f"{errors} finding(s) in {opts.checkpoint} would change training")


def _print(doc: dict) -> None:
    rows = doc["records"]
    meta = doc["meta"]
    shown = sorted(rows, key=lambda r: (-r["errors"], -r["warnings"]))[:MAX_ROWS]
    shown.sort(key=lambda r: rows.index(r))
    title = f"qstate doctor: {meta['checkpoint']}" + (f" against {meta['against']}" if meta.get("against") else "")
    cols = (["optimizer"] if len({r["optimizer"] for r in rows}) > 1 else []) + [
        "param", "shape", "states", "state_bytes", "step", "nonfinite", "v_flushed", "v_subnormal", "errors", "warnings"]
    if meta.get("against"):
        cols += ["against_differing", "against_max_abs_diff"]
    output.stdout.print(output.table(title, shown, cols, formats={"state_bytes": ",", "step": "g", "v_flushed": ",",
                                                                  "v_subnormal": ",", "against_max_abs_diff": ".3g"},
                                     headers=HEADERS))
    if len(rows) > len(shown):
        output.stdout.print(f"({len(rows) - len(shown)} more parameters without more findings: --json or --csv "
                            f"lists all)", highlight=False)
    for line in finding_lines(doc["findings"]):
        output.stdout.print(line, highlight=False, markup=False)
    s = meta["summary"]
    per = f" ({s['bytes_per_param']:.4g} bytes/param)" if s.get("bytes_per_param") else ""
    held = s.get("memory_bytes_per_param")
    if per and held and abs(held - s["bytes_per_param"]) > 1e-9:  # FSDP2's per-element checkpoint layout
        per = f" ({s['bytes_per_param']:.4g} bytes/param as saved; {held:.4g} in memory)"
    output.stdout.print(f"summary: {s['params']} parameters, {s['elements']:,} elements, {s['state_bytes']:,} bytes of "
                        f"state{per}; {_count(s['errors'], 'error')}, {_count(s['warnings'], 'warning')}"
                        + ("" if s["errors"] else " - healthy"), highlight=False, markup=False)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def finding_lines(findings: list[dict]) -> list[str]:
    """One line per (severity, optimizer, group, check, state): how many parameters and
    elements, and the first parameter's own message; its control characters shown as
    escapes (tables.visible: a parameter name is a checkpoint's text, and `\\x1b[2J` in it
    cleared the terminal)."""
    grouped = defaultdict(list)
    for f in findings:
        grouped[(f["severity"], f["optimizer"], f["group"], f["check"], f["state"])].append(f)
    order = {"error": 0, "warn": 1, "info": 2}
    lines = []
    for (sev, opt, group, check, state), fs in sorted(grouped.items(), key=lambda kv: (order[kv[0][0]], kv[0][1:3])):
        first = fs[0]
        elements = sum(f["count"] for f in fs)  # 0 for a finding about no element (a step, a group's setting)
        many = (f" [{len(fs)} parameters" + (f", {elements:,} elements in all]" if elements else "]")) if len(fs) > 1 else ""
        where = f" group {group}" if group >= 0 else ""  # -1: in no group (an orphan, the two files' keys)
        lines.append(visible(f"{sev:5s} {opt}{where} {check}: {first['param']}: {first['message']}{many}"))
    return lines
