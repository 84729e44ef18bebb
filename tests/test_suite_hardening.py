"""Suites: what a user probe found. A rerun leaves one consistent folder; failed rows make a
failed point; a resume runs on the same build and records its session; errors point at
the value's own place (file line, key, or the --set) and suggest the closest name."""
import json
import re
import shlex
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.results import load
from qstate_cli.suites import SuiteError, load_suite, register_hook
from qstate_cli.suites import runner as suite_runner
from qstate_cli.suites.expand import range_values
from qstate_cli.suites.runner import run_suite
from test_suite_runner import Counting, fake_kernels, hooks, results, suite_file  # noqa: F401 - fixtures

runner = CliRunner()


def write(tmp_path, text, name="suite.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def issue_of(path, sets=()):
    with pytest.raises(SuiteError) as err:
        load_suite(path, list(sets))
    return err.value.issues[0]


def validate(*args):
    return runner.invoke(app, ["suite", "validate", *map(str, args)])


# -- 1. a rerun without --resume --------------------------------------------------------------

def test_a_rerun_without_resume_replaces_every_runs_file_and_the_report(hooks, suite_file, tmp_path):  # noqa: F811
    """Only the runs that started were rewritten: diag.json kept the first run's rows, the
    old report stayed, and the printed resume command was refused."""
    out = tmp_path / "out"
    run_suite(load_suite(suite_file), out)  # 12 + 2 finished points
    for name in ("report.html", "report.md"):
        (out / name).write_text("the first run's report")
    old = load(out / "diag.json")  # a run the suite no longer has, of this suite
    old["meta"]["suite"]["run"] = "gone"
    (out / "gone.json").write_text(json.dumps(old))
    (out / "mine.json").write_text('{"not": "a suite file"}')  # someone else's file: left alone
    register_hook("kernels", Counting(fake_kernels, interrupt_after=2))
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(out), "--no-report"], env={"COLUMNS": "300"})
    assert r.exit_code == 130
    assert f"{out}: 16 finished points of an earlier run are replaced (use --resume to keep them)" in r.stderr
    assert load(out / "diag.json")["records"] == [] and load(out / "diag.json")["meta"]["suite"]["done"] == []
    assert len(load(out / "sweep.json")["meta"]["suite"]["done"]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["diag.json", "mine.json", "sweep.json"]
    hint = r.stderr.split("continue with `", 1)[1].split("`", 1)[0]
    register_hook("kernels", fake_kernels)
    r = runner.invoke(app, [*hint.split()[1:], "--no-report"])
    assert r.exit_code == 0, r.output
    assert "replaced" not in r.stderr
    run_suite(load_suite(suite_file), tmp_path / "full")
    assert results(out) == {**results(tmp_path / "full"), "mine": {"not": "a suite file"}}


def test_a_first_run_says_nothing_is_replaced(hooks, suite_file, tmp_path):  # noqa: F811
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(tmp_path / "o"), "--no-report"])
    assert r.exit_code == 0 and "replaced" not in r.stderr


# -- 4. a point with a failed row is failed ---------------------------------------------------

def oom_at_4096(params):
    """An engine that catches its own out of memory: the point returns, one row failed."""
    out = fake_kernels(params)
    if params["numel"] == 4096:
        out["records"].append({"name": "copy", "numel": 4096, "status": "failed",
                               "reason": "out of memory allocating 4,096 elements\nDefaultCPUAllocator: ..."})
    return out


