"""The trace corpus (trace/corpus.py, trace/recipes.py): names, seeded recordings, the
`corpus:` prefix through the CLI (CliRunner and a real subprocess), suites/corpus.yaml
on the smallest trace, and the across-traces tables (report/corpus.py)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli import results
from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.report import corpus as across
from qstate_cli.trace import corpus, load_trace, recipes

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "250"}

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache holding corpus:synthetic-heavy, recorded in full (3000 steps, ~10 s of CPU):
    the cache re-records a file whose steps do not match its name, so a shorter stand-in
    would be replaced by whichever test reads it first."""
    path = tmp_path_factory.mktemp("qstate-cache")
    old = os.environ.get("QSTATE_CACHE")
    os.environ["QSTATE_CACHE"] = str(path)
    try:
        recipes.record_synthetic(path / corpus.ENTRIES["synthetic-heavy"].filename, 3000, 0)
        yield path
    finally:
        if old is None:
            os.environ.pop("QSTATE_CACHE", None)
        else:
            os.environ["QSTATE_CACHE"] = old


def run_cli(*args, cache_dir):
    return subprocess.run([sys.executable, "-m", "qstate_cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env={"COLUMNS": "250", "PATH": "/usr/bin:/bin",
                                                      "PYTHONPATH": str(ROOT), "QSTATE_CACHE": str(cache_dir)})


def test_names_resolve_and_unknown_names_suggest(monkeypatch, tmp_path):
    monkeypatch.setenv("QSTATE_CACHE", str(tmp_path))
    assert corpus.resolve("some/trace.pt") == Path("some/trace.pt")
    (tmp_path / corpus.ENTRIES["digits-cnn"].filename).touch()  # cached: resolved without recording
    assert corpus.resolve("corpus:digits-cnn") == tmp_path / corpus.ENTRIES["digits-cnn"].filename
    monkeypatch.setattr(corpus, "cached_demo", lambda log=None: Path("the-demo"))
    assert corpus.resolve("demo") == Path("the-demo") and corpus.resolve("corpus:tiny-lm") == Path("the-demo")
    with pytest.raises(QstateError, match="unknown corpus trace 'digit-cnn'; did you mean digits-cnn"):
        corpus.resolve("corpus:digit-cnn")


def test_synthetic_process_is_seeded_heavy_tailed_and_decays():
    a, b, c = (recipes.HeavyTailedGradients(100, s) for s in (0, 0, 1))
    ga, gb, gc = a(0), b(0), c(0)
    assert torch.equal(ga, gb) and not torch.equal(ga, gc)
    assert a.amplitude(0) ** 2 / a.amplitude(100) ** 2 == pytest.approx(10.0)
    # unit-variance Student-t(3): P(|eps| > 5) = P(|t3| > 5 sqrt(3)) ~ 3.3e-3; a Gaussian's is 5.7e-7
    eps = a._student_t((200_000,)) / math.sqrt(3.0)
    tail = float((eps.abs() > 5).float().mean())
    assert 1.5e-3 < tail < 6e-3


def test_recording_is_reproducible(tmp_path):
    runs = [recipes.record_synthetic(tmp_path / f"{i}.pt", 30, seed) for i, seed in enumerate((0, 0, 1))]
    traces = [load_trace(tmp_path / f"{i}.pt") for i in range(3)]
    assert traces[0].n_steps == 30 and traces[0].recorded_elements == 4 * 2048 == runs[0]["recorded_elements"]
    assert traces[0].meta["model"] == "synthetic-heavy" and traces[0].optimizer == "adamw"
    fp = [corpus.fingerprint(t) for t in traces]
    assert fp[0] == fp[1] != fp[2]


def test_digits_cnn_records_a_real_run(tmp_path):
    pytest.importorskip("sklearn", reason="the digits data ship with scikit-learn")
    summary = recipes.record_digits(tmp_path / "d.pt", 5, 0)
    tr = load_trace(tmp_path / "d.pt")
    assert tr.n_steps == 5 and "conv1.weight" in [t.name for t in tr.tensors]
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and math.isfinite(summary["train_loss"])


def test_corpus_names_work_in_diagnose(cache, tmp_path):
    out = tmp_path / "d.json"
    r = runner.invoke(app, ["diagnose", "corpus:synthetic-heavy", "-c", "bred-4bit", "--steps-limit", "8",
                            "--json", str(out)], env=WIDE)
    assert r.exit_code == 0, r.output
    doc = results.load(out)
    assert doc["meta"]["trace"].endswith(corpus.ENTRIES["synthetic-heavy"].filename) and doc["meta"]["steps"] == 8
    r = runner.invoke(app, ["diagnose", "corpus:nope"], env=WIDE)
    assert r.exit_code == 2 and "unknown corpus trace 'nope'" in r.output


