"""`qstate bench train`: determinism, parity with torch.optim.AdamW, divergence handling,
reset policies, the suite hook, and the CLI (CliRunner and a real subprocess)."""
import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from qstate_cli.cli import app
from qstate_cli.errors import QstateError
from qstate_cli.models import tiny_lm
from qstate_cli.quant.config import parse_spec
from qstate_cli.results import load
from qstate_cli.theory import reset_period
from qstate_cli.train.runspec import RunSpec, resolve_reset
from qstate_cli.train.study import TrainSettings, lr_at, parse_runs, run_study, train_run
from qstate_cli.suites import hook_for

# The kind="train" contract (docs/results.md).
RECORD_KEYS = {"config", "optimizer", "model", "seed", "steps", "final_val_loss", "best_val_loss", "gap_to_fp32",
               "diverged", "diverged_at_step", "steps_per_s", "state_bytes", "bytes_per_param", "reset", "status"}
SERIES_KEYS = {"config", "seed", "step", "train_loss", "val_loss"}

FAST = TrainSettings(steps=12, batch_size=4, eval_every=4, eval_batches=2, eval_batch_size=8, device="cpu")


def train_point(params):
    """A suite point of kind train (what `qstate run` calls)."""
    return hook_for("train")(params)


def losses(result):
    return [(r["step"], r["train_loss"], r["val_loss"]) for r in result.series]


@pytest.mark.parametrize("config", ["bred-4bit", "sr-4bit@reset=5"])
def test_same_seed_same_config_gives_bit_identical_losses(config):
    run = RunSpec.parse(config)
    a, b = train_run(run, FAST, seed=3), train_run(run, FAST, seed=3)
    assert losses(a) == losses(b)  # exact float equality, every step
    assert a.record["state_bytes"] == b.record["state_bytes"]
    other = train_run(run, FAST, seed=4)  # and the seed matters (init, data, random streams)
    assert losses(other) != losses(a)


def test_fp32_states_train_exactly_like_torch_adamw():
    """A plain training loop written here with torch.optim.AdamW, against the study's fp32 run."""
    s = TrainSettings(steps=20, batch_size=4, eval_every=10, eval_batches=2, eval_batch_size=8, device="cpu")
    ours = [r["train_loss"] for r in train_run(RunSpec.parse("fp32"), s, seed=1).series]

    model = tiny_lm.build(s.model, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=s.base_lr, foreach=False)  # betas, eps, wd: torch defaults
    data = tiny_lm.batches("train", s.batch_size, model.cfg.seq_len, 1)
    theirs = []
    for step in range(1, s.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.base_lr, s.steps, s.warmup_frac, s.min_lr_frac)
        loss = model.loss(*next(data))
        opt.zero_grad()
        loss.backward()
        opt.step()
        theirs.append(float(loss.detach()))
    assert len(ours) == len(theirs) == s.steps
    assert ours[0] == theirs[0]  # same init, same first batch: the same forward pass
    # Our AdamW computes the same formula in a different fp32 operation order, so each
    # step's update differs by at most ~16 ulps relative (tests/test_optim.py: rtol 2e-6 ~
    # 17 eps); such rounding differences add up at most linearly over the steps.
    eps = torch.finfo(torch.float32).eps
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        assert abs(a - b) <= 16 * step * eps * abs(b), (step, a, b)


def test_divergence_is_reported_and_the_other_runs_go_on():
    doc = run_study(FAST, ["fp32", "fp32@lr=1000", "bf16"])
    rows = {r["config"]: r for r in doc["records"]}
    bad = rows["fp32@lr=1000"]
    assert bad["diverged"] is True and bad["status"] == "ok"
    assert 1 <= bad["diverged_at_step"] < FAST.steps and bad["steps"] == bad["diverged_at_step"]
    assert bad["final_val_loss"] is None and bad["gap_to_fp32"] is None and "loss" in bad["reason"]
    assert max(r["step"] for r in doc["series"] if r["config"] == "fp32@lr=1000") == bad["diverged_at_step"]
    for name in ("fp32", "bf16"):
        assert rows[name]["diverged"] is False and rows[name]["steps"] == FAST.steps
        assert math.isfinite(rows[name]["final_val_loss"])
    assert rows["fp32"]["gap_to_fp32"] == 0.0
    summary = {r["config"]: r for r in doc["summary"]}
    assert summary["fp32@lr=1000"]["diverged"] == 1