def test_a_point_with_a_failed_row_is_failed_and_resume_retries_it(hooks, suite_file, tmp_path):  # noqa: F811
    """Rows marked failed (out of memory) were counted done: `failed 0`, and --resume kept them."""
    out = tmp_path / "out"
    register_hook("kernels", oom_at_4096)
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(out), "--no-report"], env={"COLUMNS": "300"})
    assert r.exit_code == 1, r.output  # the sweep went on, and says it failed: docs/reports.md
    state = load(out / "sweep.json")["meta"]["suite"]
    assert len(state["failed"]) == 3 and len(state["done"]) == 9  # config a, b and the baseline at 4096
    points_done_failed = r"sweep\s*│\s*kernels\s*│\s*12\s*│\s*9\s*│\s*3\s*│"
    assert re.search(points_done_failed, r.stdout), r.stdout
    assert f"3 of 14 points failed (3 in {out / 'sweep.json'}: rows with status failed" in r.stderr
    assert "--resume` retries them" in r.stderr
    assert "failed sweep: config=a numel=4096: out of memory allocating 4,096 elements\n" in r.stderr
    healthy = Counting(fake_kernels)
    register_hook("kernels", healthy)
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(out), "--resume", "--no-report"])
    assert r.exit_code == 0, r.output
    assert sorted(p["numel"] for p in healthy.calls) == [4096] * 3
    run_suite(load_suite(suite_file), tmp_path / "full")
    assert results(out) == results(tmp_path / "full")
    assert load(out / "sweep.json")["meta"]["suite"]["failed"] == []


def test_run_exits_1_after_writing_everything_when_a_point_failed(hooks, suite_file, tmp_path):  # noqa: F811
    """`qstate run suites/ci.yaml --out reports/ci-baseline` exited 0 with failed points: a
    baseline with failed rows was written silently. Now exit 1, after every file and the
    report are written, one stderr line naming how many and where; a row "unavailable" (a
    peer not installed here) is no failure."""
    def unavailable_at_4096(params):
        out = fake_kernels(params)
        if params["numel"] == 4096:
            out["records"][0].update(status="unavailable", reason="not installed here", time_ms=None)
        return out

    register_hook("kernels", unavailable_at_4096)
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(tmp_path / "ok"), "--no-report"])
    assert r.exit_code == 0 and "failed" not in r.stderr, r.output
    register_hook("kernels", Counting(fake_kernels))
    suite = load_suite(suite_file, ["runs.sweep.defaults.crash=4096"])
    out = tmp_path / "out"
    r = runner.invoke(app, ["run", str(suite_file), "--set", "runs.sweep.defaults.crash=4096", "--out", str(out)],
                      env={"COLUMNS": "300"})
    assert r.exit_code == 1, r.output
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"check failed: 3 of 14 points failed (3 in {out / 'sweep.json'}: rows with status failed")
    assert "--set runs.sweep.defaults.crash=4096 --out" in last and last.endswith("--resume` retries them")
    assert (out / "report.html").is_file() and (out / "report.md").is_file()  # written before the exit
    rows = load(out / "sweep.json")["records"]
    assert len(rows) == 12 and sum(row["status"] == "failed" for row in rows) == 3
    assert len(load(out / "diag.json")["records"]) == 4 and len(suite.runs) == 2


# -- 5. a resume on another build -------------------------------------------------------------