def test_corpus_names_work_in_trace_info(cache):
    r = runner.invoke(app, ["trace", "info", "corpus:synthetic-heavy", "--json"], env=WIDE)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["summary"]["trace"].endswith(corpus.ENTRIES["synthetic-heavy"].filename)
    assert doc["summary"]["recorded_elements"] == 4 * 2048 and len(doc["tensors"]) == 4
    r = runner.invoke(app, ["trace", "info", "corpus:digit-cnn"], env=WIDE)
    assert r.exit_code == 2 and "did you mean digits-cnn" in r.output


def test_corpus_cli_as_a_subprocess(cache, tmp_path):
    r = run_cli("trace", "corpus", "--json", "--sha256", cache_dir=cache)
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    heavy = rows["corpus:synthetic-heavy"]
    assert heavy["cached"] and heavy["recorded_elements"] == 8192 and len(heavy["sha256"]) == 64
    assert heavy["same_as_report"] is (heavy["sha256"] == corpus.RECORDED_SHA256["synthetic-heavy"])
    if synthetic_sha256_here() is not None:  # a host kind whose bits are known (below): exactly those
        assert heavy["sha256"] == synthetic_sha256_here()
    assert heavy["sha256"] == corpus.fingerprint(load_trace(cache / corpus.ENTRIES["synthetic-heavy"].filename))
    r = run_cli("diagnose", "corpus:synthetic-heavy", "-c", "nearest-4bit", "--steps-limit", "5", cache_dir=cache)
    assert r.returncode == 0, r.stderr
    assert "nearest-4bit" in r.stdout and "5 steps x 8192 elements" in r.stdout
    r = run_cli("trace", "corpus", "--record", "nope", cache_dir=cache)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown corpus trace" in r.stderr


def test_corpus_suite_runs_on_the_smallest_trace(cache, tmp_path):
    r = run_cli("suite", "validate", ROOT / "suites/corpus.yaml", cache_dir=cache)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "res"
    r = run_cli("run", ROOT / "suites/corpus.yaml", "--set", "trace=corpus:synthetic-heavy", "--set", "steps_limit=6",
                "--out", out, cache_dir=cache)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = results.load(out / "diagnose.json")
    configs = {x["config"] for x in doc["records"]}
    assert len(configs) == 17 and {"bred-4bit", "bred-sr-4bit", "torchao-4bit", "bnb-8bit", "bred-8bit",
                                   "te-fp8", "flashoptim-8bit"} <= configs
    assert all(x["steps"] == 6 for x in doc["records"])
    assert (out / "report.md").exists()


def test_a_corpus_trace_this_machine_cannot_record_stops_the_suite_before_any_work(cache, tmp_path, monkeypatch):
    """A recipe's missing package is found when the run checks its points: nothing replayed,
    no results file (it had stopped at the point after 30 s of replays of the others)."""
    import dataclasses

    monkeypatch.setitem(corpus.ENTRIES, "digits-cnn",
                        dataclasses.replace(corpus.ENTRIES["digits-cnn"], needs=("qstate_no_such_package",)))
    out = tmp_path / "res"
    r = runner.invoke(app, ["run", str(ROOT / "suites/corpus.yaml"), "--set", "steps_limit=6",
                            "--set", "trace=[corpus:synthetic-heavy, corpus:digits-cnn]", "--out", str(out)], env=WIDE)
    assert r.exit_code == 2, r.output
    assert "needs qstate_no_such_package (not installed): pip install qstate_no_such_package" in r.output
    assert "trace=corpus:digits-cnn" in r.output and not (out / "diagnose.json").exists()
    r = runner.invoke(app, ["suite", "validate", str(ROOT / "suites/corpus.yaml")], env=WIDE)
    assert r.exit_code == 0, r.output  # what this machine lacks is the run's to say: the suite is valid anywhere
    r = runner.invoke(app, ["diagnose", "corpus:digits-cnn", "-c", "nope-4bit"], env=WIDE)
    assert r.exit_code == 2 and "nope-4bit" in r.output  # the options first, then the machine


