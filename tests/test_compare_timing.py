"""`qstate compare`'s timing verdicts against what an A/A probe (the same code benched 8
times on a shared 2-core runner, every pair compared) found: `same` claimed where the row
could not resolve the threshold, false regressions from a moving copy reference, p and
--alpha for rows judged by rounds, no word on the false regressions many rows add up to,
rows without rounds, runs on other machines or settings, and row names that grep missed.
Each test builds two results documents with chosen rounds, ratios and env blocks."""
import html
import math
import random
import re
from statistics import median

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.compare import code_span, compare_docs, verdict_markdown
from qstate_cli.compare.ab import ABOptions, verdict as ab_verdict
from qstate_cli.compare.noise import judge_paired, rank_p, sign_p

runner = CliRunner()
ENV = {"device": "cpu", "device_name": "AMD EPYC", "cpu_count": 2, "torch_threads": 2, "cpu_isa": "AVX512",
       "torch": "2.13.0+cpu", "triton": "3.6.0", "python": "3.11.7", "git_sha": "0123456789ab"}
META = {"warmup_ms": 10.0, "rep_ms": 100.0, "rounds": 3, "copy_numel": 65536}


def krow(name, round_ms, copy_ms=None, numel=65536, share=1.0, device="cpu"):
    """A kernels row timed in rounds (samples: its rounds); with copy_ms, the same-run copy
    reference of each round, so time_rel_copy and rel_copy_rounds."""
    row = {"name": name, "path": "reference", "param_dtype": "fp32", "numel": numel, "device": device,
           "status": "ok", "time_ms": median(round_ms), "samples_ms": list(round_ms), "round_ms": list(round_ms),
           "rounds": len(round_ms), "cpu_share": share}
    if copy_ms:
        row.update(ref_copy_ms=median(copy_ms), time_rel_copy=median(round_ms) / median(copy_ms),
                   rel_copy_rounds=[t / c for t, c in zip(round_ms, copy_ms)])
    return row


def kdoc(rows, env=None, meta=None):
    return {"schema_version": 1, "kind": "kernels", "env": {**ENV, **(env or {})}, "meta": {**META, **(meta or {})},
            "records": rows}


def one(base_row, new_row, **kw):
    v = compare_docs([kdoc([base_row])], [kdoc([new_row])], **kw)
    assert len(v.records) == 1
    return v, v.records[0]


# -- 1. `same` only where the row could resolve the threshold ----------------------------------

def test_a_row_that_moves_more_than_the_threshold_within_a_run_is_not_same():
    """A/A: `ratio 0.967 floor 2.462 why: within the threshold 1.1` was `same`."""
    v, rec = one(krow("k", [1.0, 1.0, 2.462]), krow("k", [0.967, 0.97, 0.96]))
    assert rec["ratio"] == pytest.approx(0.967) and rec["noise_floor"] == pytest.approx(2.462)
    assert rec["status"] == "insignificant" and not rec["regression"] and not v.regressions
    assert rec["why"] == ("within the threshold 1.1, but this row moves by up to 2.46x within one run: a change "
                          "below that cannot be seen")
    _, tight = one(krow("k", [1.0, 1.01, 0.99]), krow("k", [0.967, 0.97, 0.96]))  # floor 1.02: it can tell
    assert tight["status"] == "same" and tight["why"] == "within the threshold 1.1"
    paired = judge_paired([10] * 5, [10.2, 10.1, 9.6, 13.0, 10.0], 1.10, 1.0)  # median 1.01, floor 1.34
    assert paired["status"] == "insignificant" and "moves by up to 1.34x within one run" in paired["why"]
    assert judge_paired([10] * 5, [10.2, 10.1, 9.9, 10.3, 10.0], 1.10, 1.0)["status"] == "same"


def test_quality_rows_stay_same_whatever_the_timing_rule():
    """Item 1 is for timing rows: the CI gate's quality rows compare `same` against themselves."""
    from pathlib import Path

    base = Path(__file__).resolve().parents[1] / "reports" / "ci-baseline"
    r = runner.invoke(app, ["compare", str(base), str(base)])
    assert r.exit_code == 0 and r.stdout.startswith("### qstate compare: no regression (77 same)\n"), r.stdout[:200]


# -- 2. a change relative to the copy must be a change in time too --------------------------------

