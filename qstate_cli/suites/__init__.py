"""YAML suites: a schema (pydantic, schema.py only), axes to points, and the runner.

    qstate run SUITE.yaml [--set key=value ...] [--out DIR] [--resume]
    qstate suite validate SUITE.yaml
    qstate suite schema

What each kind runs is the kinds table (qstate_cli/kinds.py); suites never import the CLI.
"""
from ..kinds import KINDS
from .expand import Point, expand_run, point_key
from .kinds import hook_for, register_hook
from .load import LoadedSuite, SuiteError, load_suite

__all__ = ["KINDS", "LoadedSuite", "Point", "SuiteError", "expand_run", "hook_for", "load_suite", "point_key",
           "register_hook"]
