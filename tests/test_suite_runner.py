"""The suite runner: hooks by kind, merged documents, failed points, Ctrl-C and --resume."""
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.results import load
from qstate_cli.suites import KINDS, hook_for, load_suite, register_hook
from qstate_cli.suites.runner import run_suite

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

SUITE = """
name: fake
runs:
  - name: sweep
    kind: kernels
    defaults: {bits: 4}
    axes:
      config: [a, b]
      numel: {start: 1024, stop: 8192, factor: 2}
    baselines: [torch-fused]
  - name: diag
    kind: diagnose
    defaults: {trace: demo}
    axes:
      config: [x, y]
"""
N_POINTS = 2 * 4 + 4 + 2


def fake_kernels(params):
    """Deterministic rows from the parameters, like an engine would return."""
    name = (params["config"] or params["baseline"])[0]
    if params.get("crash") == params["numel"]:
        raise RuntimeError("CUDA out of memory")
    return {"records": [{"name": name, "numel": params["numel"], "time_ms": params["numel"] / 1e5, "status": "ok"}]}


def fake_diagnose(params):
    rows = [{"config": params["config"], "state": s, "drift_max_abs": 0.1, "update_cosine": 0.99} for s in "mv"]
    series = [{"config": params["config"], "state": "m", "step": t, "drift": 0.01 * t} for t in (1, 2)]
    return {"records": rows, "series": series}


class Counting:
    def __init__(self, fn, interrupt_after=None):
        self.fn, self.calls, self.interrupt_after = fn, [], interrupt_after

    def __call__(self, params):
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls.append(params)
        return self.fn(params)


@pytest.fixture
def hooks():
    kernels, diagnose = Counting(fake_kernels), Counting(fake_diagnose)
    register_hook("kernels", kernels)
    register_hook("diagnose", diagnose)
    yield kernels, diagnose
    register_hook("kernels", None)
    register_hook("diagnose", None)


@pytest.fixture
def suite_file(tmp_path):
    path = tmp_path / "fake.yaml"
    path.write_text(textwrap.dedent(SUITE))
    return path


def results(out):
    docs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))}
    return {k: {key: v for key, v in d.items() if key not in ("env", "meta")} for k, d in docs.items()}


def test_run_merges_documents_per_run(hooks, suite_file, tmp_path):
    files = [r.path for r in run_suite(load_suite(suite_file), tmp_path / "out")]
    assert [f.name for f in files] == ["sweep.json", "diag.json"]
    sweep, diag = (load(f) for f in files)
    assert sweep["kind"] == "kernels" and diag["kind"] == "diagnose"
    assert len(sweep["records"]) == 12 and len(diag["records"]) == 4 and len(diag["series"]) == 4
    assert {r["name"] for r in sweep["records"]} == {"a", "b", "torch-fused"}
    state = sweep["meta"]["suite"]
    assert len(state["points"]) == len(state["done"]) == 12 and state["failed"] == []
    assert all(r["point"] in state["points"] for r in sweep["records"])
    assert hooks[1].calls[0] == {"trace": "demo", "config": "x"}


def test_a_crashing_point_is_recorded_and_the_suite_goes_on(hooks, suite_file, tmp_path):
    suite = load_suite(suite_file, ["runs.sweep.defaults.crash=4096"])
    (sweep, _) = [r.path for r in run_suite(suite, tmp_path / "out")]
    doc = load(sweep)
    failed = [r for r in doc["records"] if r["status"] == "failed"]
    assert len(failed) == 3 and all("CUDA out of memory" in r["reason"] for r in failed)
    assert len(doc["meta"]["suite"]["failed"]) == 3 and len(doc["meta"]["suite"]["done"]) == 9


def test_an_unknown_parameter_stops_the_run_with_the_point(hooks, suite_file, tmp_path):
    def strict(params):
        raise QstateError("unknown parameter 'bits'")

    register_hook("kernels", strict)
    with pytest.raises(QstateError, match=r"run 'sweep', point config=a numel=1024: unknown parameter 'bits'"):
        run_suite(load_suite(suite_file), tmp_path / "out")


def test_a_missing_engine_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(KINDS, "train", dataclasses.replace(KINDS["train"], engine="qstate_cli.no_such_engine:train_point"))
    with pytest.raises(QstateError, match=r"suite kind 'train' needs qstate_cli.no_such_engine.train_point, which "
                                          r"this build does not have"):
        hook_for("train")


