"""`qstate compare` as a CI gate, from what probes found: rows that printed one name, a
verdict too long for a PR comment, results edited so that a 3x regression passed (a
baseline row that did not run, a `role: copy`, a null beside a NaN, a key twice in a
file), rows that moved to another code path without a word, and an opening that buried
what decides under the timing rule."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.compare import compare_docs, compare_paths, verdict_markdown
from qstate_cli.compare.markdown import LIMIT
from qstate_cli.errors import QstateError
from qstate_cli.results import load

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "reports" / "corpus" / "diagnose.json"
QUICK = ROOT / "reports" / "quick"
CI_MEMORY = ROOT / "reports" / "ci-baseline" / "memory.json"
runner = CliRunner()


def doc(kind, records, env=None):
    return {"schema_version": 1, "kind": kind, "env": env or {}, "meta": {}, "records": records}


def write(path: Path, document) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    return path


def bumped_corpus(tmp_path) -> Path:
    """The corpus with drift 3x (at least 1e-2 more) in every 4th row: 34 regressions over
    17 configurations, each on two of the 4 traces, which differ only in numel."""
    corpus = load(CORPUS)
    for row in corpus["records"][::4]:
        row["drift_max_abs"] = row["drift_max_abs"] * 3 + 0.01
    return write(tmp_path / "new" / "diagnose.json", corpus)


def memory_pair(edit_base=None, edit_new=None):
    """The CI baseline's memory rows, NEW 3x worse in every row, each side edited."""
    base, new = load(CI_MEMORY), load(CI_MEMORY)
    for row in new["records"]:
        row["bytes_per_param"] *= 3
    for document, edit in ((base, edit_base), (new, edit_new)):
        for row in document["records"]:
            if edit:
                edit(row)
    return base, new


# -- 1. no two rows of a verdict share a name ---------------------------------------------------

def test_every_row_of_a_verdict_has_its_own_name(tmp_path):
    """`diagnose: bf16 m` was printed 22 times, two regressed rows had one name, and the
    exit line named 17 rows for 34 regressions: the corpus traces differ in numel only."""
    v = compare_paths(CORPUS, bumped_corpus(tmp_path))
    assert len(v.records) == 680 and len(v.regressions) == 34
    assert len({(r["name"], r["metric"]) for r in v.records}) == len(v.records)
    assert len({r["name"] for r in v.regressions}) == 34
    assert {r["name"] for r in v.regressions if r["name"].startswith("bf16 m")} == {"bf16 m numel=7562",
                                                                                  "bf16 m numel=8192"}
    r = runner.invoke(app, ["compare", str(CORPUS), str(tmp_path / "new")])
    assert r.exit_code == 1
    named = r.stderr.strip().split(": ", 2)[2].split("; ")
    assert len(named) == 6 and len(set(named)) == 6 and named[-1] == "and 29 more", r.stderr


def test_rows_that_never_share_a_name_keep_the_short_one():
    """Only colliding names grow: a benchmark series keeps its name across runs."""
    rows = [{"config": "c", "state": s, "numel": 10, "steps": 5, "drift_max_abs": 0.1} for s in "mv"]
    v = compare_docs([doc("diagnose", rows)], [doc("diagnose", rows)])
    assert {r["name"] for r in v.records} == {"c m", "c v"}


# -- 2. the Markdown fits a PR comment ------------------------------------------------------------

def test_a_big_verdict_stays_under_the_comment_limit_and_lists_every_regression(tmp_path):
    """The corpus verdict was 69,314 characters: GitHub refuses a comment over 65,536."""
    v = compare_paths(CORPUS, bumped_corpus(tmp_path))
    md = verdict_markdown(v)
    assert len(md) <= LIMIT < 65_536
    assert all(f"| **regressed** | `diagnose: {r['name']}` | {r['metric']} |" in md for r in v.regressions)
    assert "| same |" not in md and "646 `same` rows left out" in md and "--results FILE" in md
    small = compare_paths(CORPUS, CORPUS)
    assert "<details><summary>All verdicts (680 rows)</summary>" not in verdict_markdown(small)  # 680 same
    assert "<details><summary>All verdicts (85 rows)</summary>" in verdict_markdown(compare_paths(QUICK, QUICK))


def test_regressions_past_the_limit_are_counted_not_cut_off_mid_table(tmp_path):
    v = compare_paths(CORPUS, bumped_corpus(tmp_path))
    md = verdict_markdown(v, limit=3000)
    assert len(md) <= 3000 and md.rstrip().endswith("._")
    shown = md.count("| **regressed** |")
    assert 0 < shown < 34 and f"{34 - shown} of 34 regressions left out too (the first {shown} shown)" in md


