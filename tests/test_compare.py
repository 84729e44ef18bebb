"""`qstate compare` on hand-made result pairs: every status, direction-aware tolerances,
the exit codes (CliRunner and a real subprocess), step summary and benchmark JSON."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.compare import STATUSES, compare_docs, compare_paths
from qstate_cli.errors import QstateError
from qstate_cli.kinds import KINDS
from qstate_cli.results import load

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests" / "data" / "results" / "compare" / "baseline"
NEW = ROOT / "tests" / "data" / "results" / "compare" / "new"
runner = CliRunner()


def doc(kind, records):
    return {"schema_version": 1, "kind": kind, "env": {}, "meta": {}, "records": records}


def by_name(verdict):
    return {(r["name"], r["metric"]): r for r in verdict.records}


def test_the_fixture_pair_gives_every_status():
    v = by_name(compare_paths(BASE, NEW))
    statuses = {r["status"] for r in v.values()}
    assert statuses == set(STATUSES) - {"unjudged"}  # unjudged: test_an_unreadable_baseline_metric_fails_closed
    k = "[triton] fp32 n={} @cuda"
    assert v[(f"nearest-4bit {k.format(4194304)}", "time_ms")]["status"] == "regressed"
    assert v[(f"bred-4bit {k.format(4194304)}", "time_ms")]["status"] == "improved"
    noisy = v[(f"sr-4bit {k.format(4194304)}", "time_ms")]
    assert noisy["status"] == "insignificant" and noisy["ratio"] > 1.1 and noisy["p_value"] > 0.01
    assert v[("torch-foreach [torch-foreach] fp32 n=16777216 @cuda", "time_ms")]["status"] == "new"
    gone = v[("torch-foreach [torch-foreach] fp32 n=65536 @cuda", "time_ms")]
    assert gone["status"] == "missing" and gone["regression"]
    shared = v[("torch-foreach [torch-foreach] fp32 n=4194304 @cuda", "time_ms")]
    assert shared["status"] == "noisy" and shared["ratio"] > 1.4 and not shared["regression"]
    assert "cpu share 0.55 below 0.75" in shared["why"]
    oom = v[("torch-fused [torch-fused] fp32 n=16777216 @cuda", "time_ms")]
    assert oom["status"] == "failed" and oom["regression"] and "out of memory" in oom["reason"]
    both_failed = v[(f"bred-4bit {k.format(2 ** 34)}", "time_ms")]
    assert both_failed["status"] == "failed" and not both_failed["regression"]
    drift = v[("nearest-4bit m", "drift_max_abs")]
    assert drift["status"] == "regressed" and drift["new"] > drift["baseline"] + drift["threshold"]
    assert v[("bred-4bit v", "drift_max_abs")]["status"] == "same"


def _timing_row(samples, **kw):
    s = sorted(samples)
    return {"name": "k", "numel": 1, "path": "triton", "status": "ok", "time_ms": s[len(s) // 2],
            "samples_ms": samples, **kw}


@pytest.mark.parametrize("new, status", [
    ([1.30, 1.31, 1.29, 1.32, 1.30, 1.28, 1.33], "regressed"),   # 30% slower, separated samples
    ([0.80, 0.81, 0.79, 0.82, 0.80, 0.78, 0.83], "improved"),
    ([1.05, 1.06, 1.04, 1.05, 1.07, 1.03, 1.05], "same"),        # significant but under the threshold
    ([1.30, 0.90, 1.60, 1.00, 1.40], "insignificant"),           # over the threshold, samples overlap
])
def test_timing_needs_the_ratio_and_the_test(new, status):
    base = doc("kernels", [_timing_row([1.00, 1.01, 0.99, 1.02, 1.00, 0.98, 1.03] if status != "insignificant"
                                       else [1.0, 1.3, 0.8, 1.1, 0.9])])
    v = compare_docs([base], [doc("kernels", [_timing_row(new)])])
    assert v.records[0]["status"] == status
    assert bool(v.regressions) == (status == "regressed")


@pytest.mark.parametrize("new_ms, status", [(3.0, "regressed"), (1.05, "same"), (0.5, "insignificant")])
def test_timing_without_samples_fails_closed(new_ms, status):
    """No samples to test a slowdown beyond the threshold: it stands (the gate fails closed)."""
    base = doc("kernels", [{"name": "k", "status": "ok", "time_ms": 1.0}])
    new = doc("kernels", [{"name": "k", "status": "ok", "time_ms": new_ms}])
    v = compare_docs([base], [new])
    assert v.records[0]["status"] == status and bool(v.regressions) == (status == "regressed")


def _diag(**metrics):
    row = {"config": "c", "state": "v", "drift_max_abs": 0.1, "rel_rms_error": 0.05, "stall_rate": 0.3,
           "update_cosine": 0.99, "update_rel_error": 0.1, "status": "ok"}
    return doc("diagnose", [{**row, **metrics}])


@pytest.mark.parametrize("metric, new, status", [
    ("drift_max_abs", 0.1115, "regressed"),       # more drift is worse: tol = 10% of 0.1
    ("drift_max_abs", 0.1095, "same"),
    ("drift_max_abs", 0.05, "improved"),
    ("update_cosine", 0.985, "regressed"),        # lower cosine is worse: tol 0.002
    ("update_cosine", 0.9985, "improved"),
    ("update_cosine", 0.9885, "same"),
    ("stall_rate", 0.314, "same"),                 # tol max(0.01, 5% of 0.3) = 0.015
    ("stall_rate", 0.316, "regressed"),
    ("stall_rate", 0.28, "improved"),
])
def test_quality_metrics_have_direction_aware_tolerances(metric, new, status):
    v = by_name(compare_docs([_diag()], [_diag(**{metric: new})]))
    assert v[("c v", metric)]["status"] == status


def test_train_divergence_and_loss():
    base = doc("train", [{"config": "nearest-4bit", "seed": 0, "final_val_loss": 2.40, "diverged": False}])
    new = doc("train", [{"config": "nearest-4bit", "seed": 0, "final_val_loss": None, "diverged": True}])
    v = by_name(compare_docs([base], [new]))
    assert v[("nearest-4bit seed=0", "diverged")]["status"] == "regressed"
    assert v[("nearest-4bit seed=0", "final_val_loss")]["status"] == "failed"
    assert {m.field for m in KINDS["train"].metrics} == {"final_val_loss", "diverged"}


def test_cli_exit_codes_summary_and_benchmark_json(tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    r = runner.invoke(app, ["compare", str(BASE), str(NEW), "--json", str(tmp_path / "bench.json"),
                            "--markdown", str(tmp_path / "v.md"), "--results", str(tmp_path / "compare.json")],
                      env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert r.exit_code == 1
    assert r.stdout.startswith("### qstate compare: regression (8 regressed, 2 failed, 2 missing, 1 new, "
                               "1 noisy, 1 insignificant, 1 improved, 51 same)")
    assert "| **regressed** | `diagnose: nearest-4bit m` | drift_max_abs |" in r.stdout
    assert r.stderr.startswith("check failed: 10 regression(s)")  # incl. the missing row
    assert summary.read_text() == "earlier step\n" + r.stdout + "\n"
    assert (tmp_path / "v.md").read_text() == r.stdout
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert all(set(b) >= {"name", "unit", "value"} and isinstance(b["value"], float) for b in bench)
    cos = [b for b in bench if "update_cosine" in b["name"]]
    assert cos and all(0 <= b["value"] < 0.1 and b["unit"] == "1 - cosine" for b in cos)
    verdicts = load(tmp_path / "compare.json")
    assert verdicts["kind"] == "compare" and len(verdicts["records"]) == 67

    same = runner.invoke(app, ["compare", str(BASE / "diagnose.json"), str(BASE / "diagnose.json")])
    assert same.exit_code == 0 and "no regression (40 same)" in same.stdout


@pytest.mark.parametrize("args, message", [
    (["missing.json", str(NEW)], "error: missing.json: no such results file"),
    ([str(BASE), str(NEW), "--threshold", "0.9"], "error: --threshold 0.9: use a finite ratio above 1"),
    ([str(BASE), str(NEW), "--alpha", "2"], "error: --alpha 2.0: use a significance level between 0 and 1"),
])
def test_cli_bad_input_is_exit_2(args, message):
    r = runner.invoke(app, ["compare", *args])
    assert r.exit_code == 2 and r.output.strip().startswith(message) and "\n" not in r.output.strip()


def test_real_subprocess_exit_codes(tmp_path):
    def qstate(*args):
        return subprocess.run([sys.executable, "-m", "qstate_cli", "compare", *map(str, args)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)

    regress = qstate(BASE, NEW)
    assert regress.returncode == 1 and "| **regressed** |" in regress.stdout
    notjson = tmp_path / "x.json"
    notjson.write_text('{"hello": 1}')
    bad = qstate(notjson, NEW)
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: {notjson}: not a qstate results file " \
                                                         "(no schema_version/records)"


# -- results the gate cannot judge fail it (exit 1); malformed ones are input errors (exit 2) ------------


def _kernels(**kw):
    return doc("kernels", [_timing_row([1.00, 1.01, 0.99, 1.02, 1.00, 0.98, 1.03], **kw)])


@pytest.mark.parametrize("new_row", [
    {"status": "ok", "time_ms": float("nan"), "samples_ms": None},   # ran, but measured nothing
    {"status": "ok", "time_ms": None, "samples_ms": []},
    {"status": "failed", "time_ms": float("nan"), "samples_ms": None, "reason": "RuntimeError: boom"},
])
def test_a_row_that_measured_in_the_baseline_and_not_in_new_fails_the_gate(new_row):
    v = compare_docs([_kernels()], [_kernels(**new_row)])
    rec = v.records[0]
    assert rec["status"] == "failed" and rec["regression"] and rec["why"], rec
    assert ("boom" in rec["why"]) if new_row["status"] == "failed" else "time_ms" in rec["why"]


@pytest.mark.parametrize("kind, edit", [
    ("diagnose", lambda r: r.update(drift_max_abs=float("nan"))),
    ("diagnose", lambda r: r.pop("drift_max_abs")),
    ("kernels", lambda r: r.update(time_ms=float("inf"), samples_ms=None)),
    ("kernels", lambda r: r.update(time_ms=None, samples_ms=None)),
])
def test_an_unreadable_baseline_metric_fails_closed(kind, edit):
    """A NaN or missing baseline metric where NEW has one was "new" and passed, against a NEW 10x worse."""
    base = _diag() if kind == "diagnose" else _kernels()
    edit(base["records"][0])
    new = _diag(drift_max_abs=1.0) if kind == "diagnose" else _kernels(time_ms=10.0, samples_ms=None)
    v = by_name(compare_docs([base], [new]))
    rec = v[("c v", "drift_max_abs")] if kind == "diagnose" else v[("k [triton] None n=1 @None", "time_ms")]
    assert rec["status"] == "unjudged" and rec["regression"] and "baseline" in rec["why"]


def test_rows_failed_or_unavailable_on_both_sides_do_not_regress():
    ok = _timing_row([1.00, 1.01, 0.99, 1.02, 1.00, 0.98, 1.03], name="ok")
    for status in ("failed", "unavailable"):
        base, new = (_kernels(status=status, time_ms=None) for _ in "bn")
        base["records"].append(ok)
        new["records"].append(ok)
        v = compare_docs([base], [new])
        rec = by_name(v)[("k [triton] None n=1 @None", "time_ms")]
        assert rec["status"] in ("failed", "missing") and not v.regressions
        alone = compare_docs([_kernels(status=status, time_ms=None)], [_kernels(status=status, time_ms=None)])
        assert [r["name"] for r in alone.regressions] == ["nothing compared"]  # compare_gate's tests


def test_a_row_unavailable_in_new_that_ran_in_the_baseline_is_missing_and_regresses(tmp_path):
    """Every row "unavailable" in NEW passed as "no regression (26 missing)"."""
    new = json.loads((BASE / "kernels.json").read_text())
    for row in new["records"]:
        row.update(status="unavailable", reason="no GPU here")
    (tmp_path / "new.json").write_text(json.dumps(new))
    r = runner.invoke(app, ["compare", str(BASE / "kernels.json"), str(tmp_path / "new.json")])
    assert r.exit_code == 1 and r.stdout.startswith("### qstate compare: regression (26 missing)")
    assert "unavailable in NEW: no GPU here" in r.stdout


def test_allow_missing_passes_the_rows_it_names_and_no_other(tmp_path):
    """A CI machine without a peer: its rows unavailable in NEW; --allow-missing torch-for*
    lets those through, named in the verdict, while a failed row and another missing one still fail."""
    new = json.loads((BASE / "kernels.json").read_text())
    for row in new["records"]:
        if row["name"] == "torch-foreach":
            row.update(status="unavailable", reason="not installed here", time_ms=None)
    (tmp_path / "new.json").write_text(json.dumps(new))
    args = ["compare", str(BASE / "kernels.json"), str(tmp_path / "new.json")]
    r = runner.invoke(app, args)
    assert r.exit_code == 1 and "missing" in r.stdout  # without the flag: the gate fails closed
    r = runner.invoke(app, [*args, "--allow-missing", "torch-for*", "--allow-missing", "muon-*", "--results",
                            str(tmp_path / "v.json")])
    verdicts = load(tmp_path / "v.json")
    peer = [x for x in verdicts["records"] if x["name"].startswith("torch-foreach")]
    assert len(peer) == 4 and all(x["status"] == "missing" and not x["regression"] for x in peer)
    assert all("allowed by --allow-missing torch-for*" in x["why"] for x in peer)
    assert verdicts["meta"]["notes"][-1] == "--allow-missing muon-* named no missing row"
    assert not any("--allow-missing torch-for*" in n for n in verdicts["meta"]["notes"])
    assert r.exit_code == 0 and r.stdout.startswith("### qstate compare: no regression"), r.output
    for row in new["records"]:  # a row that ran and failed is a failure, named or not
        if row["name"] == "bred-4bit":
            row.update(status="failed", reason="RuntimeError: boom", time_ms=None)
        if row["name"] == "sr-4bit":
            row.update(status="unavailable", reason="gone")
    (tmp_path / "new.json").write_text(json.dumps(new))
    v = compare_paths(BASE / "kernels.json", tmp_path / "new.json", allow_missing=["torch-for*", "bred-4bit"])
    failing = {r["name"].split()[0] for r in v.regressions}
    assert {"bred-4bit", "sr-4bit"} <= failing and "torch-foreach" not in failing
    assert runner.invoke(app, [*args, "--allow-missing", " "]).exit_code == 2
    r = runner.invoke(app, ["compare", "--ab", "bred-4bit", "sr-4bit", "--allow-missing", "x"])
    assert r.exit_code == 2 and "--allow-missing applies to result files" in r.output


def test_a_malformed_baseline_metric_is_an_input_error(tmp_path):
    base = _diag(drift_max_abs="0.1")
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "new.json").write_text(json.dumps(_diag()))
    r = runner.invoke(app, ["compare", str(tmp_path / "base.json"), str(tmp_path / "new.json")])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == f"error: {tmp_path / 'base.json'}: records[0] (c): drift_max_abs '0.1' is not a number"


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "1"])
def test_a_threshold_that_would_turn_the_gate_off_is_refused(value):
    r = runner.invoke(app, ["compare", str(BASE), str(NEW), "--threshold", value])
    assert r.exit_code == 2 and "use a finite ratio above 1" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_ci_baseline_passes_against_itself():
    """What .ci/run's gate compares against (reports/ci-baseline): equal to itself, exit 0."""
    r = runner.invoke(app, ["compare", str(ROOT / "reports" / "ci-baseline"), str(ROOT / "reports" / "ci-baseline")])
    assert r.exit_code == 0 and r.stdout.startswith("### qstate compare: no regression (") and "same)" in r.stdout


