"""Benchmarks: `kernels` (optimizer-step time against the copy roofline) and `memory`
(optimizer-state bytes). Engines return flat records (docs/results.md); the CLI and the
suite runner (suite.py) only call them."""