def test_a_copy_reference_that_moved_cannot_make_a_regression_alone():
    """A/A: `ratio 1.385 raw 0.992 floor 1.020 -> regressed`: the 3-7 us copy moved 1.4x."""
    base = krow("k", [10.0, 10.05, 9.95], copy_ms=[1.0, 1.0, 1.0])
    new = krow("k", [9.92, 9.95, 9.90], copy_ms=[0.716] * 3)  # the code ran as fast; the copy got 1.4x faster
    _, rec = one(base, new)
    assert rec["basis"] == "time_rel_copy" and rec["ratio"] == pytest.approx(1.385, abs=1e-3)
    assert rec["raw_ratio"] == pytest.approx(0.992) and rec["noise_floor"] < 1.1
    assert rec["status"] == "insignificant" and not rec["regression"]
    assert rec["why"] == ("slower relative to its copy (1.385x) but not in time (raw 0.992x): the copy reference "
                          "moved between the runs")
    _, faster = one(new, base)  # the mirror: faster relative to the copy, slower in time
    assert faster["status"] == "insignificant" and faster["why"].startswith("faster relative to its copy (0.7218x) "
                                                                            "but not in time (raw 1.008x)")
    _, real = one(base, krow("k", [10.5, 10.55, 10.45], copy_ms=[0.716] * 3))  # slower both ways: it stands
    assert real["status"] == "regressed" and real["raw_ratio"] > 1 and real["regression"]


# -- 3. the p of rows judged by rounds, and what --alpha does -------------------------------------

@pytest.mark.parametrize("rb, rn", [(3, 3), (5, 5), (5, 3), (2, 4)])
def test_rounds_rows_report_the_exact_p_of_their_separation(rb, rn):
    base = krow("k", [10 + 0.01 * i for i in range(rb)])
    new = krow("k", [13 + 0.01 * i for i in range(rn)])
    _, rec = one(base, new)
    assert rec["status"] == "regressed" and rec["p_value"] == pytest.approx(1 / math.comb(rb + rn, rb))
    assert rec["rounds"] == [rb, rn] and rec["test"] == "rounds"
    assert f"rounds apart ({rn} vs {rb}, p = {1 / math.comb(rb + rn, rb):.2g} one-sided)" in rec["why"]
    for alpha in (0.001, 0.5):  # --alpha plays no part in a row judged by rounds
        assert one(base, new, alpha=alpha)[1]["status"] == "regressed"


def test_overlapping_rounds_report_the_exact_rank_sum_p():
    _, rec = one(krow("k", [10.0, 10.2, 10.4]), krow("k", [10.3, 12.0, 12.5]))  # one NEW round below one base round
    assert rec["status"] == "insignificant" and rec["p_value"] == pytest.approx(2 / 20)  # U = 8 of 9: 2 orders
    assert rec["why"] == "rounds overlap (p = 0.1 one-sided)"
    assert rank_p([1.0, 2.0], [1.5, 2.5], True) == pytest.approx(2 / 6)  # U 3 of 4: orders with U >= 3


def test_the_alpha_help_says_which_rows_it_applies_to():
    r = runner.invoke(app, ["compare", "--help"], env={"COLUMNS": "300"})
    text = " ".join(r.stdout.split())
    assert "rows without rounds only" in text and "1/C(2R, R)" in text and "sign test" in text


def _ab_rows(base_rounds, new_rounds):
    def row(name, rounds):
        return {"name": name, "path": "reference", "param_dtype": "fp32", "numel": 65536, "device": "cpu",
                "status": "ok", "time_ms": median(rounds), "round_ms": rounds, "cpu_share": 1.0}
    return [{"name": "copy", "role": "copy", "status": "ok"}, row("nearest-4bit", base_rounds),
            row("sr-4bit", new_rounds)]


def test_ab_reports_the_one_sided_sign_test_and_no_alpha():
    opts = ABOptions(base="nearest-4bit", new="sr-4bit", rounds=5)
    v = ab_verdict(_ab_rows([10.0] * 5, [15.0, 15.5, 14.8, 15.2, 15.1]), opts, 1.10)
    rec = v.records[0]
    assert rec["status"] == "regressed" and rec["p_value"] == pytest.approx(1 / 32)
    assert "all 5 paired rounds slower (sign test p = 0.031 one-sided)" in rec["why"]
    meta = v.document()["meta"]
    assert "alpha" not in meta and "one-sided sign test of the 5 paired round ratios" in meta["timing_test"]
    assert ("1 timing row judged by all 5 paired rounds of one sign, with a 1-in-32 chance of calling identical code "
            "slower: about 0.031 false regressions expected between identical code if the machine keeps its speed from run to run (more where it drifts); --rounds 8 makes it 1 in 256 "
            "a row") in v.notes
    assert "A/B in one process: 5 paired rounds per size; cpu share 1.00" in v.notes
    files = compare_docs([kdoc([krow("k", [1.0, 1.01, 0.99])])], [kdoc([krow("k", [1.0, 1.01, 0.99])])])
    assert files.document()["meta"]["alpha"] == 0.01 and "rank test" in files.document()["meta"]["timing_test"]