def test_every_compared_metric_is_type_checked_when_a_file_is_read():
    from qstate_cli.results import FLAG_FIELDS, METRIC_FIELDS

    assert {m.field for k in KINDS.values() for m in k.metrics} <= set(METRIC_FIELDS) | set(FLAG_FIELDS)


def test_verdict_markdown_ends_its_notes_before_a_table_and_counts_one_row():
    """GitHub renders a table that follows a list item without a blank line as part of the
    item's text; a folded table of one row says "1 row"."""
    from qstate_cli.compare import verdict_markdown

    v = compare_docs([_diag()], [_diag(drift_max_abs=0.2)])
    v.notes.append("cpu share 0.71: the machine was shared")
    md = verdict_markdown(v)
    lines = md.splitlines()
    note = lines.index("- cpu share 0.71: the machine was shared")
    table = next(i for i, line in enumerate(lines) if line.startswith("| "))
    assert lines[note + 1] == "" and lines[table - 1] == "" and table > note
    assert "<details>" not in md and md.count("`diagnose: c v` | drift_max_abs |") == 1  # 5 rows: one table
    from qstate_cli.report.markdown import table_md
    from qstate_cli.report.model import Table

    assert "<summary>One (1 row)</summary>" in table_md(Table("One", ["a"], [["1"]], fold=True))


