"""Diagnostic (not a test): where the CPU kernels' first-use compile time goes (docs/cpu.md,
"Compile time: numba's inlining").

    python scripts/cpu_compile_time.py [--top 25] [--cache DIR] -- diagnose demo -c bnb-8bit --steps-limit 3

Runs a qstate command line (the words after `--`, as typed after `qstate`) in this process,
with an empty numba cache (a fresh temporary NUMBA_CACHE_DIR unless --cache names one), and
prints two tables:

- per numba kernel, the seconds its compilation took: its own (self) and with the kernels it
  compiled in turn (total), from numba's "numba:compile" events (nested: a kernel's typing
  compiles each kernel it calls);
- per helper that numba inlined (`@njit(inline="always")`), how many times and for how many
  seconds, with and without the helpers inlined inside it. numba re-runs a helper's front end
  and copies its IR at every call site, so a large helper inlined at many sites is where a
  kernel's compile time goes; a helper called once per row or chunk can be a function of its
  own instead (LLVM still inlines the small ones), which is what took the first use of
  `qstate diagnose demo -c bnb-8bit` from 175 to 116 s of compiling on the Zen 4, and a row
  helper can be `forceinline` (compiled once, inlined by LLVM; it is then a kernel row here),
  which took the default `qstate diagnose demo` from 138 to 85 s (docs/cpu.md).

The inline table wraps numba's InlineWorker.inline_function (numba internals: a diagnostic
only; without it the kernel table still prints).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import runpy
import sys
import tempfile
import time


class CompileRecorder:
    """Seconds per compiled numba kernel (self, total, count) and per inlined helper (self,
    total, count), recorded inside `with recorder.recording():`."""

    def __init__(self):
        self.kernels = {k: collections.Counter() for k in ("self", "total", "count")}
        self.inlined = {k: collections.Counter() for k in ("self", "total", "count")}
        self._stack: list = []
        self._inline_stack: list = []

    @contextlib.contextmanager
    def recording(self):
        from numba.core import event

        rec = self

        class Listener(event.Listener):
            def on_start(self, ev):
                rec._stack.append([time.perf_counter(), 0.0])

            def on_end(self, ev):
                t0, inner = rec._stack.pop()
                dt = time.perf_counter() - t0
                if rec._stack:
                    rec._stack[-1][1] += dt
                rec._add(rec.kernels, ev.data["dispatcher"].py_func, dt, dt - inner)

        listener = Listener()
        event.register("numba:compile", listener)
        try:
            from numba.core.inline_closurecall import InlineWorker
            original = InlineWorker.inline_function
        except (ImportError, AttributeError):  # another numba layout: the kernel table only
            InlineWorker = original = None

        def inline_function(worker, caller_ir, block, i, function, arg_typs=None):
            rec._inline_stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return original(worker, caller_ir, block, i, function, arg_typs)
            finally:
                dt = time.perf_counter() - t0
                inner = rec._inline_stack.pop()
                if rec._inline_stack:
                    rec._inline_stack[-1] += dt
                rec._add(rec.inlined, function, dt, dt - inner)

        if InlineWorker is not None:
            InlineWorker.inline_function = inline_function
        try:
            yield self
        finally:
            event.unregister("numba:compile", listener)
            if InlineWorker is not None:
                InlineWorker.inline_function = original

    @staticmethod
    def _add(table: dict, function, total: float, own: float) -> None:
        name = f"{function.__module__.rsplit('.', 1)[-1]}.{function.__qualname__}"
        table["total"][name] += total
        table["self"][name] += own
        table["count"][name] += 1

    def report(self, top: int) -> str:
        lines = []
        for title, table, key in (("kernel compiled", self.kernels, "self"), ("helper inlined by numba", self.inlined,
                                                                              "total")):
            total = sum(table["self"].values())
            lines.append(f"{title:60s} {'n':>4s} {'self s':>8s} {'total s':>8s}   (all: {total:.1f} s)")
            for name, _ in table[key].most_common(top):
                lines.append(f"{name:60s} {table['count'][name]:4d} {table['self'][name]:8.1f} "
                             f"{table['total'][name]:8.1f}")
            lines.append("")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=25, help="rows per table")
    ap.add_argument("--cache", default=None, help="numba cache folder (default: a fresh empty one)")
    args = ap.parse_args(own)
    if not command:
        ap.error("give the qstate command after --, e.g. -- diagnose demo -c bnb-8bit --steps-limit 3")
    if args.cache is not None:  # checked before anything runs: a folder, or one that can be made
        why = "it is a file, not a folder" if os.path.isfile(args.cache) else None
        if why is None:
            try:
                os.makedirs(args.cache, exist_ok=True)
            except OSError as exc:
                why = f"it cannot be made ({exc.strerror})"
        if why is not None:
            print(f"error: --cache {args.cache}: {why}", file=sys.stderr)
            return 2
    os.environ["NUMBA_CACHE_DIR"] = args.cache or tempfile.mkdtemp(prefix="qstate-compile-")
    rec = CompileRecorder()
    sys.argv = ["qstate", *command]
    t0 = time.perf_counter()
    rc = 0
    with rec.recording():
        try:
            runpy.run_module("qstate_cli", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    wall = time.perf_counter() - t0
    print(f"\n{' '.join(command)}: exit {rc}, {wall:.1f} s wall, numba cache {os.environ['NUMBA_CACHE_DIR']}\n")
    print(rec.report(args.top))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