# -- 3. results edited so that a 3x regression passed ---------------------------------------------

@pytest.mark.parametrize("status", ["skipped", "failed", "unavailable"])
def test_a_baseline_row_that_did_not_run_cannot_judge_new(tmp_path, status):
    base, new = memory_pair(lambda r: r.update(status=status))
    r = runner.invoke(app, ["compare", str(write(tmp_path / "b.json", base)), str(write(tmp_path / "n.json", new))])
    assert r.exit_code == 1 and r.stdout.startswith("### qstate compare: regression (7 unjudged)"), r.output
    v = compare_docs([base], [new])
    assert all(x["status"] == "unjudged" and x["regression"] for x in v.records)
    assert f"baseline row {status} while NEW's ran" in v.records[0]["why"]
    assert any("regenerate the baseline" in n for n in v.notes)


def test_rows_that_ran_on_neither_side_stay_no_regression_beside_a_compared_one():
    base, new = memory_pair(lambda r: r.update(status="unavailable"), lambda r: r.update(status="unavailable"))
    for document in (base, new):
        document["records"].append({"name": "fp32", "model": "tiny", "status": "ok", "bytes_per_param": 16.0})
    v = compare_docs([base], [new])
    assert not v.regressions and {x["status"] for x in v.records} == {"missing", "same"}


def test_a_copy_role_outside_a_kernels_copy_row_is_an_input_error(tmp_path):
    base, new = memory_pair(lambda r: r.update(role="copy"))
    r = runner.invoke(app, ["compare", str(write(tmp_path / "b.json", base)), str(write(tmp_path / "n.json", new))])
    assert r.exit_code == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(f"error: baseline {tmp_path / 'b.json'}: records[0] (") and "role 'copy'" in r.stderr
    kernels = load(QUICK / "kernels.json")
    subject = next(i for i, row in enumerate(kernels["records"]) if row.get("role") != "copy")
    kernels["records"][subject]["role"] = "copy"
    with pytest.raises(QstateError, match=r"records\[\d+\] .*a copy row is the copy reference, path 'copy'"):
        compare_docs([kernels], [load(QUICK / "kernels.json")])


def test_a_kernels_row_whose_role_differs_between_the_runs_is_unjudged():
    base, new = load(QUICK / "kernels.json"), load(QUICK / "kernels.json")
    copy_row = next(row for row in new["records"] if row.get("role") == "copy")
    copy_row["role"] = "config"  # judged as a subject in NEW, the reference in the baseline
    subject = next(row for row in new["records"] if row.get("role") == "config" and row is not copy_row)
    subject["role"] = "baseline"
    v = compare_docs([base], [new])
    odd = [x for x in v.records if x["status"] == "unjudged"]
    assert len(odd) == 2 and all(x["regression"] for x in odd) and v.regressions == odd
    assert {x["why"].split(":")[0] for x in odd} == {"role copy in the baseline, config in NEW",
                                                     "role config in the baseline, baseline in NEW"}


def test_a_null_baseline_metric_beside_a_nan_is_unjudged_not_skipped(tmp_path):
    base, new = memory_pair(lambda r: r.update(bytes_per_param=None), lambda r: r.update(bytes_per_param=float("nan")))
    r = runner.invoke(app, ["compare", str(write(tmp_path / "b.json", base)), str(write(tmp_path / "n.json", new))])
    assert r.exit_code == 1 and "no regression" not in r.stdout
    v = compare_docs([base], [new])
    assert all(x["status"] == "unjudged" and x["regression"] for x in v.records) and len(v.records) == 7
    assert "missing or not finite in the baseline and in NEW" in v.records[0]["why"]


def test_a_comparison_that_compared_nothing_fails(tmp_path):
    """A kernels file of its copy row alone (nothing to judge) passed as "no regression"."""
    kernels = load(QUICK / "kernels.json")
    kernels["records"] = [row for row in kernels["records"] if row.get("role") == "copy"]
    path = write(tmp_path / "k.json", kernels)
    r = runner.invoke(app, ["compare", str(path), str(path)])
    assert r.exit_code == 1 and r.stderr.strip() == "check failed: 1 regression(s): kernels: nothing compared"
    assert "- no kernels row was compared on both sides (no row to compare)" in r.stdout