def test_the_copy_reference_rows_get_no_verdict(tmp_path):
    """Each kernels run times a copy as the machine's reference; a slower memory bus made
    `compare reports/quick NEW` regress on five copy rows (15.95 -> 20.23 ms)."""
    from statistics import median

    base = load(ROOT / "reports" / "quick" / "kernels.json")
    slow = json.loads(json.dumps(base))
    for r in slow["records"]:
        if r.get("role") == "copy":
            r["samples_ms"] = [round(t * 1.5, 6) for t in r["samples_ms"]]
            r["time_ms"] = round(median(r["samples_ms"]), 6)
            r["round_ms"] = [round(t * 1.5, 6) for t in r.get("round_ms") or []] or r.get("round_ms")
    v = compare_docs([base], [slow])
    assert not [r for r in v.records if r["name"].startswith("copy ")]
    assert not v.regressions
    assert any(r["role"] == "copy" for r in base["records"])  # the case is real



# -- the CI gate: what a verdict says when timing could not be judged (noisy), and how it reads -----


def _noisy_pair(shares=(0.5,), names=("k",)):
    """Kernels rows timed in rounds; NEW's row i measured with cpu share shares[i]."""
    def rows(scale, share_of):
        out = []
        for i, name in enumerate(names):
            rounds = [round(t * scale, 6) for t in (1.0, 1.01, 0.99)]
            out.append({"name": name, "numel": 1, "path": "triton", "status": "ok", "time_ms": rounds[0],
                        "samples_ms": rounds, "round_ms": rounds, "rounds": 3, "cpu_share": share_of(i)})
        return out

    base = doc("kernels", rows(1.0, lambda i: 1.0))
    new = doc("kernels", rows(1.5, lambda i: shares[i] if i < len(shares) else 1.0))
    return base, new


