#!/usr/bin/env python
"""Static instruction budget of the fused kernels on an H200 (sm_90), no GPU needed.

Compiles every fused variant (qstate_cli.bench.budget.VARIANTS) for sm_90 through
Triton, disassembles it with Triton's nvdisasm and counts the SASS a warp issues per
element on the full-tile fast path (qstate_cli.kernels.sass), by class, beside the bytes
the kernel moves and the issue-model budget. Every number is a PREDICTION: nothing here
ran on a GPU; `qstate bench headline` / `bench kernels` measure.

    python scripts/sass_budget.py                   # table
    python scripts/sass_budget.py --json            # one JSON record per variant (per line)
    python scripts/sass_budget.py --only adamw:bred-4bit:bf16 --only lion
    python scripts/sass_budget.py --report reports/sass-budget   # writes .json and .md
    python scripts/sass_budget.py --opcodes --only adamw:sr-4bit:bf16   # the tile loop by opcode
    python scripts/sass_budget.py --beside OUT/headline.json OUT/bench-kernels-4bit.json
        # the measured rows of those result files, each beside the prediction (GPU check)

Counts are cached per variant under $QSTATE_CACHE (default ~/.cache/qstate)/sass, keyed
by the kernel sources and the Triton version; Triton caches its compiles too.
Exit 2 on bad input (unknown variant filter, unwritable report path).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qstate_cli.bench import budget  # noqa: E402
from qstate_cli.kernels import sass  # noqa: E402
from qstate_cli.results import document, load, write_json_atomic, write_text_atomic  # noqa: E402

CLASSES = list(sass.CLASSES)
ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "reports" / "sass-budget.json"


def select(filters: list[str]) -> list[tuple]:
    """Variants matching any KERNEL[:STATES[:DTYPE]] filter (all of them without filters)."""
    if not filters:
        return list(budget.VARIANTS)
    out = []
    for f in filters:
        parts = f.split(":", 1)
        kernel, rest = parts[0], parts[1] if len(parts) > 1 else ""
        states, _, dtype = rest.rpartition(":") if rest.endswith((":bf16", ":fp32")) else (rest, "", "")
        hits = [v for v in budget.VARIANTS if v[0] == kernel and (not states or v[1] == states)
                and (not dtype or v[2] == dtype)]
        if not hits:
            names = ", ".join(":".join(v) for v in budget.VARIANTS)
            raise SystemExit(f"error: no variant matches {f!r}; variants: {names}")
        out += [h for h in hits if h not in out]
    return out


def counts(variant: tuple, cache: Path | None) -> tuple[dict, bool]:
    """The variant's counts and whether they were compiled now (else read from the cache)."""
    key = f"{sass.source_fingerprint()}-{'-'.join(variant).replace('=', '').replace(':', '_').replace(',', '_')}"
    path = cache / f"{key}.json" if cache else None
    if path and path.exists():
        return json.loads(path.read_text()), False
    out = sass.count_variant(*variant)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, out)
    return out, True


