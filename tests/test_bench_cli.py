"""`qstate bench kernels|memory` end to end on CPU at small sizes: CliRunner and a real
subprocess; the JSON validates against docs/results.md; Ctrl-C keeps finished rows."""
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli import kernels as triton_kernels
from qstate_cli.bench import kernels
from qstate_cli.bench.bytes_model import step_bytes
from qstate_cli.bench.shapes import model_shapes
from qstate_cli.cli import app
from qstate_cli.quant import parse_config

runner = CliRunner()
DOC = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
FAST = ["--warmup-ms", "0", "--rep-ms", "1", "--copy-numel", "4096"]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def contract(kind: str) -> tuple[set[str], set[str]]:
    """Record keys and path values that docs/results.md lists for `kind`."""
    section = DOC.split(f'## kind = "{kind}"')[1].split("\n## ")[0]
    keys = set(re.findall(r"`([a-z_0-9]+)`", section.split("Also")[0]))
    paths = re.search(r"`path` \(([^)]*)\)", section)
    return keys, {p.strip() for p in paths.group(1).replace("\n", " ").split("|")} if paths else set()


def check_document(doc: dict, kind: str) -> list[dict]:
    keys, paths = contract(kind)
    assert doc["schema_version"] == 1 and doc["kind"] == kind
    assert doc["env"]["device"] == "cpu" and doc["env"]["torch"] == torch.__version__ and doc["env"]["argv"]
    assert doc["records"], "no records"
    for row in doc["records"]:
        missing = keys - set(row)
        assert not missing, f"{row['name']}: missing {missing}"
        assert row["device"] == "cpu" and row["path"], row
        assert row["status"] in ("ok", "failed", "unavailable")
        assert (row["reason"] is None) == (row["status"] == "ok"), row
        if paths:
            assert row["path"] in paths, row["path"]
    return doc["records"]


def check_timed(row: dict) -> None:
    assert row["status"] == "ok", row["reason"]
    assert row["time_ms"] > 0 and row["time_ms_min"] <= row["time_ms"] and row["time_ms_iqr"] >= 0
    assert len(row["samples_ms"]) == row["reps"] >= 5 and isinstance(row["noisy"], bool)
    assert row["gbps"] == pytest.approx(row["bytes_moved"] / (row["time_ms"] * 1e-3) / 1e9)
    if row.get("cache_resident"):  # bench/roofline.py: no roofline percentage for a row in cache
        assert row["pct_of_copy"] is None
    else:
        assert row["pct_of_copy"] == pytest.approx(100 * row["gbps"] / row["copy_gbps"])


