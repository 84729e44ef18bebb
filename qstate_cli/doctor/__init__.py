"""`qstate doctor`: optimizer-state checkpoints read without running code (safeload.py),
their states decoded whatever stored them (states.py), checked (checks.py), as a Result
(run.py)."""