# -- 4. the false regressions to expect over many rows ---------------------------------------------

def _aa(n, rounds=3, names=None, base_rounds=None):
    """n rows of identical code (every ratio ~1) with `rounds` rounds per side."""
    names = names or [f"k{i}" for i in range(n)]
    rb = base_rounds or rounds
    base = kdoc([krow(x, [1.0 + 0.001 * i for i in range(rb)]) for x in names])
    new = kdoc([krow(x, [1.0005 + 0.001 * i for i in range(rounds)]) for x in names])
    return base, new


def test_the_notes_give_the_false_regressions_expected_between_identical_code():
    v = compare_docs(*map(lambda d: [d], _aa(15)))
    assert {r["status"] for r in v.records} == {"same"}
    assert v.notes == ["15 timing rows judged by separation of 3 rounds, each with a 1-in-20 chance of calling "
                       "identical code slower: about 0.75 false regressions expected between identical code if the machine keeps its speed from run to run (more where it drifts); "
                       "--rounds 5 makes it 1 in 252 a row"]
    assert v.document()["meta"]["notes"] == v.notes
    assert "- 15 timing rows judged by separation of 3 rounds" in verdict_markdown(v)
    five = compare_docs(*map(lambda d: [d], _aa(60, rounds=5)))
    assert five.notes == ["60 timing rows judged by separation of 5 rounds, each with a 1-in-252 chance of calling "
                          "identical code slower: about 0.24 false regressions expected between identical code if the machine keeps its speed from run to run (more where it drifts)"]
    mixed = compare_docs(*map(lambda d: [d], _aa(4, rounds=3, base_rounds=5)))
    assert mixed.notes[0].startswith("4 timing rows judged by separation of 5 vs 3 rounds, each with a 1-in-56 ")
    noisy = [dict(r, cpu_share=0.3) for r in _aa(3)[1]["records"]]  # not judged: nothing to expect
    v = compare_docs([_aa(3)[0]], [kdoc(noisy)])
    assert {r["status"] for r in v.records} == {"noisy"} and not any("false regression" in n for n in v.notes)


# -- 5. rows without rounds -------------------------------------------------------------------------

def test_rows_without_rounds_are_judged_as_before_and_counted_in_a_note():
    base = kdoc([krow("a", [1.0]), krow("b", [1.0])])
    for r in base["records"]:
        r["samples_ms"] = [1.00, 1.01, 0.99, 1.02, 1.00, 0.98, 1.03]
    new = kdoc([dict(r, samples_ms=[x * 1.3 for x in r["samples_ms"]], time_ms=1.3, round_ms=[1.3])
                for r in base["records"]])
    v = compare_docs([base], [new])
    assert {r["status"] for r in v.records} == {"regressed"}  # Mann-Whitney on samples: the old rule
    assert all(r["test"] == "samples" and "Mann-Whitney p" in r["why"] for r in v.records)
    assert v.notes == ["2 timing rows without rounds (older files, or `bench kernels --rounds 1`) judged by "
                       "Mann-Whitney on samples_ms taken as independent draws, which a shared or drifting machine "
                       "breaks: bench with --rounds 3 or more"]


@pytest.mark.parametrize("rounds, warned", [(1, True), (2, False)])
def test_bench_kernels_with_one_round_warns_once(rounds, warned, tmp_path):
    r = runner.invoke(app, ["bench", "kernels", "-c", "nearest-4bit", "--baseline", "none", "-n", "4096",
                            "--rounds", str(rounds), "--rep-ms", "5", "--warmup-ms", "1", "--copy-numel", "4096",
                            "--backend", "reference", "--threads", "1", "--json", str(tmp_path / "k.json")])
    assert r.exit_code == 0, r.output
    lines = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert lines == ([f"warning: --rounds 1: compare can then only test the samples as independent draws, which a "
                      "shared or drifting machine breaks (use --rounds 3 or more)"] if warned else [])


# -- 6. runs that differ in what sets their times ---------------------------------------------------