def test_a_verdict_whose_timing_rows_are_all_noisy_says_timing_was_not_judged(tmp_path):
    """Every timing row noisy read "no regression (7 noisy)", exit 0, like a pass."""
    from qstate_cli.compare import verdict_markdown

    base, new = _noisy_pair()
    v = compare_docs([base], [new])
    assert [r["status"] for r in v.records] == ["noisy"] and not v.regressions
    assert v.notes and v.notes[0].startswith("timing NOT judged: the one timing row could not be judged (1 timed "
                                             "on a shared CPU with cpu share below 0.75), so this verdict says "
                                             "nothing about speed")
    md = verdict_markdown(v)
    assert md.startswith("### qstate compare: no regression (1 noisy); timing not judged\n")
    assert "- timing NOT judged:" in md
    some = compare_docs(*map(lambda d: [d], _noisy_pair(shares=(0.5, 1.0, 1.0), names=("a", "b", "c"))))
    assert some.notes == ["1 of 3 timing rows could not be judged (1 timed on a shared CPU with cpu share below "
                          "0.75): status noisy, no verdict either way on their times",
                          "2 timing rows judged by separation of 3 rounds, each with a 1-in-20 chance of calling "
                          "identical code slower: about 0.1 false regressions expected between identical code if the machine keeps its speed from run to run (more where it drifts); "
                          "--rounds 5 makes it 1 in 252 a row"]
    assert "timing not judged" not in verdict_markdown(some).splitlines()[0]
    assert compare_docs([_diag()], [_diag()]).notes == []  # no timing rows: nothing to say
    (tmp_path / "b.json").write_text(json.dumps(base))
    (tmp_path / "n.json").write_text(json.dumps(new))
    r = runner.invoke(app, ["compare", str(tmp_path / "b.json"), str(tmp_path / "n.json")])
    assert r.exit_code == 0 and "timing NOT judged" in r.stdout


