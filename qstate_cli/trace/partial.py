"""What a recording stopped by Ctrl-C or an error keeps (Recorder.__exit__ calls
`write_partial`), and the check that a cached trace is whole (`cache_problem`).

`Recorder(partial=True)` (the default, for users' own training loops; docs/trainers.md):
the steps recorded so far are written and one line on stderr says how many and where.
Where `path` already holds a file (an earlier recording, maybe a complete one), that file
is kept and the partial trace goes beside it: `NAME.partial.pt` (a sharded recording's
directory of rank files: `DIR.partial/`). A stream (`flush_steps`) writes the steps it
holds as one more file, as a flush would: its earlier files stay.

`Recorder(partial=False)` (`qstate trace demo` and the demo and corpus cache): nothing is
written and one line says so, naming the earlier file that is kept. A trace in the cache
is found by its name, which holds the number of steps: a partial one there would be
replayed as the whole recording by every later `diagnose demo`.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..errors import QstateError


def write_partial(rec, exc_type: type) -> None:
    """Recorder.__exit__ on an exception: write what `rec.partial` says (module docstring)."""
    why = "interrupted (Ctrl-C)" if issubclass(exc_type, KeyboardInterrupt) else f"stopped by {exc_type.__name__}"
    n = rec.n_steps
    held = f"{n} step{'' if n == 1 else 's'}" + (f" of the {rec.steps} planned"
                                                 if rec.steps is not None and n < rec.steps else "")
    if not rec.partial:
        earlier = rec.file_for(rec.path)
        kept = f"; {earlier} is kept as it was" if earlier.exists() else ""
        _say(f"recording {why} after {held}: no trace written (a partial one is not kept){kept}")
        return
    if rec.flush_steps:
        rec.flush()
        _say(f"recording {why} after {held}: the steps recorded are in {rec.path} (a stream keeps each file written)")
        return
    target, path = rec.file_for(rec.path), Path(rec.path)
    if target.is_file():  # an earlier recording: never replaced by a partial one
        path = path.with_name(path.name + ".partial") if rec.sharded else path.with_name(
            f"{path.stem}.partial{path.suffix}")
    rec.save(path)
    if rec.writes:
        beside = f" (beside the earlier {target}, which is kept)" if path != Path(rec.path) else ""
        _say(f"recording {why} after {held}: wrote them to {rec.file_for(path)}{beside}")


def _say(line: str) -> None:
    print(f"qstate: {line}", file=sys.stderr)


def cache_problem(path: Path, steps: int) -> str | None:
    """None where `path` holds a trace of steps 1..`steps` (a usable cache entry), or one
    that cannot be read (the load that follows refuses it in one line naming the file; a
    write here is atomic, so no interrupted recording leaves one); otherwise what is
    wrong with it ('' where there is no file)."""
    if not path.exists():
        return ""
    from .io import load_trace

    try:
        trace = load_trace(path)
    except QstateError:
        return None
    if (trace.step_start, trace.n_steps) != (1, steps):
        return (f"holds steps {trace.step_start}..{trace.step_start + trace.n_steps - 1} ({trace.n_steps}), not "
                f"the {steps} its name says (an interrupted recording?)")
    return None
