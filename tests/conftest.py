"""Shared test settings: deterministic threads, hypothesis profile, CUDA marker."""
import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

try:
    from hypothesis import settings

    # CI: fixed examples (deterministic). QSTATE_HYPOTHESIS=wide explores afresh, longer.
    settings.register_profile("qstate", max_examples=60, deadline=None, derandomize=True, database=None)
    settings.register_profile("wide", max_examples=600, deadline=None, database=None)
    settings.load_profile(os.environ.get("QSTATE_HYPOTHESIS", "qstate"))
except ImportError:  # pragma: no cover
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