def test_strict_timing_makes_a_noisy_row_a_regression(tmp_path):
    base, new = _noisy_pair(shares=(0.5, 1.0), names=("a", "b"))
    (tmp_path / "b.json").write_text(json.dumps(base))
    (tmp_path / "n.json").write_text(json.dumps(new))
    args = ["compare", str(tmp_path / "b.json"), str(tmp_path / "n.json")]
    assert runner.invoke(app, [*args, "--threshold", "2"]).exit_code == 0  # default: noisy is no regression
    r = runner.invoke(app, [*args, "--threshold", "2", "--strict-timing", "--results", str(tmp_path / "v.json")])
    assert r.exit_code == 1 and "check failed: 1 regression(s): kernels: a [triton]" in r.stderr, r.output
    recs = {x["name"].split()[0]: x for x in load(tmp_path / "v.json")["records"]}
    assert recs["a"]["status"] == "noisy" and recs["a"]["regression"]
    assert "--strict-timing: a timing row that could not be judged fails the gate" in recs["a"]["why"]
    assert recs["b"]["status"] == "same" and not recs["b"]["regression"]
    assert load(tmp_path / "v.json")["meta"]["strict_timing"] is True
    assert "| **noisy** | `kernels: a" in r.stdout and "With --strict-timing a noisy row is a regression" in r.stdout