def markdown(records: list[dict], seconds: float, compiled: int) -> str:
    head = ["kernel", "states", "param", "SASS/elem"] + CLASSES + ["B/elem", "budget", "predicted copy fraction"]
    lines = ["# Static SASS budget of the fused kernels (sm_90, H200 issue model): a PREDICTION", "",
             "Made by `python scripts/sass_budget.py --report reports/sass-budget` without a GPU "
             f"({seconds:.0f} s here, {compiled} of {len(records)} variants compiled, the rest from the cache). Counts: the full-tile fast path at 8 tiles per program "
             "(qstate_cli/kernels/sass.py); model: qstate_cli/bench/budget.py. Nothing here was measured on a GPU. "
             "Each change made to lower these counts, with the counts before and after it: docs/kernels.md, "
             "\"Changes made for the budget\".", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        row = [r["kernel"], f"`{r['states']}`", r["param_dtype"], f"{r['sass_per_elem']:.1f}"]
        row += [f"{r[c + '_per_elem']:.1f}" for c in CLASSES]
        row += [f"{r['bytes_per_elem']:.3f}", f"{r['budget_per_elem']:.1f}", f"{r['predicted_copy_fraction']:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def opcode_lines(c: dict, per_line: int = 4) -> str:
    """The tile loop's opcodes, most first: count per tile and thread, and per element."""
    n = c["geometry"]["elems_per_thread"]
    cells = [f"{op:<10}{k:5d} {k / n:6.2f}" for op, k in c["tile_opcodes"].items()]
    head = (f"  tile loop: {c['per_tile']} instructions a thread for {n:g} elements "
            "(opcode, per tile, per element)")
    return "\n".join([head] + ["    " + "   ".join(cells[i:i + per_line]) for i in range(0, len(cells), per_line)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON record per variant per line")
    ap.add_argument("--only", action="append", default=[], metavar="KERNEL[:STATES[:DTYPE]]")
    ap.add_argument("--report", metavar="PATH", help="write PATH.json (records + env) and PATH.md")
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--opcodes", action="store_true",
                    help="also the tile loop's instructions by opcode (per tile and thread, and per element)")
    ap.add_argument("--beside", nargs="+", metavar="RESULT.json",
                    help="print the measured rows of these `kernels` result files beside the prediction")
    args = ap.parse_args(argv)
    try:
        variants = select(args.only)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    measured = []
    for path in args.beside or []:
        try:
            measured += load(path)["records"]
        except Exception as exc:  # noqa: BLE001 - missing or unreadable: one line, exit 2
            print(f"error: {exc}".splitlines()[0], file=sys.stderr)
            return 2
    keys = set()
    if args.beside and not args.only:  # only the variants the measured rows need
        keys = {budget.prediction_key(r["optimizer"], r["config"], r.get("param_dtype")) for r in measured
                if r.get("optimizer") in ("adamw", "lion", "sgd", "muon") and r.get("config")}
        variants = [v for v in variants if budget.prediction_key(*v) in keys]
    if args.report:
        parent = Path(args.report).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            print(f"error: cannot write the report under {parent}", file=sys.stderr)
            return 2
    cache = None if args.no_cache else Path(os.environ.get("QSTATE_CACHE", Path.home() / ".cache" / "qstate")) / "sass"
    t0 = time.perf_counter()
    records, compiled = [], 0
    for v in variants:
        try:
            c, fresh = counts(v, cache)
            compiled += fresh
        except Exception as exc:  # noqa: BLE001 - no CUDA backend or toolchain: say so, per variant
            from triton.compiler.errors import CompilationError

            if isinstance(exc, CompilationError):
                raise
            why = f"{':'.join(v)}: cannot compile for sm_90 here: {type(exc).__name__}: {exc}".splitlines()[0]
            if args.beside and COMMITTED.exists():  # still put the committed prediction beside the rows
                print(f"note: {why}; using the committed {COMMITTED.relative_to(ROOT)}", file=sys.stderr)
                records = [r for r in load(COMMITTED)["records"]
                           if not keys or budget.prediction_key(r["kernel"], r["states"], r["param_dtype"]) in keys]
                break
            print(f"error: {why}", file=sys.stderr)
            return 1
        r = budget.record(*v, c["per_elem"], c["geometry"])
        records.append(r)
        if args.beside:
            continue
        if args.json:
            extra = {"tile_instructions": c["per_tile"], "tile_opcodes": c["tile_opcodes"]} if args.opcodes else {}
            print(json.dumps({**r, **extra}), flush=True)
        else:
            print(f"{r['kernel']:6} {r['states']:18} {r['param_dtype']:5} {r['sass_per_elem']:6.1f} SASS/elem  "
                  + " ".join(f"{k[:4]} {r[k + '_per_elem']:5.1f}" for k in CLASSES)
                  + f"  {r['bytes_per_elem']:6.3f} B/elem  budget {r['budget_per_elem']:5.1f}"
                  f"  predicted {r['predicted_copy_fraction']:.2f} of copy", flush=True)
            if args.opcodes:
                print(opcode_lines(c), flush=True)
    seconds = time.perf_counter() - t0
    if args.beside:
        rows = budget.beside(measured, records)
        for row in rows:
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                meas = row["measured_pct_of_copy"]  # None: cache-resident (no share of copy)
                shown = "     -" if meas is None else f"{meas:6.1f}"
                print(f"{row['name']:24} {row['param_dtype']:5} measured {shown}% of copy   "
                      f"PREDICTED {row['predicted_pct_of_copy']:6.1f}% ({row['predicted_sass_per_elem']:.1f} SASS/elem, "
                      f"budget {row['predicted_budget_per_elem']:.1f})  [{row['path']}, {row['timing']}]", flush=True)
        if not rows:
            print("no measured row matches a predicted variant", file=sys.stderr)
    if not args.json and not args.beside:
        print(f"(PREDICTION from sm_90 SASS, issue model of {budget.H200.name}: "
              f"{budget.H200.thread_instructions_per_s:.3g} thread instr/s, copy {budget.H200.copy_bytes_per_s:.3g} B/s; "
              f"{seconds:.1f} s)", file=sys.stderr)
    if args.report:
        meta = {"what": "prediction: static SASS counts, issue model", "seconds": round(seconds, 1), "compiled": compiled,
                "fingerprint": sass.source_fingerprint()}
        write_json_atomic(args.report + ".json", document("sass-budget", records, meta))
        write_text_atomic(args.report + ".md", markdown(records, seconds, compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
