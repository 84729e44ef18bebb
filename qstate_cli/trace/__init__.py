"""Gradient traces: formats v1 and v2 (schema.py), safe loading and atomic writes (io.py), the
recorder (recorder.py) and the built-in demo (demo.py)."""
from .io import load_trace, merge_shards, save_trace
from .recorder import Recorder, sample_blocks
from .schema import BLOCK, SCHEMA_VERSION, Trace, TraceTensor

__all__ = ["BLOCK", "Recorder", "SCHEMA_VERSION", "Trace", "TraceTensor", "load_trace", "merge_shards",
           "sample_blocks", "save_trace"]