def test_the_benchmark_json_leaves_noisy_rows_out():
    """A noisy row's time measures the machine; exported, github-action-benchmark's alert fired on it."""
    v = compare_paths(BASE, NEW)
    noisy = [r for r in v.records if r["status"] == "noisy"]
    assert noisy and all(r["new"] is not None for r in noisy)  # the fixture has one, with a value
    names = {b["name"] for b in v.benchmark()}
    assert not names & {f"{r['kind']}: {r['name']} {r['metric']}" for r in noisy}
    assert len(names) == sum(r["new"] is not None and r["metric"] != "diverged" and r["status"] != "noisy"
                             for r in v.records)


def test_a_step_summary_in_a_folder_that_does_not_exist_is_created(tmp_path):
    """Was a FileNotFoundError traceback and exit 1 after the verdict."""
    summary = tmp_path / "new" / "dir" / "s.md"
    r = runner.invoke(app, ["compare", str(BASE / "diagnose.json"), str(BASE / "diagnose.json")],
                      env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert r.exit_code == 0, r.output
    assert summary.read_text() == r.stdout + "\n"


def test_baseline_and_new_that_differ_never_print_the_same():
    """bytes_per_param regressed at tolerance 1e-9 read `1.118 | 1.118`."""
    from qstate_cli.compare import verdict_markdown

    def mem(bpp):
        return doc("memory", [{"name": "bred-4bit", "model": "small-lm", "status": "ok", "bytes_per_param": bpp}])

    v = compare_docs([mem(1.1177884615384615)], [mem(1.118483109096227)])
    assert v.regressions
    assert "| bytes_per_param | 1.1178 | 1.1185 |" in verdict_markdown(v)
    same = compare_docs([mem(1.1177884615384615)], [mem(1.1177884615384615)])
    assert "| bytes_per_param | 1.118 | 1.118 |" in verdict_markdown(same)  # equal: the usual 4 digits
    from qstate_cli.compare.table import distinct_digits

    for a, b in ((1.0, 1.0 + 1e-12), (2.0795, 2.08), (1e-9, 1.0000000001e-9), (0.1, 0.1 + 2 ** -56)):
        d = distinct_digits(a, b)
        assert format(a, f".{d}g") != format(b, f".{d}g"), (a, b, d)
    assert distinct_digits(3.0, 3.0) == 4 and distinct_digits(None, 1.0) == 4


def test_a_short_verdict_is_one_table_and_a_long_one_folds_the_rest():
    """A 1-row A/B verdict printed its row twice (above and inside <details>); the docs say
    tables fold past 12 rows."""
    from qstate_cli.compare import Verdict, verdict_markdown

    one = Verdict([{"name": "x vs y", "kind": "kernels", "metric": "time_ms", "unit": "ms", "better": "lower",
                    "baseline": 1.0, "new": 1.5, "ratio": 1.5, "status": "regressed", "regression": True,
                    "why": "w"}], 1.1, 0.0, ["y"], ["x"], [], "A/B rule.")
    md = verdict_markdown(one)
    assert md.count("kernels: x vs y") == 1 and "All verdicts" not in md
    long = verdict_markdown(compare_paths(BASE, NEW))  # 67 rows, 16 changed
    assert "<details><summary>All verdicts (67 rows)</summary>" in long
    assert long.count("| **regressed** | `diagnose: nearest-4bit m` | drift_max_abs |") == 2  # changed, then all
    folded = long.split("<details><summary>All verdicts")[1]
    assert long.count("| same |") == folded.count("| same |")  # "same" rows only folded


def test_the_timing_rule_is_printed_only_when_timing_was_compared():
    from qstate_cli.compare import verdict_markdown

    quality = verdict_markdown(compare_docs([_diag()], [_diag()]))
    assert "Timing regresses" not in quality and "Quality metrics have their own tolerances" in quality
    timing = verdict_markdown(compare_docs([_kernels()], [_kernels()]))
    assert "Timing regresses" in timing and "Quality metrics" not in timing


# -- identity: rows a suite axis tells apart (compare/identity.py) --------------------------------

def _suite_doc(kind, rows_per_point, run="r", extra_params=None):
    """A suite document: {point params (dict): [rows]} -> rows tagged with their point, and
    meta.suite.points holding each point's params, in the order given."""
    points, records = {}, []
    for i, (params, rows) in enumerate(rows_per_point):
        key = f"{run}{i}"
        points[key] = {"label": " ".join(f"{k}={v}" for k, v in params.items()),
                       "params": {**(extra_params or {}), **params}}
        records += [{**r, "point": key} for r in rows]
    d = doc(kind, records)
    d["meta"] = {"suite": {"name": "s", "file": "s.yaml", "run": run, "description": "", "points": points}}
    return d


def _reset_point(reset):
    """bf16 at one reset setting: without resets its v drifts 20x more (the user's probe)."""
    drift = 0.0037 if reset == "none" else 0.00019
    return ({"config": "bf16", "reset": reset},
            [{"config": "bf16", "state": s, "numel": 24320, "steps": 200, "status": "ok", "drift_max_abs": drift,
              "rel_rms_error": 0.01, "stall_rate": 0.5 if reset == "none" else 0.17, "update_cosine": 1.0,
              "update_rel_error": 0.006 if reset == "none" else 0.003} for s in ("m", "v")])


def test_a_reordered_suite_axis_compares_clean(tmp_path):
    """`reset: [none, 20]` against `[20, none]`: the rows were paired by file order (`bf16 v #2`)
    and the gate said "6 regressed, 6 improved", exit 1. The point's reset is now part of the
    row's identity and name."""
    a = _suite_doc("diagnose", [_reset_point("none"), _reset_point(20)])
    b = _suite_doc("diagnose", [_reset_point(20), _reset_point("none")])
    v = compare_docs([a], [b])
    assert {r["status"] for r in v.records} == {"same"} and not v.regressions
    assert {r["name"] for r in v.records} == {"bf16 m reset=none", "bf16 v reset=none", "bf16 m reset=20",
                                              "bf16 v reset=20"}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    r = runner.invoke(app, ["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert r.exit_code == 0 and "no regression (20 same)" in r.stdout
    # a real change at one reset setting is still caught, on its own row
    worse = _reset_point(20)
    worse[1][1]["drift_max_abs"] = 0.01
    regressed = compare_docs([a], [_suite_doc("diagnose", [worse, _reset_point("none")])]).regressions
    assert [(x["name"], x["metric"]) for x in regressed] == [("bf16 v reset=20", "drift_max_abs")]


def test_a_trace_axis_matches_the_same_files_run_from_another_folder():
    """Point params hold the trace resolved against the suite's folder: the same suite run in
    /ci/checkout and in the repo root named every row differently (20 missing, 20 new)."""
    def run_in(folder):
        return _suite_doc("diagnose", [({"trace": f"{folder}/traces/{name}", "config": "bf16"}, rows)
                                       for name, (_, rows) in (("a.pt", _reset_point("none")),
                                                               ("b.pt", _reset_point(20)))])
    v = compare_docs([run_in("/ci/checkout")], [run_in("/home/me/qstate")])
    assert {r["status"] for r in v.records} == {"same"} and not v.regressions
    assert {r["name"] for r in v.records} >= {"bf16 v trace=a.pt", "bf16 v trace=b.pt"}


def test_a_collapsed_axis_still_matches_the_rows_it_kept():
    """NEW ran only `--set reset=none`: its rows match the baseline's reset=none rows (its point
    still names the value), and the reset=20 rows are missing."""
    v = by_name(compare_docs([_suite_doc("diagnose", [_reset_point("none"), _reset_point(20)])],
                             [_suite_doc("diagnose", [_reset_point("none")])]))
    assert v[("bf16 v reset=none", "drift_max_abs")]["status"] == "same"
    assert v[("bf16 v reset=20", "drift_max_abs")]["status"] == "missing"


def test_two_runs_of_one_suite_and_the_train_baseline_of_each_point_are_told_apart():
    """suites/diagnose.yaml replays bf16 in its `configs` run and again in `resets` (two files
    of one side); each train point runs fp32 too, so a config axis makes one fp32 row per point."""
    configs = _suite_doc("diagnose", [_reset_point("none")], run="configs")
    resets = _suite_doc("diagnose", [_reset_point("none"), _reset_point("auto")], run="resets")
    v = compare_docs([configs, resets], [resets, configs])
    assert {r["status"] for r in v.records} == {"same"}
    assert {r["name"] for r in v.records if r["metric"] == "drift_max_abs" and r["name"].startswith("bf16 v")} == {
        "bf16 v reset=none run=configs", "bf16 v reset=none run=resets", "bf16 v reset=auto run=resets"}

    def train_point(config, loss):
        return ({"config": config}, [{"config": c, "seed": 0, "steps": 20, "status": "ok", "diverged": False,
                                      "final_val_loss": x} for c, x in (("fp32", 3.33), (config, loss))])
    a = _suite_doc("train", [train_point("bred-4bit", 3.36), train_point("nearest-4bit", 3.60)])
    b = _suite_doc("train", [train_point("nearest-4bit", 3.60), train_point("bred-4bit", 3.36)])
    v = compare_docs([a], [b])
    assert {r["status"] for r in v.records} == {"same"}
    assert {r["name"] for r in v.records} == {"fp32 seed=0 config=bred-4bit", "fp32 seed=0 config=nearest-4bit",
                                              "bred-4bit seed=0", "nearest-4bit seed=0"}


def test_rows_without_a_suite_are_told_apart_by_their_own_fields():
    """Two plain `bench train` files in one folder, batch sizes 4 and 8: the rows' batch_size."""
    def run(batch, loss):
        return doc("train", [{"config": "bred-4bit", "seed": 0, "steps": 20, "batch_size": batch, "status": "ok",
                              "diverged": False, "final_val_loss": loss}])
    v = compare_docs([run(4, 3.3), run(8, 3.0)], [run(8, 3.0), run(4, 3.3)])
    assert {r["status"] for r in v.records} == {"same"}
    assert {r["name"] for r in v.records} == {"bred-4bit seed=0 batch_size=4", "bred-4bit seed=0 batch_size=8"}


def test_rows_that_nothing_tells_apart_are_refused(tmp_path):
    """The same point twice in one file: pairing them by order would judge one measurement
    against another, so compare refuses (exit 2, one line naming the file)."""
    point = _reset_point("none")
    twice = _suite_doc("diagnose", [point])
    twice["records"] += [dict(r) for r in twice["records"]]
    with pytest.raises(QstateError, match=r"baseline a.json: 2 diagnose rows are each 'bf16 m'"):
        compare_docs([twice], [_suite_doc("diagnose", [point])], baseline_sources=["a.json"], new_sources=["b.json"])
    (tmp_path / "a.json").write_text(json.dumps(twice))
    (tmp_path / "b.json").write_text(json.dumps(_suite_doc("diagnose", [point])))
    r = subprocess.run([sys.executable, "-m", "qstate_cli", "compare", str(tmp_path / "a.json"),
                        str(tmp_path / "b.json")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "nothing in them or their suite points" in r.stderr


def test_the_ci_gate_matches_rows_on_the_kinds_identity_alone():
    """The committed baseline has no rows that share an identity: its rows keep the names (and
    the matching) they had, so it needs no regenerating."""
    v = compare_paths(ROOT / "reports" / "ci-baseline", ROOT / "reports" / "ci-baseline")
    assert v.records and {r["status"] for r in v.records} == {"same"}
    assert not any("=" in r["name"].replace("seed=", "") for r in v.records if r["kind"] == "diagnose")
    assert {r["name"] for r in v.records if r["kind"] == "memory"} == {
        f"{n} small-lm" for n in ("fp32", "bf16", "bnb-8bit", "torchao-8bit", "torchao-4bit", "bred-4bit", "bred-8bit")}
