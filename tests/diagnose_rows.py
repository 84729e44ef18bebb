"""Comparing two diagnose results: counts and strings exactly, floats to a relative tolerance."""
from __future__ import annotations

import math

ROWS = ("records", "series", "histograms", "per_code", "per_tensor", "dim_scaling")


def assert_rows_close(a, b, path="", rel=1e-9):
    """Equal structure, counts and strings; floats to `rel` relative (None only with None)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_rows_close(a[k], b[k], f"{path}.{k}", rel)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_rows_close(x, y, f"{path}[{i}]", rel)
    elif isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-300), (path, a, b)
    else:
        assert a == b, (path, a, b)