@pytest.mark.parametrize("env, meta, note", [
    ({"device_name": "Intel Xeon"}, {}, "BASELINE was timed on cpu (AMD EPYC), NEW on cpu (Intel Xeon): timing "
                                        "ratios compare machines, not code"),
    ({"torch": "2.11.0"}, {}, "BASELINE was timed with torch 2.13.0+cpu, NEW with torch 2.11.0: timing ratios "
                              "measure that change too, not the code alone"),
    ({"torch_threads": 16}, {}, "BASELINE ran torch on 2 threads, NEW on 16: timing ratios compare thread counts, "
                                "not code"),
    ({}, {"rep_ms": 200.0}, "BASELINE was benched with rep_ms 100, NEW with rep_ms 200: timing ratios measure the "
                            "bench settings too, not the code alone"),
])
def test_a_difference_between_the_runs_that_changes_times_is_noted(env, meta, note):
    rows = [krow("k", [1.0, 1.01, 0.99])]
    v = compare_docs([kdoc(rows)], [kdoc(rows, env, meta)])
    assert v.records[0]["status"] == "same" and not v.regressions  # no exit code change
    assert note in v.notes and len([n for n in v.notes if n.startswith("BASELINE")]) == 1
    same = compare_docs([kdoc(rows)], [kdoc(rows, {"git_sha": "fedcba987654", "created": "later"})])
    assert not any(n.startswith("BASELINE") for n in same.notes)  # another commit is the point of a compare


def test_a_cuda_baseline_against_a_cpu_run_says_why_nothing_matches():
    base = kdoc([krow("k", [1.0, 1.01, 0.99], device="cuda")], {"device": "cuda", "device_name": "NVIDIA H100"})
    v = compare_docs([base], [kdoc([krow("k", [1.0, 1.01, 0.99])])])
    assert [r["status"] for r in v.records] == ["missing", "new"] and v.regressions  # as before: exit 1
    assert v.records[0]["why"] == ("not in NEW; NEW has no cuda rows (it ran on cpu): rows match by device")
    assert ("BASELINE was timed on cuda (NVIDIA H100), NEW on cpu (AMD EPYC): timing ratios compare machines, "
            "not code") in v.notes


# -- 7. row names greppable, and still no mention ----------------------------------------------------

def test_row_names_are_code_spans_that_grep_finds():
    v = compare_docs(*map(lambda d: [d], _aa(1)))
    md = verdict_markdown(v)
    assert "| same | `kernels: k0 [reference] fp32 n=65536 @cpu` | time_ms |" in md and "\u2060" not in md


@pytest.mark.parametrize("name, span", [
    ("a`b", "``a`b``"), ("`x", "`` `x ``"), ("x``", "``` x`` ```"), ("p|q", "`p\\|q`"), ("a\nb", "`a b`"),
])
def test_a_code_span_holds_any_name(name, span):
    from markdown_it import MarkdownIt

    assert code_span(name) == span
    if "|" not in name:  # markdown-it keeps the table's \| inside a code span; GitHub's GFM unescapes it
        page = MarkdownIt("commonmark").render(span)
        assert f"<code>{html.escape(name.replace(chr(10), ' '), quote=False)}</code>" in page


def test_a_pipe_in_a_row_name_stays_in_its_cell():
    base, new = _aa(1, names=["evil | @octocat"])
    md = verdict_markdown(compare_docs([base], [new]))
    head = next(line for line in md.splitlines() if line.startswith("| status |"))
    row = next(line for line in md.splitlines() if "octocat" in line)
    cells = re.split(r"(?<!\\)\|", row)[1:-1]  # GFM splits a row at the pipes not escaped
    assert len(cells) == head.count("|") - 1 == 11
    assert cells[1].strip() == "`kernels: evil \\| @octocat [reference] fp32 n=65536 @cpu`"


def test_rank_p_counts_exactly_up_to_a_bound_then_takes_the_normal_approximation():
    """A results file's rounds are not bounded: counted exactly, 1000 rounds a side cost about
    two minutes a row; past EXACT_MAX (Rb * Rn) the p is scipy's asymptotic one."""
    from scipy.stats import mannwhitneyu

    from qstate_cli.compare.noise import EXACT_MAX

    rng = random.Random(7)
    small_b, small_n = [rng.random() for _ in range(6)], [rng.random() + 0.3 for _ in range(7)]
    exact = mannwhitneyu(small_n, small_b, alternative="greater", method="exact").pvalue
    assert rank_p(small_b, small_n, True) == pytest.approx(exact, abs=1e-12)
    big = int(EXACT_MAX ** 0.5) + 1
    big_b, big_n = [rng.random() for _ in range(big)], [rng.random() + 0.05 for _ in range(big)]
    approx = mannwhitneyu(big_n, big_b, alternative="greater", method="asymptotic").pvalue
    assert rank_p(big_b, big_n, True) == pytest.approx(approx, rel=1e-9)


def test_sign_p_drops_ties_as_the_sign_test_does():
    from scipy.stats import binomtest

    q = [1.0, 1.1, 1.2]  # one tie, two slower: the test of 2 of 2
    assert sign_p(q, True) == pytest.approx(binomtest(2, 2, alternative="greater").pvalue)
    assert sign_p([1.0, 1.0], True) == 1.0
