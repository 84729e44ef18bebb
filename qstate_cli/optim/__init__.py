"""Reference update rules (rules.py) and drop-in optimizers with quantized states."""
from .base import QuantizedOptimizer
from .optimizers import OPTIMIZERS, SGD, Adam, AdamW, Lion, Muon
from .reset import ResetPolicy

__all__ = ["Adam", "AdamW", "Lion", "Muon", "OPTIMIZERS", "QuantizedOptimizer", "ResetPolicy", "SGD"]
