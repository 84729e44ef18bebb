"""`qstate trace demo|info` and `qstate diagnose` end to end: CliRunner and real subprocesses."""
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from qstate_cli import results, theory
from qstate_cli.cli import app
from qstate_cli.quant import parse_spec

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "250"}


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory):
    """The demo at a few-second size: 6 steps, one block per tensor."""
    path = tmp_path_factory.mktemp("demo") / "demo.pt"
    r = runner.invoke(app, ["trace", "demo", "-o", str(path), "--steps", "6"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert "val_loss" in r.stdout and path.exists()
    return path


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "qstate_cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=300, env={"COLUMNS": "250", "PATH": "/usr/bin:/bin",
                                                             "PYTHONPATH": str(ROOT)})


def test_trace_info(demo_trace):
    r = runner.invoke(app, ["trace", "info", str(demo_trace)], env=WIDE)
    assert r.exit_code == 0, r.output
    assert "adamw" in r.stdout and "blocks.0.qkv.weight" in r.stdout and "1..6 (6)" in r.stdout
    r = runner.invoke(app, ["trace", "info", str(demo_trace), "--json"])
    doc = json.loads(r.stdout)
    assert doc["summary"]["tensors"] == 29 and doc["summary"]["grad_dtype"] == "bf16"
    assert sum(t["recorded"] for t in doc["tensors"]) == doc["summary"]["recorded_elements"]


