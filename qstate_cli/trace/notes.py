"""Notes on stderr where a recording is not what its options suggest (trace/recorder.py):

- `window_note`: the requested `start` lies before the first step this run takes (a run
  resumed from a checkpoint: its optimizer had taken steps already, and the step counter
  goes on from there), so the window begins at that first step instead:
  `start=5 is before this run's first step 11 (a resumed run): recording from 11`.
- `save_replacing`: writing a trace over a file that is there already keeps the overwrite
  (a rerun replacing its output is what users expect), but says so, with the steps the
  replaced file held where this process wrote it (`replacing t.pt (steps 1..6)`): one
  callback reused for a second `train()` writes its second run over its first.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .io import save_trace

# what this process wrote: resolved path -> "steps a..b"
_WRITTEN: dict[str, str] = {}


def window_note(rec) -> None:
    """At the first recorded step (rec.step): say where it is after the requested start."""
    if rec.start is None or rec.step <= rec.start or rec.rank != 0:
        return
    resumed = " (a resumed run)" if rec.step > 1 else ""
    print(f"qstate: start={rec.start} is before this run's first step {rec.step}{resumed}: recording from "
          f"{rec.step}", file=sys.stderr)


def save_replacing(trace, target, picked_in=None) -> Path:
    """save_trace(trace, target, picked_in), saying first when it replaces a file (module docstring)."""
    target = Path(target)
    key = str(target.resolve())
    if target.is_file():
        earlier = _WRITTEN.get(key)
        held = earlier or "a file that was there before this recording"
        print(f"qstate: replacing {target} ({held})", file=sys.stderr)
    written = save_trace(trace, target, picked_in)
    last = trace.step_start + trace.n_steps - 1
    _WRITTEN[key] = f"step {last}" if trace.n_steps == 1 else f"steps {trace.step_start}..{last}"
    return written
