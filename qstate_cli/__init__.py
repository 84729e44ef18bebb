"""qstate: benchmarking and diagnostics for low-bit optimizer states."""
__version__ = "0.1.0"
