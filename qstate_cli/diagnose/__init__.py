"""`qstate diagnose`: replay recorded gradients through quantized optimizer states and
measure drift, variance, stalling, staleness and update fidelity (replay.py, stats.py,
summary.py), with the staleness model's predictions (theory.py) and reset advice
(recommend.py). `run.py` is the library entry point; `suite.py` the YAML-suite hook."""
from .run import DEFAULT_CONFIGS, diagnose, select_configs, theory_document

__all__ = ["DEFAULT_CONFIGS", "diagnose", "select_configs", "theory_document"]