def test_interrupt_then_resume_equals_an_uninterrupted_run(hooks, suite_file, tmp_path):
    run_suite(load_suite(suite_file), tmp_path / "full")
    kernels, diagnose = hooks
    register_hook("kernels", Counting(fake_kernels, interrupt_after=5))
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(tmp_path / "cut"), "--no-report"])
    assert r.exit_code == 130 and "--resume" in r.stderr
    kept = load(tmp_path / "cut" / "sweep.json")
    assert len(kept["meta"]["suite"]["done"]) == 5 and len(kept["records"]) == 5
    rest = Counting(fake_kernels)
    register_hook("kernels", rest)
    diagnose.calls.clear()
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(tmp_path / "cut"), "--resume", "--no-report"])
    assert r.exit_code == 0, r.output
    assert len(rest.calls) == 12 - 5 and len(diagnose.calls) == 2
    assert results(tmp_path / "cut") == results(tmp_path / "full")


def test_resume_retries_failed_points(hooks, suite_file, tmp_path):
    run_suite(load_suite(suite_file), tmp_path / "full")
    flaky = {"n": 0}

    def once_broken(params):
        flaky["n"] += 1
        if flaky["n"] == 2:
            raise RuntimeError("transient")
        return fake_kernels(params)

    register_hook("kernels", once_broken)
    run_suite(load_suite(suite_file), tmp_path / "out")
    assert len(load(tmp_path / "out" / "sweep.json")["meta"]["suite"]["failed"]) == 1
    run_suite(load_suite(suite_file), tmp_path / "out", resume=True)
    assert flaky["n"] == 13
    assert results(tmp_path / "out") == results(tmp_path / "full")


def test_resume_refuses_results_of_another_suite(hooks, suite_file, tmp_path):
    run_suite(load_suite(suite_file), tmp_path / "out")
    with pytest.raises(QstateError, match="finished points are not in this suite"):
        run_suite(load_suite(suite_file, ["bits=8"]), tmp_path / "out", resume=True)


def test_run_command_prints_a_summary_and_writes_a_report(hooks, suite_file, tmp_path):
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(tmp_path / "out")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "sweep" in r.stdout and "diag" in r.stdout
    html = (tmp_path / "out" / "report.html").read_text()
    assert "qstate suite fake" in html and "<img" in html
    assert (tmp_path / "out" / "report.md").read_text().startswith("## qstate suite fake")


CHILD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a test run in the background inherits SIGINT ignored
from qstate_cli.suites import register_hook
def slow(params):
    time.sleep(0.15)
    return {"records": [{"name": (params["config"] or params["baseline"])[0], "numel": params["numel"]}]}
register_hook("kernels", slow)
register_hook("diagnose", lambda p: {"records": [{"config": p["config"], "state": "m"}]})
from qstate_cli.cli import main
sys.argv = ["qstate"] + sys.argv[1:]
main()
"""


def test_ctrl_c_in_a_real_process_keeps_finished_points(suite_file, tmp_path):
    out = tmp_path / "out"
    args = [sys.executable, "-c", CHILD, "run", str(suite_file), "--out", str(out), "--no-report"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if len(json.loads((out / "sweep.json").read_text())["meta"]["suite"]["done"]) >= 3:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err
    done = load(out / "sweep.json")["meta"]["suite"]["done"]
    assert 3 <= len(done) < 12
    register_hook("kernels", fake_kernels)
    register_hook("diagnose", fake_diagnose)
    try:
        run_suite(load_suite(suite_file), out, resume=True)
    finally:
        register_hook("kernels", None)
        register_hook("diagnose", None)
    doc = load(out / "sweep.json")
    assert len(doc["records"]) == 12 and doc["meta"]["suite"]["done"][:len(done)] == done


NO_PYDANTIC = """
import sys
sys.modules["pydantic"] = None  # as on the GPU machine: importing pydantic fails
from qstate_cli.cli import app
from qstate_cli.compare import compare_paths
from qstate_cli.report import render_html
from qstate_cli.suites import SuiteError, load_suite
data = "tests/data/results/compare/"
verdict = compare_paths(data + "baseline", data + "new")
html = render_html([verdict.document()])
suite = load_suite("suites/quick.yaml")
print(suite.notes[0])
try:
    load_suite(sys.argv[1])
except SuiteError as exc:
    print(exc.issues[0])
