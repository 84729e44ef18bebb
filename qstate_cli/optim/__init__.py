"""Reference update rules (rules.py), drop-in optimizers with quantized states
(optimizers.py), and the registry of them all (registry.py)."""
from .base import QuantizedOptimizer
from .optimizers import SGD, Adam, AdamW, Lion, Muon
from .registry import OPTIMIZERS, OptimizerInfo, optimizer_info
from .reset import ResetPolicy

__all__ = ["Adam", "AdamW", "Lion", "Muon", "OPTIMIZERS", "OptimizerInfo", "QuantizedOptimizer", "ResetPolicy",
           "SGD", "optimizer_info"]
