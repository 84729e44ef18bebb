"""Training study engine (`qstate bench train`): study.py runs it, runspec.py names runs, plot.py draws loss curves, suite.py is the suite hook."""