def test_a_run_that_raises_is_marked_failed_and_the_study_goes_on(monkeypatch):
    from qstate_cli.train import study

    real = study.train_run

    def out_of_memory_for_bf16(run, *args, **kw):
        if run.label == "bf16":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(run, *args, **kw)

    monkeypatch.setattr(study, "train_run", out_of_memory_for_bf16)
    doc = run_study(replace(FAST, steps=3), ["bf16", "bred-4bit"])
    rows = {r["config"]: r for r in doc["records"]}
    assert rows["bf16"]["status"] == "failed" and "out of memory" in rows["bf16"]["reason"]
    assert set(rows["bf16"]) == set(rows["fp32"])  # same columns: the frame stays rectangular
    assert rows["bred-4bit"]["status"] == "ok" and rows["bred-4bit"]["steps"] == 3
    assert {r["config"]: r["failed"] for r in doc["summary"]}["bf16"] == 1


def test_the_cli_exits_1_after_writing_when_a_run_failed(tmp_path, monkeypatch):
    from qstate_cli.train import study

    real = study.train_run
    monkeypatch.setattr(study, "train_run", lambda run, *a, **kw: (_ for _ in ()).throw(ValueError("boom"))
                        if run.label == "bf16" else real(run, *a, **kw))
    out_json, out_png = tmp_path / "train.json", tmp_path / "curves.png"
    r = CliRunner().invoke(app, ["bench", "train", "-c", "bf16", "--steps", "2", "--batch-size", "2",
                                 "--eval-every", "2", "--device", "cpu", "--json", str(out_json), "--plot", str(out_png)])
    assert r.exit_code == 1, r.output
    assert [(x["config"], x["status"]) for x in load(out_json)["records"]] == [("fp32", "ok"), ("bf16", "failed")]
    assert out_png.read_bytes()[:4] == b"\x89PNG"  # the plot is written before the exit
    assert r.stderr.strip().splitlines()[-1].startswith("check failed: bench train: 1 of 2 rows failed (bf16)")


def test_a_nan_loss_stops_the_run_at_that_step(monkeypatch):
    real_loss, calls = tiny_lm.TinyLM.loss, []

    def loss_with_nan_at_step_5(self, idx, targets):
        out = real_loss(self, idx, targets)
        if self.training:
            calls.append(1)
            if len(calls) == 5:
                return out * float("nan")
        return out

    monkeypatch.setattr(tiny_lm.TinyLM, "loss", loss_with_nan_at_step_5)
    res = train_run(RunSpec.parse("bred-4bit"), FAST, seed=0)
    assert res.record["diverged"] and res.record["diverged_at_step"] == 5
    assert res.record["reason"] == "training loss is nan"
    assert res.series[-1]["step"] == 5 and res.series[-1]["train_loss"] is None  # JSON-safe: null, not NaN
    assert res.record["best_val_loss"] is not None  # the evaluation at step 4 was kept


def test_theory_guided_resets_for_formats_with_and_without_a_model():
    beta2 = 0.999
    # int4/uint4 has no staleness model: the same-width float the paper uses (e2m2) stands in.
    period, basis = resolve_reset(parse_spec("uint4:nearest:b128"), "auto", beta2)
    assert period == reset_period(parse_spec("e2m2:nearest"), beta2) and "e2m2" in basis
    assert resolve_reset(parse_spec("e2m2:stochastic:b128"), "auto", beta2)[0] == \
        reset_period(parse_spec("e2m2:stochastic"), beta2)
    assert resolve_reset(parse_spec("uint4:bred:b128:sqrt"), "auto", beta2)[0] is None
    assert resolve_reset(parse_spec("fp32"), "auto", beta2)[0] is None
    assert resolve_reset(parse_spec("bf16"), "7", beta2) == (7, "fixed period")


def test_a_reset_changes_training_only_after_the_period():
    plain = losses(train_run(RunSpec.parse("nearest-8bit"), FAST, seed=0))
    reset = train_run(RunSpec.parse("nearest-8bit@reset=6"), FAST, seed=0)
    assert reset.record["reset_period"] == 6 and reset.record["resets"] == 1
    assert losses(reset)[:7] == plain[:7]  # steps 1..7: the reset acts before step 7's update
    assert losses(reset)[7:] != plain[7:]


