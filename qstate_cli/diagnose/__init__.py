"""`qstate diagnose`: replay recorded gradients through quantized optimizer states and
measure drift, variance, stalling, staleness and update fidelity (replay.py, stats.py,
summary.py), with the staleness model's predictions (theory.py) and reset advice
(recommend.py). `run.py` is the library entry point (options, execute, diagnose)."""
from .replay import ConfigReplay, Replay
from .run import DEFAULT_CONFIGS, DiagnoseOptions, diagnose, execute, select_configs, theory_document

__all__ = ["ConfigReplay", "DEFAULT_CONFIGS", "DiagnoseOptions", "Replay", "diagnose", "execute", "select_configs",
           "theory_document"]
