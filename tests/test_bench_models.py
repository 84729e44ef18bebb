"""`--model` of bench memory / bench kernels (and a suite point's `model`): a custom shape
list is one model, while a comma list of built-in names is several (bench/shapes.py,
split_models). `--model` is a list option whose values were split at every comma, so
`--model 4096x1024*2,1024*4` measured two models, one per shape, and never the whole one."""
import json

import pytest
from typer.testing import CliRunner

from qstate_cli.bench.kernels import KernelsOptions
from qstate_cli.bench.memory import MemoryOptions, plan
from qstate_cli.bench.shapes import model_shapes, split_models
from qstate_cli.cli import app
from qstate_cli.errors import QstateError

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

CUSTOM = "4096x1024*2,1024*4"  # the probe's: 2 matrices and 4 vectors, 8,392,704 parameters
SMALL = "64x128*2,4096,128*3"  # one model of 6 tensors, small enough to step in a test


@pytest.mark.parametrize("value, models", [
    (CUSTOM, [CUSTOM]),
    ("gpt2-small,llama-1b", ["gpt2-small", "llama-1b"]),
    (" gpt2-small , tiny-lm ", ["gpt2-small", "tiny-lm"]),
    ("768,768", ["768,768"]),                              # two 1-D tensors of one model
    ("gpt2-small,768x768,768", ["gpt2-small", "768x768,768"]),
    ("768x768,gpt2-small,1024", ["768x768", "gpt2-small", "1024"]),
    ("gpt2-smal,llama-1b", ["gpt2-smal", "llama-1b"]),     # a typo stays its own model (did you mean)
    ([CUSTOM, "8x8"], [CUSTOM, "8x8"]),                    # two values: two models
    ([CUSTOM, "gpt2-small,tiny-lm"], [CUSTOM, "gpt2-small", "tiny-lm"]),
    (",,", []),
])
def test_split_models(value, models):
    assert split_models(value) == models


@pytest.mark.parametrize("cls", [MemoryOptions, KernelsOptions])
def test_options_keep_a_shape_list_whole_and_split_builtin_names(cls):
    assert cls(model=[CUSTOM]).model == [CUSTOM]
    assert cls(model=CUSTOM).model == [CUSTOM]
    assert cls(model=["gpt2-small,llama-1b"]).model == ["gpt2-small", "llama-1b"]
    assert cls(model=[CUSTOM, "1024x1024"]).model == [CUSTOM, "1024x1024"]
    # a suite point: a scalar, a YAML list, and the options' own to_params (a result's meta)
    assert cls.from_params({"model": CUSTOM}).model == [CUSTOM]
    assert cls.from_params({"model": [CUSTOM, "tiny-lm"]}).model == [CUSTOM, "tiny-lm"]
    assert cls.from_params({"model": "tiny-lm,small-lm"}).model == ["tiny-lm", "small-lm"]
    opts = cls(model=[CUSTOM, "gpt2-small,tiny-lm"])
    assert cls.from_params({"model": opts.to_params()["model"]}).model == opts.model
    with pytest.raises(QstateError, match="names nothing"):
        cls(model=[",,"])


def test_the_plan_has_one_target_for_a_shape_list():
    p = plan(MemoryOptions(model=[CUSTOM], config=["bred-4bit"], baseline=["none"], device="cpu"))
    assert [(t.model, len(t.shapes), t.numel) for t in p.targets] == [(CUSTOM, 6, 2 * 4096 * 1024 + 4 * 1024)]
    assert model_shapes(CUSTOM) == [(4096, 1024)] * 2 + [(1024,)] * 4


def test_memory_cli_measures_a_shape_list_as_one_model(tmp_path):
    out = tmp_path / "m.json"
    r = runner.invoke(app, ["bench", "memory", "--device", "cpu", "--model", SMALL, "-c", "bred-4bit",
                            "--baseline", "none", "--backend", "reference", "--json", str(out)])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(out.read_text())["records"]
    assert (row["model"], row["n_tensors"], row["params"]) == (SMALL, 6, 2 * 64 * 128 + 4096 + 3 * 128)
    assert row["status"] == "ok" and row["state_bytes"] - row["expected_state_bytes"] == 5 * 8 * 6


def test_memory_cli_still_takes_several_builtin_models_and_repeated_shape_lists(tmp_path):
    out = tmp_path / "m.json"
    r = runner.invoke(app, ["bench", "memory", "--device", "cpu", "--model", "tiny-lm,tiny-lm", "--model", SMALL,
                            "--model", "4096", "-c", "bred-4bit", "--baseline", "none", "--backend", "reference",
                            "--json", str(out)])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["records"]
    assert [(x["model"], x["n_tensors"]) for x in rows] == [("tiny-lm", 29), ("tiny-lm", 29), (SMALL, 6), ("4096", 1)]


def test_memory_cli_names_a_bad_shape_in_a_list_in_one_line():
    r = runner.invoke(app, ["bench", "memory", "--device", "cpu", "--model", "768x768,0x5", "-c", "bred-4bit",
                            "--baseline", "none"])
    assert r.exit_code == 2 and r.stderr.strip().count("\n") == 0
    assert "'0x5' in '768x768,0x5'" in r.stderr


def test_kernels_cli_steps_a_shape_list_as_one_model(tmp_path):
    out = tmp_path / "k.json"
    r = runner.invoke(app, ["bench", "kernels", "--device", "cpu", "--model", SMALL, "-c", "nearest-4bit",
                            "--baseline", "none", "--backend", "reference", "--warmup-ms", "0", "--rep-ms", "1",
                            "--rounds", "1", "--copy-numel", "4096", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rows = [x for x in json.loads(out.read_text())["records"] if x["name"] != "copy"]
    assert [(x["model"], x["n_tensors"], x["numel"]) for x in rows] == [(SMALL, 6, 2 * 64 * 128 + 4096 + 3 * 128)]


def test_audit_takes_a_shape_list_as_one_model():
    r = runner.invoke(app, ["audit", "--model", SMALL, "--world-size", "2", "--json", "-"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    records = doc["records"] if isinstance(doc, dict) else doc
    assert {x["name"] for x in records} == {f"param{i}" for i in range(6)}


def test_a_suite_point_takes_a_shape_list_as_one_model(tmp_path):
    from qstate_cli.results import load
    from qstate_cli.suites import load_suite
    from qstate_cli.suites.runner import run_suite

    suite = tmp_path / "s.yaml"
    suite.write_text("kind: memory\n"
                     "defaults: {device: cpu, backend: reference, config: [bred-4bit]}\n"
                     f"axes:\n  model: ['{SMALL}', 'tiny-lm,tiny-lm']\n")
    (run,) = run_suite(load_suite(suite), tmp_path / "out")
    rows = load(run.path)["records"]
    assert sorted((x["model"], x["n_tensors"]) for x in rows) == sorted([(SMALL, 6), ("tiny-lm", 29),
                                                                         ("tiny-lm", 29)])