def test_run_names_and_baseline():
    runs = parse_runs(["bred-4bit", "m=int4:bred:b128,v=lin4nz:bred:b128@reset=auto@lr=0.01"], "none")
    assert [r.label for r in runs] == ["fp32", "bred-4bit", "bred-4bit@reset=auto@lr=0.01"]
    assert runs[2].reset == "auto" and runs[2].lr == 0.01
    assert RunSpec.parse("fp32@lr=1e-2@reset=none").label == "fp32@lr=0.01"
    assert RunSpec.parse("bf16", default_reset="auto").label == "bf16@reset=auto"
    assert [r.label for r in parse_runs(["fp32"], "auto")] == ["fp32", "fp32@reset=auto"]
    for bad in ("bred-4bit@foo=1", "bred-4bit@lr=x", "bred-4bit@reset=sometimes", "bred-5bit"):
        with pytest.raises(QstateError):
            RunSpec.parse(bad)
    with pytest.raises(QstateError, match="twice"):
        parse_runs(["bf16", "bf16"])


def test_suite_hook_mirrors_the_cli_options():
    out = train_point({"config": "bred-4bit", "steps": 3, "batch_size": 2, "eval_every": 3, "seeds": 1})
    assert [r["config"] for r in out["records"]] == ["fp32", "bred-4bit"]
    assert RECORD_KEYS <= set(out["records"][0]) and SERIES_KEYS <= set(out["series"][0])
    with pytest.raises(QstateError, match="stpes"):
        train_point({"stpes": 3})


def test_cli_end_to_end_writes_json_and_plot(tmp_path):
    out_json, out_png = tmp_path / "train.json", tmp_path / "curves.png"
    r = CliRunner().invoke(app, ["bench", "train", "-c", "bred-4bit", "-c", "nearest-4bit@reset=auto", "--steps", "6",
                                 "--batch-size", "2", "--eval-every", "3", "--seeds", "2", "--device", "cpu",
                                 "--json", str(out_json), "--plot", str(out_png)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "bred-4bit" in r.stdout and "gap to fp32" in r.stdout
    doc = load(out_json)
    assert doc["kind"] == "train" and doc["env"]["device"] == "cpu"
    assert len(doc["records"]) == 3 * 2  # fp32 baseline + 2 runs, x 2 seeds
    for rec in doc["records"]:
        assert RECORD_KEYS <= set(rec)
    for row in doc["series"]:
        assert set(row) == SERIES_KEYS
    assert {r["config"] for r in doc["summary"]} == {"fp32", "bred-4bit", "nearest-4bit@reset=auto"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_usage_errors_are_one_line():
    for args in (["--config", "bred-5bit"], ["--optimizer", "adamax"], ["--steps", "0"], ["--plot", "x.gif"]):
        r = CliRunner().invoke(app, ["bench", "train", *args])
        assert r.exit_code == 2, (args, r.output)
        assert r.output.strip().startswith("error:") and r.output.strip().count("\n") == 0


def test_real_subprocess_json_on_stdout():
    cmd = [sys.executable, "-m", "qstate_cli", "bench", "train", "-c", "bred-4bit", "--steps", "3", "--batch-size", "2",
           "--eval-every", "3", "--device", "cpu", "--json", "-"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema_version"] == 1 and doc["kind"] == "train"
    assert [r["config"] for r in doc["records"]] == ["fp32", "bred-4bit"]
    assert "bred-4bit seed 0" in out.stderr  # progress on stderr, results on stdout


def test_steps_per_second_leave_out_the_kernels_first_compile(monkeypatch):
    """A first use compiles the CPU kernels inside the first step (seconds on numba): steps/s
    counts the steps' own time, and the compile is reported apart (it had read 2-3x low)."""
    import time

    from qstate_cli.runtime import COMPILES
    from qstate_cli.train import study

    made = study.make_optimizer

    def compiling_once(*args, **kwargs):
        opt, period, basis = made(*args, **kwargs)
        step, calls = opt.step, []

        def first_step_compiles(*a, **k):
            if not calls:
                calls.append(1)
                COMPILES.enter()
                COMPILES.begin("compiling (test)")
                time.sleep(SLEEP)
                COMPILES.end()
                COMPILES.leave()
            return step(*a, **k)

        opt.step = first_step_compiles
        return opt, period, basis

    SLEEP = 1.5  # s: well above 12 tiny steps even on a loaded machine (0.61 s seen at load 200)
    monkeypatch.setattr(study, "make_optimizer", compiling_once)
    lines = []
    rec = train_run(parse_runs(["bred-4bit"])[0], FAST, 0, log=lines.append).record
    assert SLEEP <= rec["compile_s"] < SLEEP + 1.0
    assert rec["steps"] / rec["steps_per_s"] < SLEEP  # 12 tiny steps, without the compile's 1.5 s
    assert "s compiling kernels left out" in lines[0]
    monkeypatch.undo()
    rec = train_run(parse_runs(["bred-4bit"])[0], FAST, 0).record  # nothing compiled: nothing left out
    assert rec["compile_s"] < 0.05