def test_diagnose_json_holds_everything_the_contract_names(demo_trace, tmp_path):
    out = tmp_path / "d.json"
    r = runner.invoke(app, ["diagnose", str(demo_trace), "-c", "bred-4bit", "-c", "bf16", "--bits", "8",
                            "--rounding", "nearest", "--json", str(out), "--profile"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert "ranked by update error" in r.stdout and "Replay profile on cpu" in r.stdout
    assert "reset bf16: staleness model" in r.stdout
    doc = results.load(out)
    assert doc["kind"] == "diagnose" and doc["env"]["device"] == "cpu"
    frame = results.frame(doc)
    assert set(frame["config"]) == {"bred-4bit", "bf16", "nearest-8bit"} and set(frame["state"]) == {"m", "v"}
    assert (frame["steps"] == 6).all() and (frame["numel"] == doc["meta"]["recorded_elements"]).all()
    for key in ("series", "histograms", "per_code", "theory", "per_tensor", "dim_scaling"):
        assert doc[key], key
    assert {r["step"] for r in doc["series"]} == set(range(1, 7))
    assert {r["config"] for r in doc["theory"]} == {"bred-4bit", "bf16", "nearest-8bit"}
    bf16_v = frame[(frame.config == "bf16") & (frame.state == "v")].iloc[0]
    assert "by step 827" in bf16_v.reset_reason and "on the trace corpus no reset" in bf16_v.reset_reason
    assert pd.isna(bf16_v.reset_period)
    assert doc["meta"]["profile"]["element_steps"] == 6 * doc["meta"]["recorded_elements"]


def test_diagnose_as_a_real_subprocess(demo_trace, tmp_path):
    out = tmp_path / "sub.json"
    r = run_cli("diagnose", demo_trace, "--config", "sr-4bit", "--steps-limit", "4", "--reset", "2",
                "--json", out)
    assert r.returncode == 0, r.stderr
    assert "sr-4bit" in r.stdout and out.exists()
    doc = json.loads(out.read_text())
    assert {rec["steps"] for rec in doc["records"]} == {4} and {rec["reset_applied"] for rec in doc["records"]} == {2}
    r = run_cli("diagnose", "--theory", "--format", "e4m3", "--json", "-")
    rows = json.loads(r.stdout)["theory"]
    assert [row["rounding"] for row in rows] == ["nearest", "stochastic"] and rows[0]["fraction_bits"] == 3


def test_theory_table():
    r = runner.invoke(app, ["diagnose", "--theory", "--format", "bf16", "--beta2", "0.999"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert str(theory.reset_period(parse_spec("bf16"), 0.999)) in r.stdout and "1000" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["diagnose", "missing.pt"], "missing.pt: no such trace file"),
    (["diagnose"], "diagnose needs a TRACE"),
    (["diagnose", "--theory", "--format", "int4"], "covers float formats"),
    (["diagnose", "--theory", "--beta2", "1.5"], "--beta2 1.5"),
    (["diagnose", "demo", "--split", "rows"], "--split rows: choose auto, elements or configs"),
])
def test_diagnose_input_errors_are_one_line(args, message, tmp_path):
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


def test_bad_configuration_and_hostile_trace_exit_2(demo_trace, tmp_path):
    r = runner.invoke(app, ["diagnose", str(demo_trace), "--config", "bred4bit"])
    assert r.exit_code == 2 and "did you mean bred-4bit" in r.output and r.output.count("\n") == 1
    evil = tmp_path / "evil.pt"

    class Evil:
        def __reduce__(self):
            return (exec, (f"open({str(tmp_path / 'pwned')!r}, 'w')",))

    torch.save({"x": Evil()}, evil)
    r = run_cli("diagnose", evil)
    assert r.returncode == 2 and "refused" in r.stderr and not (tmp_path / "pwned").exists()


def test_html_and_markdown_reports(demo_trace, tmp_path):
    pytest.importorskip("qstate_cli.report")
    html, md = tmp_path / "r.html", tmp_path / "r.md"
    r = runner.invoke(app, ["diagnose", str(demo_trace), "-c", "bf16", "--html", str(html), "--markdown", str(md)])
    assert r.exit_code == 0, r.output
    assert html.stat().st_size > 0 and "bf16" in md.read_text()


def test_reports_without_the_report_module_are_a_clear_error(demo_trace, tmp_path):
    try:
        import qstate_cli.report  # noqa: F401
        pytest.skip("qstate_cli.report is present")
    except ImportError:
        pass
    r = runner.invoke(app, ["diagnose", str(demo_trace), "-c", "bf16", "--steps-limit", "2",
                            "--html", str(tmp_path / "r.html")])
    assert r.exit_code == 2 and "need qstate_cli.report" in r.output


def test_the_table_and_report_show_code_stalls_predictions_and_the_warning(tmp_path):
    """Heavy-tailed, non-stationary gradients (2048 x 200; the Gaussian model misses bf16's
    late v stall rate by 18-38 points at 60-600 steps there): the terminal table has the code-stall and both
    prediction columns and prints the warning; the Markdown report has the warning table."""
    from qstate_cli.trace import save_trace, synthetic

    path = save_trace(synthetic.heavy_tailed(2048, 200, df=3, decay=10, beta2=0.999), tmp_path / "heavy.pt")
    md = tmp_path / "heavy.md"
    r = runner.invoke(app, ["diagnose", str(path), "-c", "bf16", "--skip-reset-check", "--markdown", str(md)],
                      env=WIDE)
    assert r.exit_code == 0, r.output
    header = "".join(part.split("┡")[0] for part in r.stdout.split("┏")[1:])  # every part's header (cli/tables.py)
    for word in ("code", "gauss", "emp", "late"):
        assert word in header, word
    assert "model warning bf16 v: the Gaussian model predicts" in r.stdout and "kurtosis" in r.stdout
    assert "gradient checks: the Gaussian model's assumptions do not hold on this trace: gradient kurtosis" \
        in r.stdout.replace("\n", " ")  # said on its own line too, missed prediction or not
    assert "on the trace corpus no reset" in r.stdout  # --skip-reset-check: the corpus evidence's advice, unreplayed
    text = md.read_text()
    assert "Where the Gaussian staleness model misses" in text and "fell" in text


def test_profile_leaves_the_first_use_compilation_out_of_the_rates():
    """A phase's seconds compiling kernels (Timer.compiled) and loading them from the cache
    (Timer.loaded) are reported, and left out of every rate: 10 s measured for a
    configuration of which 8 s compiled is 2 s of replay; 2.5 s of which 0.5 s loaded, 2 s."""
    from types import SimpleNamespace

    from qstate_cli.diagnose.run import profile
    from qstate_cli.diagnose.tables import profile_rows

    raw = SimpleNamespace(configs=["a", "b"], layout=SimpleNamespace(n_valid=1000, unit=128, n=1024), n_steps=100,
                          wall_s=14.0, cpu_s=20.0, timings_s={"gather": 1.0, "shadow": 1.0, "a": 10.0, "b": 2.0},
                          compile_s={"a": 8.0}, load_s={}, device="cpu", threads=2, config_threads=1,
                          timings_synchronized=True)
    prof = profile(raw, 15.0)
    assert prof["compile_s"] == 8.0 and prof["phases_compile_s"] == {"a": 8.0}
    assert prof["phases_s"]["a"] == 10.0 and prof["replay_s"] == 6.0 and prof["replay_cpu_s"] == 12.0
    assert prof["config_element_steps_per_s"] == {"a": 50_000, "b": 50_000}
    assert prof["element_steps_per_s_per_config"] == round(100_000 * 2 / 6.0)
    rows, title = profile_rows(prof)
    by = {r["phase"]: r for r in rows}
    assert by["a"]["compiling_s"] == 8.0 and by["b"]["compiling_s"] == 0.0
    assert by["a"]["M_element_steps_per_s"] == by["b"]["M_element_steps_per_s"] == pytest.approx(0.05)
    assert "8.0 s compiling the CPU kernels (first use on this machine" in title
    assert "loading_s" not in rows[0] and "loading" not in title
    raw.compile_s = {}
    rows, title = profile_rows(profile(raw, 15.0))
    assert "compiling_s" not in rows[0] and "compiling" not in title and rows[2]["M_element_steps_per_s"] == 0.01
    raw.timings_s["b"], raw.load_s = 2.5, {"b": 0.5, "gather": 0.25}
    prof = profile(raw, 15.0)
    assert prof["load_s"] == 0.75 and prof["phases_load_s"] == {"b": 0.5, "gather": 0.25}
    assert prof["replay_s"] == 13.25 and prof["config_element_steps_per_s"]["b"] == 50_000
    rows, title = profile_rows(prof)
    assert [r["loading_s"] for r in rows] == [0.25, 0.0, 0.0, 0.5] and "compiling_s" not in rows[0]
    assert rows[3]["M_element_steps_per_s"] == pytest.approx(0.05)
    assert "0.75 s loading the CPU kernels from the cache (once per process) left out" in title
    assert "first_step_setup_s" not in rows[0] and "one-time work" not in title
    raw.timings_s["a"], raw.setup_s = 2.25, {"a": 0.25, "shadow": 0.5}  # Timer.setup: first calls' one-time work
    prof = profile(raw, 15.0)
    assert prof["setup_s"] == 0.75 and prof["phases_setup_s"] == {"a": 0.25, "shadow": 0.5}
    assert prof["replay_s"] == 12.5 and prof["replay_cpu_s"] == 18.5
    assert prof["config_element_steps_per_s"] == {"a": 50_000, "b": 50_000}
    rows, title = profile_rows(prof)
    assert [r["first_step_setup_s"] for r in rows] == [0.0, 0.5, 0.25, 0.0]
    assert rows[2]["M_element_steps_per_s"] == pytest.approx(0.05)
    assert "0.750 s of one-time work in the first step" in title
    # the loop's own count (StepClock: once, where phases ran side by side) for the loop's seconds
    raw.left_out_s, raw.net_wall_s, raw.net_cpu_s = {"compile": 0.0, "load": 0.5, "setup": 0.25}, 13.0, 19.0
    prof = profile(raw, 15.0)
    assert prof["replay_s"] == 13.0 and prof["replay_cpu_s"] == 19.0
    assert (prof["load_s"], prof["setup_s"]) == (0.5, 0.25) and prof["phases_setup_s"] == {"a": 0.25, "shadow": 0.5}
    assert prof["config_element_steps_per_s"] == {"a": 50_000, "b": 50_000}
    assert prof["element_steps_per_s_per_config"] == round(100_000 * 2 / 13.0)


def test_the_profile_carries_the_replays_own_count_of_one_time_work(monkeypatch):
    """From the replay's timers (runtime.Timer.setup per phase, StepClock for the loop)
    through ReplayPart and Replay to meta.profile, with two configurations side by side."""
    from qstate_cli.diagnose import diagnose
    from qstate_cli.quant import parse_config
    from qstate_cli.runtime import StepClock, Timer
    from qstate_cli.trace import synthetic

    monkeypatch.setattr(Timer, "setup", property(lambda self: {"shadow": 0.25, "bf16": 0.5}))
    monkeypatch.setattr(StepClock, "setup_s", property(lambda self: 1e-3 * self.calls.get(self.STEP, 0)))  # steps timed
    trace = synthetic.heavy_tailed(256, 4, df=3, decay=10, beta2=0.999)
    doc, raw = diagnose(trace, [parse_config("bf16"), parse_config("bred-4bit")], profile_phases=True,
                        backend="reference", config_threads=2)
    prof = doc["meta"]["profile"]
    assert prof["phases_setup_s"] == {"shadow": 0.25, "bf16": 0.5} and prof["setup_s"] == 0.004
    left = sum(raw.left_out_s.values())
    assert raw.left_out_s["setup"] == pytest.approx(4e-3) and raw.wall_s > left  # one StepClock step per step
    assert raw.net_wall_s == pytest.approx(raw.wall_s - left) and raw.net_cpu_s == pytest.approx(raw.cpu_s - left)
    assert prof["replay_s"] == round(raw.net_wall_s, 3) and prof["replay_cpu_s"] == round(raw.net_cpu_s, 3)