def test_train_runs_that_diverged_on_both_sides_are_judged_by_diverged():
    rows = [{"config": "fp8", "seed": 0, "final_val_loss": None, "diverged": True, "status": "ok"},
            {"config": "bf16", "seed": 0, "final_val_loss": 2.4, "diverged": False, "status": "ok"}]
    v = compare_docs([doc("train", rows)], [doc("train", copy.deepcopy(rows))])
    assert not v.regressions and [(x["name"], x["metric"]) for x in v.records if x["name"].startswith("fp8")] == [
        ("fp8 seed=0", "diverged")]


@pytest.mark.parametrize("where", ["top", "row"])
def test_a_key_twice_in_a_results_file_is_refused(tmp_path, where):
    """json keeps the last "records": the file a reviewer reads and the one compared differ."""
    base = load(CI_MEMORY)
    text = json.dumps(base)
    if where == "top":
        lax = [{**row, "bytes_per_param": 100.0} for row in base["records"]]
        text, key = text[:-1] + ', "records": ' + json.dumps(lax) + "}", "records"
    else:
        text, key = text.replace('"bytes_per_param": ', '"bytes_per_param": 100.0, "bytes_per_param": ', 1), \
            "bytes_per_param"
    (tmp_path / "b.json").write_text(text)
    r = runner.invoke(app, ["compare", str(tmp_path / "b.json"), str(CI_MEMORY)])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == (f"error: {tmp_path / 'b.json'}: not a results file: key '{key}' appears twice in "
                                "one object")


# -- 5. rows that moved to another code path ------------------------------------------------------

def test_rows_on_another_code_path_say_so_and_what_numba_was():
    base, new = load(QUICK / "kernels.json"), load(QUICK / "kernels.json")
    base["env"]["numba"], new["env"]["numba"] = "0.60.0", None
    moved = [row for row in new["records"] if row.get("path") == "cpu-numba"]
    for row in moved:
        row["path"] = "reference"
    v = compare_docs([base], [new])
    missing = [x for x in v.records if x["status"] == "missing"]
    assert len(missing) == len(moved) == 6 and all(x["regression"] for x in missing)  # still no pass
    nearest = next(x for x in missing if x["name"].startswith("nearest-4bit"))
    assert ("NEW ran nearest-4bit on [reference], the baseline on [cpu-numba]: numba missing in NEW?"
            in nearest["why"])
    assert all("the baseline on [cpu-numba]" in x["why"] for x in v.records if x["status"] == "new")
    note = next(n for n in v.notes if "another code path" in n)
    assert note.startswith("6 kernels rows ran on another code path, [cpu-numba] in the baseline and [reference] "
                           "in NEW (numba missing in NEW?)") and note.endswith("env.numba: baseline 0.60.0, NEW null")
    back = compare_docs([new], [base])  # the other way: NEW ran the fused path (the note lost env.numba once)
    note = next(n for n in back.notes if "another code path" in n)
    assert note.startswith("6 kernels rows ran on another code path, [reference] in the baseline and [cpu-numba] "
                           "in NEW (numba missing in the baseline?)")
    assert note.endswith("env.numba: baseline null, NEW 0.60.0")


def test_the_env_block_records_numba_without_importing_it():
    code = ("import sys; from qstate_cli.results import environment; e = environment(); "
            "print(repr(e['numba']), 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get(
                             "PYTHONPATH"))))})  # this process's path kept: numba beside .venv (make test-cpu-path)
    from importlib.metadata import PackageNotFoundError, version

    try:
        expected = version("numba")
    except PackageNotFoundError:
        expected = None
    assert out.stdout.split() == [repr(expected), "False"], out.stderr


# -- 7. the opening says what decides first -------------------------------------------------------

def test_the_opening_puts_the_notes_first_and_folds_the_timing_rule(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base, new = load(QUICK / "kernels.json"), load(QUICK / "kernels.json")
    new["records"] = [row for row in new["records"] if row.get("path") != "cpu-numba"]
    v = compare_docs([base], [new], baseline_sources=[str(tmp_path / "ci" / "kernels.json")],
                     new_sources=["/elsewhere/kernels.json"])
    lines = verdict_markdown(v).splitlines()
    assert lines[0].startswith("### qstate compare: regression") and lines[1] == ""
    assert lines[2].startswith("- ") and any("missing" in n or "timing" in n for n in v.notes)
    files = next(i for i, line in enumerate(lines) if line.startswith("Baseline "))
    assert all(line.startswith("- ") or line == "" for line in lines[2:files])
    assert lines[files] == "Baseline ci/kernels.json; new /elsewhere/kernels.json."
    assert lines[files + 2] == "<details><summary>How timing was judged</summary>"
    assert lines[files + 4].startswith("Timing regresses when the ratio") and lines[files + 6] == "</details>"
