"""Suites: schema errors name file, line and key; axes expand as documented; shipped suites validate."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.suites import SuiteError, expand_run, load_suite
from qstate_cli.suites.expand import point_key, range_values

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def write(tmp_path, text, name="suite.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


# (suite text, line, key, words in the message)
BROKEN = {
    "unknown key": ("""
        kind: kernels
        axes:
          numel: [1024]
        colour: red
        """, 4, "colour", "unknown key"),
    "unknown key in a run": ("""
        runs:
          - kind: memory
            axes: {config: [fp32]}
          - kind: kernels
            axis: {numel: [1]}
        """, 5, "runs[1].axis", "unknown key"),
    "wrong type": ("""
        kind: kernels
        baselines: torch-fused
        """, 2, "baselines", "valid list"),
    "axis that is neither list nor range": ("""
        kind: kernels
        axes:
          config: [bred-4bit]
          dtype: fp32
        """, 4, "axes.dtype", "list of values or a range"),
    "bad axis range (stop below start)": ("""
        kind: kernels
        axes:
          numel:
            start: 4096
            stop: 1024
            factor: 2
        """, 3, "axes.numel", "stop (1024) is below start (4096)"),
    "bad axis range (step and factor)": ("""
        kind: kernels
        axes:
          numel: {start: 1, stop: 8, step: 1, factor: 2}
        """, 3, "axes.numel", "exactly one of step or factor"),
    "bad axis range (factor 1)": ("""
        kind: kernels
        axes:
          numel: {start: 1, stop: 8, factor: 1}
        """, 3, "axes.numel.factor", "greater than 1"),
    "empty axis": ("""
        kind: kernels
        axes:
          numel: []
        """, 3, "axes.numel", "at least 1 item"),
    "missing kind": ("""
        name: nameless
        axes:
          numel: [1024]
        """, 1, "kind", "required key is missing"),
    "missing kind in a run": ("""
        runs:
          - kind: memory
          - name: second
            axes: {config: [fp32]}
        """, 3, "runs[1].kind", "required key is missing"),
    "unknown kind": ("""
        kind: kernel
        """, 1, "kind", "'kernels', 'memory', 'diagnose', 'train' or 'doctor'"),
    "bad device": ("""
        kind: kernels
        defaults:
          bits: 4
          device: gpu
        """, 4, "defaults.device", "auto, cpu or cuda[:N]"),
    "exclude naming no axis": ("""
        kind: kernels
        axes:
          config: [a]
          numel: [1, 2]
        excludes:
          - {numel: 1}
          - {confg: a}
        """, 7, "excludes[1].confg", "not an axis"),
    "duplicate run names": ("""
        runs:
          - kind: kernels
          - kind: kernels
        """, 3, "runs[1].name", "unique name"),
    "run keys beside runs": ("""
        kind: kernels
        runs:
          - kind: memory
        """, 1, "kind", "inside each run"),
    "duplicate key": ("""
        kind: kernels
        axes: {numel: [1]}
        kind: memory
        """, 3, "kind", "duplicate key (first on line 1)"),
}


@pytest.mark.schema
@pytest.mark.parametrize("case", list(BROKEN), ids=list(BROKEN))
def test_broken_suite_names_file_line_and_key(tmp_path, case):
    text, line, key, words = BROKEN[case]
    path = write(tmp_path, text)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    issue = err.value.issues[0]
    assert issue.startswith(f"{path}:{line}: {key}: "), issue
    assert words in issue, issue


def test_invalid_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "kind: kernels\naxes: [\n")
    with pytest.raises(SuiteError, match=rf"^{path}:3: invalid YAML"):
        load_suite(path)


@pytest.mark.schema
def test_every_problem_is_listed_by_validate(tmp_path):
    path = write(tmp_path, """
        runs:
          - kind: kernels
            colour: red
            defaults: {device: tpu}
          - kind: trian
        """)
    r = runner.invoke(app, ["suite", "validate", str(path)])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert lines == [f"{path}:4: runs[0].defaults.device: use auto, cpu or cuda[:N] (got 'tpu')",
                     f"{path}:3: runs[0].colour: unknown key (use axes, baselines, defaults, description, excludes, "
                     "kind, name)",
                     f"{path}:5: runs[1].kind: Input should be 'kernels', 'memory', 'diagnose', 'train' or 'doctor' (got 'trian')"]


@pytest.mark.schema
def test_set_override_errors_name_the_override(tmp_path):
    path = write(tmp_path, "kind: kernels\naxes: {numel: [1024]}\n")
    with pytest.raises(SuiteError, match=r"^--set device=tpu: defaults.device: use auto"):
        load_suite(path, ["device=tpu"])
    with pytest.raises(QstateError, match="use KEY=VALUE"):
        load_suite(path, ["device"])


@pytest.mark.parametrize("path", sorted((ROOT / "suites").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_suites_validate(path):
    suite = load_suite(path)
    assert suite.runs and all(expand_run(run) for run in suite.runs)
    r = runner.invoke(app, ["suite", "validate", str(path)])
    assert r.exit_code == 0 and r.stdout.startswith(f"ok: {path}"), r.output


def test_quick_suite_covers_kernels_memory_and_the_demo_trace():
    suite = load_suite(ROOT / "suites" / "quick.yaml")
    assert [run["kind"] for run in suite.runs] == ["kernels", "memory", "diagnose"]
    assert suite.runs[2]["defaults"]["trace"] == "demo"


@pytest.mark.schema
def test_committed_schema_is_current():
    from qstate_cli.suites.schema import json_schema

    committed = json.loads((ROOT / "suites" / "schema.json").read_text())
    assert committed == json_schema(), "regenerate: python -m qstate_cli suite schema > suites/schema.json"
    r = runner.invoke(app, ["suite", "schema"])
    assert r.exit_code == 0 and json.loads(r.stdout)["title"] == "qstate suite"


# -- axes ------------------------------------------------------------------------------

def test_ranges_are_inclusive_and_keep_ints():
    assert range_values({"start": 1024, "stop": 16384, "factor": 4}) == [1024, 4096, 16384]
    assert range_values({"start": 1024, "stop": 10000, "factor": 4}) == [1024, 4096]
    assert range_values({"start": 0, "stop": 10, "step": 5}) == [0, 5, 10]
    assert range_values({"start": 0.1, "stop": 0.3, "step": 0.1}) == [0.1, 0.2, 0.3]
    assert range_values({"start": 0.9, "stop": 0.999, "step": 0.033}) == [0.9, 0.933, 0.966, 0.999]


def _run(**kw):
    return {"name": "r", "kind": kw.pop("kind", "kernels"), "description": "", "defaults": kw.pop("defaults", {}),
            "axes": kw.pop("axes", {}), "excludes": kw.pop("excludes", []), "baselines": kw.pop("baselines", [])}


def test_cross_product_in_written_order_with_excludes():
    run = _run(defaults={"bits": 4, "device": "cpu"},
               axes={"config": ["a", "b"], "dtype": ["fp32", "bf16"], "numel": {"start": 1, "stop": 4, "factor": 2}},
               excludes=[{"config": "b", "dtype": "bf16"}, {"numel": [2, 4], "dtype": "fp32", "config": "a"}])
    points = expand_run(run)
    got = [(p.assignment["config"], p.assignment["dtype"], p.assignment["numel"]) for p in points]
    assert got == [("a", "fp32", 1), ("a", "bf16", 1), ("a", "bf16", 2), ("a", "bf16", 4),
                   ("b", "fp32", 1), ("b", "fp32", 2), ("b", "fp32", 4)]
    first = points[0].params
    assert first == {"bits": 4, "device": "cpu", "config": ["a"], "dtype": "fp32", "numel": 1, "baseline": []}


def test_baseline_points_drop_config_axes_and_can_be_excluded():
    run = _run(axes={"config": ["a", "b"], "rounding": ["nearest"], "numel": [1, 2]}, defaults={"config": "x"},
               baselines=["torch-fused", "bnb-8bit"], excludes=[{"baseline": "bnb-8bit", "numel": 2}])
    base = [p for p in expand_run(run) if p.assignment.get("baseline")]
    assert [(p.assignment["baseline"], p.assignment["numel"]) for p in base] == [
        ("torch-fused", 1), ("torch-fused", 2), ("bnb-8bit", 1)]
    assert base[0].params == {"baseline": ["torch-fused"], "numel": 1, "config": []}


def test_diagnose_baseline_is_a_configuration():
    run = _run(kind="diagnose", defaults={"trace": "demo"}, axes={"config": ["bred-4bit"], "reset": ["none", "auto"]},
               baselines=["torchao-4bit"])
    params = [p.params for p in expand_run(run)]
    assert params[-2:] == [{"trace": "demo", "config": "torchao-4bit", "reset": "none"},
                           {"trace": "demo", "config": "torchao-4bit", "reset": "auto"}]


def test_point_keys_are_stable_and_distinct():
    assert point_key({"b": 1, "a": [1, 2]}) == point_key({"a": [1, 2], "b": 1})
    assert point_key({"a": 1}) != point_key({"a": 2})
    points = expand_run(_run(axes={"numel": [1, 2, 2]}))
    assert len(points) == 2  # the same parameters twice run once


def test_set_overrides_axes_defaults_and_paths(tmp_path):
    path = write(tmp_path, """
        runs:
          - name: sweep
            kind: kernels
            defaults: {bits: 4}
            axes:
              config: [fp32, bf16]  # real names: validation builds every point
              numel: {start: 1024, stop: 4096, factor: 2}
          - kind: memory
            axes: {config: [fp32]}
        """)
    suite = load_suite(path, ["numel=64", "device=cpu", "runs.sweep.defaults.bits=8", "runs.1.axes.config=[bf16]"])
    sweep, memory = suite.runs
    assert sweep["axes"]["numel"] == [64] and sweep["defaults"] == {"bits": 8, "device": "cpu"}
    assert memory["defaults"] == {"device": "cpu"} and memory["axes"]["config"] == ["bf16"]
    assert len(expand_run(sweep)) == 2


def test_validate_is_a_real_subprocess_command(tmp_path):
    bad = write(tmp_path, "kind: kernels\naxes:\n  numel: {start: 8, stop: 1, step: 1}\n")
    out = subprocess.run([sys.executable, "-m", "qstate_cli", "suite", "validate", str(bad)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"{bad}:3: axes.numel: stop (1) is below start (8)"