def _rec(point, config, state, err, **kw):
    return {"point": point, "config": config, "state": state, "update_rel_error": err, "update_cosine": 0.9,
            "bytes_per_param": 1.0625, "drift_mean": 0.01, "stall_rate": 0.1, "stall_rate_predicted": None, **kw}


def _doc(records):
    points = {"p1": {"params": {"trace": "corpus:a"}}, "p2": {"params": {"trace": "corpus:b"}},
              "p3": {"params": {"trace": "corpus:c"}}}
    return {"kind": "diagnose", "meta": {"suite": {"points": points}}, "records": records}


def test_across_traces_rows_medians_and_optional_columns():
    recs = []
    for point, errs in (("p1", (0.4, 0.5)), ("p2", (0.6, 0.3)), ("p3", (float("nan"), 0.2))):
        for cfg, err in zip(("x", "y"), errs):
            recs += [_rec(point, cfg, "m", err), _rec(point, cfg, "v", err)]
    rows = across.per_trace_rows(_doc(recs))
    assert len(rows) == 6 and {r["trace"] for r in rows} == {"corpus:a", "corpus:b", "corpus:c"}
    assert [r["config"] for r in rows if r["rank_in_trace"] == 1] == ["x", "y", "y"]
    med = {r["config"]: r for r in across.median_rows(rows)}
    assert med["y"]["median_update_rel_error"] == pytest.approx(0.3) and med["y"]["first_in"] == 2
    assert med["x"]["max_update_rel_error"] == math.inf and med["x"]["worst_trace"] == "corpus:c"
    tables, summary = across.tables(_doc(recs))
    assert tables[1].headers[:3] == ["trace", "rank", "config"]
    assert "code stall v" not in tables[1].headers and "model warning" not in tables[1].headers
    assert summary == ["across 3 traces: lowest median update error y (0.3; first on 2 of 3)"]
    recs[1].update(code_stall_rate=0.7, stall_rate_predicted_empirical=0.65, model_warning="g is not Gaussian")
    per_trace = across.tables(_doc(recs))[0][1]
    assert {"code stall v", "pred v (empirical)", "model warning"} <= set(per_trace.headers)
    assert any("v: g is not Gaussian" in row for row in per_trace.rows)
    one = _doc([r for r in recs if r["point"] == "p1"])
    assert across.tables(one) == ([], [])


# synthetic-heavy's sha256 as torch 2.13.0+cpu records it, per host kind (CPU vendor, torch's
# vector capability): torch's vectorized randn and exp round differently per instruction set
# and per vendor. The report's traces were recorded where the AMD EPYCs rebuild them; the
# AVX-512 Xeons (2026-12-02, LLVM's 'rocketlake'; a 2-core Sapphire Rapids, avx512_fp16,
# 2026-12-07) rebuild another hash, and on that Xeon ATEN_CPU_CAPABILITY=default a third
# (9e1c8fde7360...; avx2 gives the AVX512 bits). A host kind not listed skips the exact check
# with its reason; the CLI's same_as_report is checked everywhere.
SYNTHETIC_BY_HOST = {
    ("AuthenticAMD", "AVX512"): corpus.RECORDED_SHA256["synthetic-heavy"],  # Zen 4, 2026-12-05/06
    ("GenuineIntel", "AVX512"): "f0599cc9e5c0121119203b1d859646740af262550e1a2bda8460398c84a6179a",
}


def host_kind() -> tuple[str, str]:
    """(the CPU vendor in /proc/cpuinfo, or "?", torch's CPU capability in this process)."""
    vendor = "?"
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "?")
    except OSError:
        pass
    return vendor, torch.backends.cpu.get_cpu_capability()


def synthetic_sha256_here() -> str | None:
    """synthetic-heavy's known sha256 on this host kind (None: not recorded here)."""
    return SYNTHETIC_BY_HOST.get(host_kind()) if torch.__version__ == "2.13.0+cpu" else None


def test_the_synthetic_trace_rebuilds_bit_for_bit(tmp_path):
    """The full recipe (3000 steps) reproduces the gradients this host kind recorded (the
    report's on the AMD EPYCs): a changed recipe, seed or recorder does not."""
    if synthetic_sha256_here() is None:
        pytest.skip(f"no synthetic-heavy sha256 recorded for torch {torch.__version__} on {host_kind()}: torch's "
                    "randn and exp give other bits per CPU kind")
    e = corpus.ENTRIES["synthetic-heavy"]
    e.record(tmp_path / "t.pt", e.steps, e.seed)
    assert corpus.fingerprint(load_trace(tmp_path / "t.pt")) == synthetic_sha256_here()