"""


def test_runs_reports_and_compares_without_pydantic(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: kernels\ncolour: red\n")
    out = subprocess.run([sys.executable, "-c", NO_PYDANTIC, str(bad)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["pydantic is not installed: the suite had a basic check only",
                                       f"{bad}:2: colour: unknown key (use axes, baselines, defaults, description, "
                                       "excludes, kind, name, runs)"]


def test_a_failed_points_row_holds_scalars_and_reports(tmp_path):
    """A failed point's row stored its list parameters as lists (`config: [fp32]`), and `qstate
    report` over it died on `unhashable type: 'list'`: now scalars, like a measured row's."""
    def crash(params):
        raise OverflowError("Python int too large to convert to C long")

    suite = tmp_path / "mem.yaml"
    suite.write_text("kind: memory\ndefaults: {numel: [1000, 2000]}\naxes:\n  config: [fp32, bf16]\n"
                     "baselines: [torch-fused]\n")
    register_hook("memory", crash)
    try:
        (run,) = run_suite(load_suite(suite), tmp_path / "out")
    finally:
        register_hook("memory", None)
    rows = load(run.path)["records"]
    assert [r["name"] for r in rows] == ["fp32", "bf16", "torch-fused"] and all(r["status"] == "failed" for r in rows)
    assert all(not isinstance(v, (list, dict)) for r in rows for v in r.values())
    assert rows[0]["config"] == "fp32" and rows[0]["numel"] == "1000, 2000" and "baseline" not in rows[0]
    r = runner.invoke(app, ["report", str(run.path), "--markdown", str(tmp_path / "r.md")])
    assert r.exit_code == 0, r.output
    assert "OverflowError: Python int too large" in (tmp_path / "r.md").read_text()


def with_meta(params):
    """fake_kernels plus an engine meta: `rounds` the same at every point, `cpu_share` and
    `numel` its own."""
    out = fake_kernels(params)
    share = 0.5 if params["numel"] == 2048 else 0.9
    return {**out, "meta": {"rounds": 3, "cpu_share": share, "numel": params["numel"], "threads": 2}}


def engine_meta(doc):
    """A document's meta without the suite's state, and each point's engine meta."""
    meta = doc["meta"]
    return ({k: v for k, v in meta.items() if k != "suite"},
            {k: p.get("meta") for k, p in meta["suite"]["points"].items()})


def test_a_suite_run_keeps_each_points_engine_meta(hooks, suite_file, tmp_path):
    """The runner merged records and extras but dropped the engine's meta: a suite's
    kernels.json had no rounds/threads/cpu_share, its diagnose.json no gradient_checks."""
    register_hook("kernels", with_meta)
    (sweep, diag) = run_suite(load_suite(suite_file), tmp_path / "out")
    doc = load(sweep.path)
    run, points = engine_meta(doc)
    assert run == {"rounds": 3, "cpu_share": 0.5, "threads": 2}  # one value at every point; cpu_share the lowest
    assert len(points) == 12 and all(m["rounds"] == 3 and m["numel"] in (1024, 2048, 4096, 8192)
                                     for m in points.values())
    assert {m["numel"] for m in points.values()} == {1024, 2048, 4096, 8192}
    assert engine_meta(load(diag.path)) == ({}, {k: None for k in diag.state["points"]})  # no meta from the hook


def test_resume_keeps_the_engine_meta_of_finished_points(hooks, suite_file, tmp_path):
    register_hook("kernels", with_meta)
    run_suite(load_suite(suite_file), tmp_path / "full")
    register_hook("kernels", Counting(with_meta, interrupt_after=5))
    with pytest.raises(KeyboardInterrupt):
        run_suite(load_suite(suite_file), tmp_path / "cut")
    register_hook("kernels", with_meta)
    run_suite(load_suite(suite_file), tmp_path / "cut", resume=True)
    assert engine_meta(load(tmp_path / "cut" / "sweep.json")) == engine_meta(load(tmp_path / "full" / "sweep.json"))


def test_a_suite_run_keeps_the_memory_engines_meta(tmp_path):
    """The real engine (no hook): what `qstate bench memory --json` writes in meta is in the
    suite's document, per point and, where every point agrees, at the top."""
    suite = tmp_path / "mem.yaml"
    suite.write_text("kind: memory\ndefaults: {numel: 4096, device: cpu}\naxes:\n  config: [fp32, bred-4bit]\n")
    (run,) = run_suite(load_suite(suite), tmp_path / "out")
    top, points = engine_meta(load(run.path))
    assert top["dtype"] == "fp32" and top["targets"] == [4096]
    assert sorted(m["subjects"][0] for m in points.values()) == ["bred-4bit", "fp32"]


@pytest.mark.schema
def test_the_resume_hint_repeats_every_set(hooks, suite_file, tmp_path):
    """The hint dropped --set, and the command it gave refused the finished points."""
    from qstate_cli.cli.suite_cmd import resume_command

    assert resume_command(Path("s s.yaml"), ["numel=65536", "config=[a, b]"], Path("out")) == (
        "qstate run 's s.yaml' --set numel=65536 --set 'config=[a, b]' --out out --resume")
    assert resume_command("s.yaml", None, "o") == "qstate run s.yaml --out o --resume"
    out = tmp_path / "cut dir"
    register_hook("kernels", Counting(fake_kernels, interrupt_after=5))
    sets = ["--set", "bits=8", "--set", "runs.sweep.axes.config=[a, b]"]
    r = runner.invoke(app, ["run", str(suite_file), *sets, "--out", str(out), "--no-report"], env={"COLUMNS": "60"})
    assert r.exit_code == 130
    hint = r.stderr.split("continue with `", 1)[1].split("`", 1)[0]
    assert hint == resume_command(suite_file, ["bits=8", "runs.sweep.axes.config=[a, b]"], out)
    register_hook("kernels", fake_kernels)
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(out), "--resume", "--no-report"])  # the old hint
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "finished points are not in this suite" in r.stderr
    r = runner.invoke(app, [*shlex.split(hint)[1:], "--no-report"])
    assert r.exit_code == 0, r.output
    assert len(load(out / "sweep.json")["meta"]["suite"]["done"]) == 12


@pytest.mark.schema
def test_a_pydantic_too_old_for_the_schema_is_named(monkeypatch):
    """pydantic 2.0-2.4 has no Discriminator/Tag: the schema's import failed and the note said
    'pydantic is not installed', which sent the user looking for the wrong fix."""
    import builtins

    from qstate_cli.suites import load as suite_load

    real_import = builtins.__import__

    def old_pydantic(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "pydantic" and fromlist and "Discriminator" in fromlist:
            raise ImportError("cannot import name 'Discriminator' from 'pydantic'")
        return real_import(name, globals, locals, fromlist, level)

    import qstate_cli.suites as suites_package

    monkeypatch.delitem(sys.modules, "qstate_cli.suites.schema", raising=False)  # imported afresh, as at first use
    monkeypatch.delattr(suites_package, "schema", raising=False)
    monkeypatch.setattr(builtins, "__import__", old_pydantic)
    errors, note = suite_load._schema_errors({"kind": "kernels"})
    import pydantic

    assert note == (f"pydantic {pydantic.VERSION} cannot load the suite schema (cannot import name 'Discriminator' "
                    "from 'pydantic'); it needs pydantic >= 2.5: the suite had a basic check only")
    assert errors == []


NO_PYDANTIC_AXES = """
import sys
sys.modules["pydantic"] = None  # as on the GPU machine
from qstate_cli.errors import QstateError
from qstate_cli.suites import SuiteError, load_suite
for path in sys.argv[1:]:
    try:
        load_suite(path)
        print("accepted")
    except SuiteError as exc:
        print(exc.issues[0])
from qstate_cli.cli import suite_cmd
try:
    suite_cmd.schema()
except QstateError as exc:
    print(exc)
"""


def test_without_pydantic_the_basic_check_refuses_what_the_schema_does(tmp_path):
    """Without pydantic `numel: []` ran 0 points, a range with a step and a factor ignored
    its factor, `baselines: torch-fused` was read as baselines 't', 'o', ..., and `qstate
    suite schema` ended in a ModuleNotFoundError traceback."""
    cases = {"empty": "kind: kernels\naxes:\n  numel: []\n",
             "both": "kind: kernels\naxes:\n  numel: {start: 1, stop: 8, step: 1, factor: 2}\n",
             "text": "kind: kernels\nbaselines: torch-fused\n",
             "word": "kind: kernels\naxes:\n  numel: {start: one, stop: 8, step: 1}\n",
             "good": "kind: kernels\naxes:\n  numel: {start: 1024, stop: 4096, factor: 2}\nbaselines: [torch-fused]\n"}
    paths = []
    for name, text in cases.items():
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(text)
    out = subprocess.run([sys.executable, "-c", NO_PYDANTIC_AXES, *map(str, paths)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{paths[0]}:3: axes.numel: an axis needs at least one value",
        f"{paths[1]}:3: axes.numel: give exactly one of step or factor",
        f"{paths[2]}:2: baselines: a list of baseline names (baselines: [torch-fused])",
        f"{paths[3]}:3: axes.numel.start: must be a number (got 'one')",
        "accepted",
        "suite schema: pydantic is not installed; the schema is pydantic's (pip install 'pydantic>=2.5')"]