def test_kernels_cli_json_csv_and_table(tmp_path):
    out, table_csv, model_json = tmp_path / "k.json", tmp_path / "k.csv", tmp_path / "m.json"
    r = runner.invoke(app, ["bench", "kernels", "-n", "4096", "-c", "bred-4bit", "--backend", "reference,triton",
                            "--baseline", "torch-fused", *FAST,
                            "--json", str(out), "--csv", str(table_csv)], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    rows = check_document(json.loads(out.read_text()), "kernels")
    # a model's shapes (the reference path: the interpreter over 29 tensors costs minutes on a CPU;
    # tests/test_kernels_launch.py steps many tensors in one launch)
    m = runner.invoke(app, ["bench", "kernels", "--model", "tiny-lm", "-c", "bred-4bit", "--backend", "reference",
                            "--baseline", "torch-fused", *FAST, "--json", str(model_json)])
    assert m.exit_code == 0, m.output
    model_rows = check_document(json.loads(model_json.read_text()), "kernels")
    assert [(x["name"], x["path"], x["model"]) for x in rows] == [
        ("copy", "copy", None),
        ("bred-4bit", "reference", None), ("bred-4bit", "triton-interpreter", None), ("torch-fused", "torch-fused", None)]
    assert [(x["name"], x["path"], x["model"]) for x in model_rows] == [
        ("copy", "copy", None), ("bred-4bit", "reference", "tiny-lm"), ("torch-fused", "torch-fused", "tiny-lm")]
    rows = rows + model_rows[1:]
    copy = rows[0]
    check_timed(copy)
    assert copy["bytes_moved"] == 8 * 4096 and copy["copy_gbps"] == copy["gbps"]
    for row in (rows[1], rows[3], rows[4], rows[5]):
        check_timed(row)
        assert row["param_dtype"] == row["grad_dtype"] == "fp32"
    for row in (rows[1], rows[3]):
        assert row["copy_gbps"] == copy["gbps"]
    assert rows[1]["bytes_per_elem"] == 14.125 and rows[3]["bytes_per_elem"] == 28.0
    assert rows[1]["config"] == parse_config("bred-4bit").canonical() and rows[1]["rounding"] == "bred"
    shapes = model_shapes("tiny-lm")
    model_row = rows[4]
    assert model_row["numel"] == 136_960 and model_row["n_tensors"] == len(shapes) == 29
    cfg = parse_config("bred-4bit")
    assert model_row["bytes_moved"] == step_bytes([torch.Size(s).numel() for s in shapes], 4, 4,
                                                  lambda n: [cfg.m, cfg.v] if n >= 4096 else [parse_config("fp32").m] * 2)
    for triton_row in (rows[2],):
        if triton_kernels.available("cpu"):
            assert triton_row["status"] == "ok" or "not built" in triton_row["reason"]
        else:
            assert triton_row["status"] == "unavailable" and "TRITON_INTERPRET" in triton_row["reason"]
    with table_csv.open() as fh:
        csv_rows = list(csv.DictReader(fh))
    assert [c["name"] for c in csv_rows] == [x["name"] for x in rows[:4]]  # the first run's rows
    assert json.loads(csv_rows[1]["samples_ms"]) == rows[1]["samples_ms"]
    assert "bred-4bit" in r.stdout and "torch-fused" in r.stdout and "GB/s" in r.stdout
    assert "bred-4bit [reference] 4,096 fp32:" in r.stderr  # one line per row on stderr


def test_kernels_real_subprocess_json_to_stdout():
    out = subprocess.run([sys.executable, "-m", "qstate_cli", "bench", "kernels", "--numel", "2^12",
                          "--rounding", "nearest", "--baseline", "none", *FAST, "--json", "-"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    rows = check_document(json.loads(out.stdout), "kernels")
    assert [x["name"] for x in rows] == ["copy", "nearest-4bit", "torchao-4bit"]  # both round to nearest
    check_timed(rows[1])


def test_memory_cli_accounting_on_cpu(tmp_path):
    out = tmp_path / "m.json"
    r = runner.invoke(app, ["bench", "memory", "--model", "tiny-lm", "--numel", "1e4", "-c", "bred-4bit",
                            "--baseline", "torch-fused", "--backend", "reference", "--json", str(out), "--csv", str(tmp_path / "m.csv")])
    assert r.exit_code == 0, r.output
    rows = {(x["name"], x["model"]): x for x in check_document(json.loads(out.read_text()), "memory")}
    n_tensors = 29
    ours = rows[("bred-4bit", "tiny-lm")]
    # codes + scales as the bytes model counts them, plus 5 int64 counters per tensor
    # (step, since_reset, nonfinite, m.written, v.written)
    assert ours["state_bytes"] - ours["expected_state_bytes"] == 5 * 8 * n_tensors
    torch_row = rows[("torch-fused", "tiny-lm")]
    assert torch_row["expected_state_bytes"] == 8 * torch_row["params"]
    assert torch_row["state_bytes"] == 8 * torch_row["params"] + 4 * n_tensors  # + fp32 step scalars
    single = rows[("bred-4bit", None)]
    # 10000 elements, block 128: 5000 code bytes + 79 scales * 4, per state
    assert single["expected_state_bytes"] == 2 * (5000 + 79 * 4)
    assert single["bytes_per_param"] == pytest.approx((2 * (5000 + 316) + 40) / 10_000)
    # against fp32 states with the same five counters: 80,000 + 40 bytes
    assert single["reduction_vs_fp32"] == pytest.approx(1 - (2 * (5000 + 316) + 40) / 80_040)
    assert torch_row["reduction_vs_fp32"] == 0.0  # fp32 states against fp32 states, counters and all
    for row in rows.values():
        assert row["measured_state_bytes"] is None and row["peak_extra_mib"] is None
        assert "CUDA" in row["measured_reason"]
    assert "bytes/param" in r.stdout


def test_ctrl_c_keeps_finished_rows(tmp_path, monkeypatch):
    real, calls = kernels.measure_group, []

    def interrupt_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(kernels, "measure_group", interrupt_second)
    out, table_csv = tmp_path / "k.json", tmp_path / "k.csv"
    r = runner.invoke(app, ["bench", "kernels", "-n", "4096,8192", "-c", "nearest-4bit", "--baseline", "none",
                            *FAST, "--json", str(out), "--csv", str(table_csv)])
    assert r.exit_code == 130
    assert "interrupted" in r.stderr
    rows = json.loads(out.read_text())["records"]
    assert [(x["name"], x["numel"], x["status"]) for x in rows] == [("copy", 4096, "ok"), ("nearest-4bit", 4096, "ok")]
    assert len(list(csv.DictReader(table_csv.open()))) == 2
    assert "nearest-4bit" in r.stdout  # the finished rows are still shown


def _oom_allocating(monkeypatch, numel: int) -> None:
    """Make the bench engines' tensors of `numel` elements run out of memory (the rows of
    that size fail, the sweep goes on)."""
    from qstate_cli.bench import workset

    real = workset.Tensors

    def tensors(shapes, *args):
        if shapes == [(numel,)]:
            raise RuntimeError("CUDA error: out of memory")
        return real(shapes, *args)

    monkeypatch.setattr(workset, "Tensors", tensors)


@pytest.mark.parametrize("command", ["kernels", "memory"])
def test_a_failed_row_exits_1_once_the_rows_are_written(command, tmp_path, monkeypatch):
    """A bench run whose sweep went on past a failed row exited 0, so a CI step could not tell."""
    _oom_allocating(monkeypatch, 8192)
    out = tmp_path / "b.json"
    extra = FAST if command == "kernels" else ["--backend", "reference"]
    r = runner.invoke(app, ["bench", command, "-n", "4096,8192", "-c", "nearest-4bit", "--baseline", "none",
                            *extra, "--json", str(out)])
    assert r.exit_code == 1, r.output
    rows = json.loads(out.read_text())["records"]
    failed = [x for x in rows if x["status"] == "failed"]
    size = "numel" if command == "kernels" else "params"
    assert [(x["name"], x[size]) for x in failed] == [("nearest-4bit", 8192)]
    assert any(x["status"] == "ok" and x["name"] == "nearest-4bit" for x in rows)
    assert r.stderr.strip().splitlines()[-1] == (
        f"check failed: bench {command}: 1 of {len(rows)} rows failed (nearest-4bit); each row's reason says why, "
        "and the rows that ran are kept")
    assert "nearest-4bit" in r.stdout and f"wrote {out}" in r.stderr  # table shown, file written, then exit 1


@pytest.mark.parametrize("args, message", [
    (["bench", "kernels", "-c", "bred-4bitt"], "did you mean"),
    (["bench", "kernels", "--baseline", "torch-fusd"], "torch-fused"),
    (["bench", "kernels", "--numel", "1.5"], "whole number"),
    (["bench", "kernels", "--bits", "3"], "--bits 3"),
    (["bench", "kernels", "--dtype", "fp64"], "fp64"),
    (["bench", "memory", "--model", "gpt3"], "unknown model"),
])
def test_usage_errors_are_one_line(args, message):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error:") and r.stderr.strip().count("\n") == 0 and message in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda_is_a_usage_error():
    r = runner.invoke(app, ["bench", "kernels", "--device", "cuda"])
    assert r.exit_code == 2 and "CUDA is not available" in r.stderr


def test_a_suites_baseline_point_measures_its_baseline_only(tmp_path):
    """A suite expands `baselines:` into points with `config: []`, which means no
    configuration (kinds.py), not the command's defaults: the baseline point of this memory
    run measured bred-4bit, torchao-4bit, bred-8bit and bnb-8bit again beside torch-fused, and
    the quick suite's kernels run held every 4-bit preset three times per size."""
    from qstate_cli.results import load
    from qstate_cli.suites import load_suite
    from qstate_cli.suites.runner import run_suite

    suite = tmp_path / "s.yaml"
    suite.write_text("kind: memory\ndefaults: {numel: [4096], device: cpu}\naxes:\n  config: [bred-4bit]\n"
                     "baselines: [torch-fused]\n")
    (run,) = run_suite(load_suite(suite), tmp_path / "out")
    assert [r["name"] for r in load(run.path)["records"]] == ["bred-4bit", "torch-fused"]
    r = CliRunner().invoke(app, ["bench", "memory", "--device", "cpu", "--numel", "4096", "-c", "none",
                                 "--baseline", "none"])
    assert r.exit_code == 2 and "nothing to measure" in r.output


def test_a_cpu_backend_row_says_cpu_numba_whether_or_not_it_ran(tmp_path):
    """Without numba a --backend cpu row is unavailable and was labelled triton-interpreter."""
    out = tmp_path / "k.json"
    r = runner.invoke(app, ["bench", "kernels", "--device", "cpu", "-c", "nearest-4bit", "--backend", "cpu",
                            "--numel", "4096", "--baseline", "none", "--rep-ms", "5", "--json", str(out)])
    assert r.exit_code in (0, 1), r.output
    row = next(x for x in json.loads(out.read_text())["records"] if x["name"] == "nearest-4bit")
    assert row["path"] == "cpu-numba"
    assert row["status"] == "ok" or "needs numba" in row["reason"]


def test_state_bytes_count_a_shared_counter_for_every_parameter_and_a_shared_table_once():
    """The fused CPU path shares one step counter per group, so bench memory (each storage
    once) read 978,360 bytes for bred-4bit on small-lm with numba and 978,968 without: the
    CI gate's bytes depended on an optional package. A one-element tensor now counts where
    each parameter holds it; a shared code book (bitsandbytes) still counts once."""
    from qstate_cli.bench.memory import optimizer_state_bytes

    class Opt:
        pass

    step, book = torch.zeros((), dtype=torch.int64), torch.zeros(256)
    opt = Opt()
    opt.state = {0: {"step": step, "codes": torch.zeros(100, dtype=torch.uint8), "book": book},
                 1: {"step": step, "codes": torch.zeros(50, dtype=torch.uint8), "book": book}}
    assert optimizer_state_bytes(opt) == 2 * 8 + 150 + 256 * 4


def test_the_env_block_says_the_threads_the_rows_ran_with(tmp_path):
    """--threads 1 was stored in the options while env.torch_threads (and the header) said the
    process's count."""
    out = tmp_path / "k.json"
    r = runner.invoke(app, ["bench", "kernels", "--device", "cpu", "-c", "nearest-4bit", "--numel", "4096",
                            "--baseline", "none", "--rep-ms", "5", "--threads", "1", "--json", str(out)])
    assert r.exit_code in (0, 1), r.output
    assert json.loads(out.read_text())["env"]["torch_threads"] == 1 and "torch threads 1" in r.output


def test_a_baselines_failed_row_does_not_fail_the_run():
    """torch's fp32 AdamW out of memory where a 4-bit state fits is what such a sweep shows:
    only a failed row of ours (or one without a role: bench train) exits 1."""
    from qstate_cli.cli.output import exit_on_failed_rows
    from qstate_cli.errors import CheckFailed

    rows = [{"name": "torch-fused", "role": "baseline", "status": "failed", "reason": "out of memory"},
            {"name": "bred-4bit", "role": "config", "status": "ok"}, {"name": "bnb-8bit", "status": "unavailable"}]
    exit_on_failed_rows({"records": rows}, "bench memory")
    rows[1]["status"] = "failed"
    with pytest.raises(CheckFailed, match=r"bench memory: 1 of 3 rows failed \(bred-4bit\)"):
        exit_on_failed_rows({"records": rows}, "bench memory")