@pytest.mark.schema
def test_resume_refuses_another_build_and_records_its_session(hooks, suite_file, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "out"
    real = suite_runner.environment
    register_hook("kernels", Counting(fake_kernels, interrupt_after=5))
    with pytest.raises(KeyboardInterrupt):
        run_suite(load_suite(suite_file), out)
    first = load(out / "sweep.json")["env"]
    register_hook("kernels", fake_kernels)
    for key, value in (("torch", "0.0.1"), ("python", "2.7.18"), ("qstate", "0.0.0"), ("device_name", "other CPU")):
        monkeypatch.setattr(suite_runner, "environment", lambda d=None, k=key, v=value: {**real(d), k: v})
        r = runner.invoke(app, ["run", str(suite_file), "--out", str(out), "--resume", "--no-report"])
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
        assert f"sweep.json: its rows were measured with {key} {first[key]!r}, this session has {value!r}" in r.stderr
    assert len(load(out / "sweep.json")["meta"]["suite"]["done"]) == 5  # nothing was touched
    monkeypatch.setattr(suite_runner, "environment",
                        lambda d=None: {**real(d), "git_sha": "feedbeef", "argv": ["qstate", "again"]})
    r = runner.invoke(app, ["run", str(suite_file), "--out", str(out), "--resume", "--no-report"])
    assert r.exit_code == 0, r.output
    doc = load(out / "sweep.json")
    state = doc["meta"]["suite"]
    assert doc["env"]["git_sha"] == first["git_sha"]  # env: the first session
    assert [(s["git_sha"], s["argv"]) for s in state["resumes"]] == [("feedbeef", ["qstate", "again"])]
    assert state["resumed"] == 1 and state["resumes"][0]["created"]
    sessions = [state["points"][k]["session"] for k in state["done"]]
    assert sessions == [0] * 5 + [1] * 7
    assert all(state["points"][row["point"]]["session"] in (0, 1) for row in doc["records"])


# -- 2. ranges that never end -----------------------------------------------------------------

@pytest.mark.parametrize("spec, key, shown", [
    ("{start: 1, stop: .inf, factor: 2}", "stop", "inf"),
    ("{start: .nan, stop: 8, step: 1}", "start", "nan"),
    ("{start: 1, stop: 8, step: .inf}", "step", "inf"),
    ("{start: 1, stop: 8, factor: .inf}", "factor", "inf"),
    ("{start: -.inf, stop: 8, step: 1}", "start", "-inf"),
])
def test_a_non_finite_range_is_one_line_naming_file_line_and_key(tmp_path, spec, key, shown):
    path = write(tmp_path, f"""
        kind: memory
        defaults: {{model: tiny-lm}}
        axes:
          numel: {spec}
        """)
    expected = f"{path}:4: axes.numel.{key}: must be a finite number (got {shown})"
    r = validate(path)
    assert r.exit_code == 2 and r.stderr.strip() == expected
    r = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.stderr.strip() == f"error: {expected}" and not (tmp_path / "o").exists()


def test_range_values_refuses_non_finite_bounds_without_the_schema():
    with pytest.raises(QstateError, match=r"stop: must be a finite number \(got inf\)"):
        range_values({"start": 1, "stop": float("inf"), "factor": 2})


# -- 3. a bad value is reported where it was written ------------------------------------------

LOCATED = """
    name: loc
    defaults: {optimizer: adamw}
    runs:
      - name: t
        kind: train
        defaults: {model: tiny-lm, steps: 5, lr: 0.001}
        axes:
          config: [fp32]
      - name: sweep
        kind: kernels
        defaults: {bits: 4, device: cpu}
        axes:
          config: [nearest-4bit]
          numel: [4096]
          dtype:
            - fp32
            - bf16
    """


@pytest.mark.parametrize("edit, line, key, words", [
    (("lr: 0.001", "lr: fast"), 6, "runs[0].defaults.lr", "lr must be float, got 'fast'"),
    (("{optimizer: adamw}", "{optimizer: adamww}"), 2, "defaults.optimizer", "unknown optimizer 'adamww'"),
    (("- bf16", "- bf61"), 17, "runs[1].axes.dtype[1]", "dtype=bf61: unknown dtype 'bf61'"),
    (("numel: [4096]", "numel: [4096, -3]"), 14, "runs[1].axes.numel[1]", "numel=-3 dtype=fp32: --numel must be >= 1"),
    (("{bits: 4, device: cpu}", "{bits: 4, device: cpu, model: gpt2-smal}"), 11, "runs[1].defaults.model",
     "unknown model 'gpt2-smal'; did you mean gpt2-small"),
])
def test_a_bad_value_names_its_own_line_and_key(tmp_path, edit, line, key, words):
    """Every point error was blamed on `axes` (its line) when the point had any assignment."""
    path = write(tmp_path, textwrap.dedent(LOCATED).replace(*edit))
    issue = issue_of(path)
    assert issue.startswith(f"{path}:{line}: {key}: "), issue
    assert words in issue, issue


def test_a_missing_trace_in_an_axis_names_its_own_item(tmp_path):
    """`trace: [t.pt, at.pt]` with at.pt missing was blamed on item 0 (its path ends in 't.pt')."""
    from qstate_cli.trace import save_trace, synthetic

    save_trace(synthetic.gaussian(64, 3), tmp_path / "t.pt")
    path = write(tmp_path, "kind: diagnose\ndefaults: {config: [bf16]}\naxes:\n  trace:\n    - t.pt\n    - at.pt\n")
    issue = issue_of(path)
    assert issue.startswith(f"{path}:6: axes.trace[1]: "), issue


def test_a_bad_value_from_set_names_the_set_and_validate_takes_set(tmp_path):
    path = write(tmp_path, LOCATED)
    issue = issue_of(path, ["runs.sweep.axes.numel=[-4]"])
    assert issue.startswith("--set runs.sweep.axes.numel=[-4]: runs[1].axes.numel[0]: "), issue
    assert "--numel must be >= 1" in issue
    issue = issue_of(path, ["lr=fast"])
    assert issue.startswith("--set lr=fast: runs[0].defaults.lr: ") and "got 'fast'" in issue, issue
    r = validate(path, "--set", "runs.sweep.axes.numel=[-4]")
    assert r.exit_code == 2 and r.stderr.startswith("--set runs.sweep.axes.numel=[-4]: runs[1].axes.numel[0]: ")
    r = validate(path, "--set", "runs.sweep.axes.dtype=[fp16]")
    assert r.exit_code == 0 and "ok: " in r.stdout and "2 run(s), 2 points" in r.stdout
    r = validate(path, "--set", "nokey")
    assert r.exit_code == 2 and "use KEY=VALUE" in r.stderr


def test_runs_hint_to_see_every_problem_repeats_the_sets(tmp_path):
    """`run` said "see `qstate suite validate`", which could not show a problem of a --set."""
    path = write(tmp_path, textwrap.dedent(LOCATED).replace("lr: 0.001", "lr: fast"))
    r = runner.invoke(app, ["run", str(path), "--set", "runs.sweep.axes.numel=[-4]", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
    hint = r.stderr.split("(and 1 more; see `", 1)[1].split("`", 1)[0]
    assert hint == f"qstate suite validate {path} --set 'runs.sweep.axes.numel=[-4]'"
    r = runner.invoke(app, shlex.split(hint)[1:])
    assert r.exit_code == 2 and [line.split(": ")[1] for line in r.stderr.strip().splitlines()] == [
        "runs[0].defaults.lr", "runs[1].axes.numel[0]"]


# -- 6. misspelt names get the closest one ----------------------------------------------------

@pytest.mark.parametrize("text, line, key, words", [
    ("kind: memory\ndescripton: x\n", 2, "descripton", "unknown key; did you mean description?"),
    ("runs:\n  - kind: memory\n    defualts: {model: tiny-lm}\n", 3, "runs[0].defualts",
     "unknown key; did you mean defaults?"),
    ("kind: memory\naxes:\n  numel: {start: 1, stop: 8, factr: 2}\n", 3, "axes.numel.factr",
     "unknown key; did you mean factor?"),
    ("kind: kernels\ndefaults: {warmup_mss: 2}\n", 2, "defaults.warmup_mss",
     "kernels has no parameter 'warmup_mss'; did you mean warmup_ms"),
    ("kind: memory\naxes:\n  config: [fp32, bf16]\nexcludes:\n  - {config: bf61}\n", 5, "excludes[0].config",
     "'bf61' is not a value of axis config (fp32, bf16), so this exclude matches nothing; did you mean bf16?"),
    ("kind: kernels\naxes:\n  numel: [4096]\nbaselines: [torch-fused]\nexcludes:\n  - {baseline: torch-fusd}\n",
     6, "excludes[0].baseline", "'torch-fusd' is not a value of the baselines (torch-fused), so this exclude "
     "matches nothing; did you mean torch-fused?"),
    ("kind: memory\naxes:\n  numel: {start: 1, stop: 64, factor: 2}\nexcludes:\n  - {numel: [4, 5]}\n", 5,
     "excludes[0].numel", "5 is not a value of axis numel (1, 2, 4, 8, 16, 32, 64)"),
    ("kind: diagnose\ndefaults: {trace: deemo}\n", 2, "defaults.trace", "no such file (a relative path is read "
     "from the suite's folder); did you mean demo?"),
])
def test_a_misspelt_name_gets_the_closest(tmp_path, text, line, key, words):
    path = write(tmp_path, text)
    issue = issue_of(path)
    assert issue.startswith(f"{path}:{line}: {key}: "), issue
    assert words in issue, issue


def test_an_exclude_of_an_axis_a_set_replaced_is_not_checked(tmp_path):
    """`--set numel=65536` on a suite that excludes a size: the exclude matches nothing, as meant."""
    path = write(tmp_path, "kind: memory\naxes:\n  config: [fp32]\n  numel: [4096, 268435456]\n"
                           "excludes:\n  - {numel: 268435456}\n")
    assert [p.params["numel"] for _, pts in load_suite(path, ["numel=65536"]).points() for p in pts] == [65536]
    assert len(load_suite(path).points()[0][1]) == 1


# -- 7, 8. names from the file, folders, duplicate keys ---------------------------------------

def test_a_file_stem_that_cannot_name_a_folder_is_refused(tmp_path, monkeypatch):
    """`...yaml` (stem `..`) wrote mem.json and report.html into the working folder."""
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "kind: memory\ndefaults: {model: tiny-lm}\n", name="...yaml")
    before = sorted(p.name for p in tmp_path.iterdir())
    r = runner.invoke(app, ["run", str(path)])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(f"error: {path}:1: name: the file name gives the suite name '..' cannot name the "
                               "results folder") and r.stderr.strip().endswith("add a `name:` key")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    named = write(tmp_path, "name: fine\nkind: memory\n", name="...yaml")
    assert load_suite(named).name == "fine"
    assert issue_of(write(tmp_path, "kind: memory\n", name="x" * 81 + ".yaml")).endswith("add a `name:` key")


@pytest.mark.schema
def test_validate_says_a_folder_is_a_folder_and_goes_on(tmp_path):
    good = write(tmp_path, "kind: memory\n", name="good.yaml")
    r = validate(tmp_path, good)
    assert r.exit_code == 2
    assert r.stderr.strip() == f"{tmp_path}: is a folder; name a suite file (e.g. {tmp_path}/*.yaml)"
    assert r.stdout.startswith(f"ok: {good}")


def test_a_duplicate_key_in_a_run_names_the_run(tmp_path):
    path = write(tmp_path, """
        runs:
          - name: mem
            kind: memory
            defaults: {model: tiny-lm}
            defaults: {model: small-lm}
        """)
    assert issue_of(path) == f"{path}:5: runs[0].defaults: duplicate key (first on line 4)"


# -- 9. descriptions in the results -----------------------------------------------------------

def test_the_suite_and_run_descriptions_are_in_meta(hooks, tmp_path):  # noqa: F811
    path = write(tmp_path, """
        name: described
        description: the whole suite
        runs:
          - name: sweep
            kind: kernels
            description: one run
            axes: {config: [a], numel: [1024]}
          - name: diag
            kind: diagnose
            defaults: {trace: demo}
            axes: {config: [x]}
        """)
    sweep, diag = run_suite(load_suite(path), tmp_path / "out")
    assert load(sweep.path)["meta"]["suite"]["description"] == "the whole suite"
    assert load(sweep.path)["meta"]["suite"]["run_description"] == "one run"
    assert (load(diag.path)["meta"]["suite"]["description"], load(diag.path)["meta"]["suite"]["run_description"]) \
        == ("the whole suite", "")
    inline = write(tmp_path, "description: inline\nkind: kernels\naxes: {config: [a], numel: [1]}\n", "inline.yaml")
    (run,) = run_suite(load_suite(inline), tmp_path / "inline")
    assert load(run.path)["meta"]["suite"]["description"] == "inline"
    assert load(run.path)["meta"]["suite"]["run_description"] == "inline"


def test_an_exclude_of_a_trace_file_drops_its_points(tmp_path):
    """Axis trace paths were read from the suite's folder but exclude values were not: an
    exclude that validation accepts must also drop the points."""
    for name in ("a.pt", "b.pt"):
        (tmp_path / name).write_bytes(b"not read here")
    path = write(tmp_path, "kind: diagnose\naxes:\n  trace: [a.pt, b.pt]\n  config: [fp32]\n"
                           "excludes:\n  - {trace: b.pt}\n")
    points = load_suite(path, check_params=False).points()[0][1]
    assert [p.params["trace"] for p in points] == [str(tmp_path / "a.pt")]
