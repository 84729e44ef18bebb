"""Bounds of the shared options layer (options.py) and the checks a suite point gets before
any work: seeds, finite positive numbers, empty lists, shape strings, world sizes, a state
given twice; `suite validate` and `run` refusing what an engine would refuse."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qstate_cli.errors import QstateError
from qstate_cli.options import MAX_SEED, parse_seed, positive_number


@pytest.mark.parametrize("value", [0, "0", 7, "+12", MAX_SEED, str(MAX_SEED)])
def test_seed_in_range(value):
    seed = parse_seed(value)
    assert seed == int(str(value)) and isinstance(seed, int)
    torch.manual_seed(seed)  # what the engines do with it


@pytest.mark.parametrize("value", [-1, "-1", MAX_SEED + 1, "99999999999999999999999", "1e3", "x", True, 1.5, ""])
def test_seed_out_of_range(value):
    with pytest.raises(QstateError, match=r"--seed .*: must be a whole number from 0 to 2\^63-1"):
        parse_seed(value)


@pytest.mark.parametrize("cls_path", ["qstate_cli.bench.memory:MemoryOptions", "qstate_cli.bench.kernels:KernelsOptions",
                                      "qstate_cli.train.study:TrainSettings"])
def test_every_seed_option_is_bounded(cls_path):
    from qstate_cli.kinds import load

    cls = load(cls_path, "test")
    assert cls.from_params({"seed": "5"}).seed == 5
    with pytest.raises(QstateError, match="--seed"):
        cls.from_params({"seed": 2**70})


def test_train_last_seed_bounded():
    from qstate_cli.train.study import TrainSettings

    with pytest.raises(QstateError, match="the last seed is past 2\\^63-1"):
        TrainSettings(seed=MAX_SEED, seeds=2, device="cpu").check()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "x", float("nan")])
def test_positive_number_refuses(value):
    with pytest.raises(QstateError, match=r"--max-gib .*: must be a finite number > 0"):
        positive_number("--max-gib")(value)


def test_doctor_max_gib_parsed():
    from qstate_cli.doctor.run import DoctorOptions

    assert DoctorOptions(max_gib="0.5").max_gib == 0.5
    with pytest.raises(QstateError, match="--max-gib inf"):
        DoctorOptions(max_gib=float("inf"))


@pytest.mark.parametrize("value", [",,", "", " , ", [",,"], ["small-lm", ","]])
def test_a_list_option_naming_nothing_is_refused(value):
    from qstate_cli.bench.memory import MemoryOptions

    with pytest.raises(QstateError, match="--model .*: names nothing"):
        MemoryOptions(model=value)
    assert MemoryOptions(model="tiny-lm,small-lm").model == ["tiny-lm", "small-lm"]


@pytest.mark.parametrize("text, message", [
    ("5*99999999999999999999", "more than 100,000 tensors"),
    ("1*100001", "more than 100,000 tensors"),
    ("99999999x99999999", r"more than 2\^48 elements"),
    ("65536x65536*65536", r"more than 2\^48 elements"),
    ("16777216x16777216", r"more than 2\^48 elements"),
])
def test_custom_shapes_are_bounded(text, message):
    from qstate_cli.bench.shapes import model_shapes

    with pytest.raises(QstateError, match=message):
        model_shapes(text)


def test_custom_shapes_within_bounds_and_builtins_are_fresh_lists():
    from qstate_cli.bench.shapes import model_shapes, numel

    assert len(model_shapes("3*100000")) == 100_000
    assert numel(model_shapes("16777216x16777215")) == 2**48 - 2**24
    shapes = model_shapes("tiny-lm")
    shapes.clear()  # the cache hands out copies
    assert model_shapes("tiny-lm")


def test_audit_world_size_bounded():
    from qstate_cli.cli.audit_cmd import AuditOptions

    assert AuditOptions(world_size=65536).world_size == 65536
    for bad in (0, 65537, 10**9):
        with pytest.raises(QstateError, match="use 1 to 65,536 ranks"):
            AuditOptions(world_size=bad)


def test_a_state_given_twice_is_refused():
    from qstate_cli.quant.config import parse_config

    for text in ("m=int4:nearest:b128,v=lin4nz:nearest:b128,v=int8", "m=int4,m=int8,v=lin4nz"):
        with pytest.raises(QstateError, match=r"is given twice"):
            parse_config(text)


def test_diagnose_options_checked_before_the_trace_is_read(tmp_path):
    from qstate_cli.diagnose.run import DiagnoseOptions, execute

    missing = str(tmp_path / "nosuch.pt")  # never opened: the options are refused first
    for params, message in (({"steps_limit": -3}, "--steps-limit -3"), ({"reset": "-5"}, "reset policy '-5'"),
                            ({"device": "tpu"}, "unknown device 'tpu'"), ({"block_size": 0}, "--block-size 0: the replay needs a power of two")):
        with pytest.raises(QstateError, match=message):
            execute(DiagnoseOptions(trace=missing, config=["sr-4bit"], **params))


def _suite(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("kind: kernels\ndefaults: {numel: -5, device: cpu}\n", "--numel must be >= 1"),
    ("kind: diagnose\ndefaults: {trace: demo, block_size: 0, steps_limit: -3}\n", "--block-size 0: the replay needs a power of two"),
    ("kind: diagnose\ndefaults: {trace: demo, block_size: 48}\n", "--block-size 48: the replay needs a power of two"),
    ("kind: diagnose\ndefaults: {trace: demo, steps_limit: -3}\n", "--steps-limit -3"),
    ("kind: memory\ndefaults: {numel: [1000], config: [fp32], seed: -1}\n", "--seed -1"),
    ("kind: train\ndefaults: {seed: 9223372036854775807, seeds: 2}\n", "the last seed"),
])
def test_validate_and_run_refuse_a_point_before_any_file(tmp_path, text, message):
    from qstate_cli.suites import SuiteError, load_suite
    from qstate_cli.suites.runner import run_suite

    path = _suite(tmp_path, text)
    with pytest.raises(SuiteError, match=message):
        load_suite(path)
    loaded = load_suite(path, check_params=False)  # the runner checks again, on its own
    with pytest.raises(QstateError, match=message):
        run_suite(loaded, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_cuda_suite_validates_anywhere_but_runs_only_where_cuda_is(tmp_path, monkeypatch):
    from qstate_cli.suites import load_suite
    from qstate_cli.suites.runner import run_suite

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = _suite(tmp_path, "kind: kernels\ndefaults: {bits: 4, numel: [1024], device: cuda}\n")
    loaded = load_suite(path)  # `suite validate` on a machine without CUDA: the name is fine
    with pytest.raises(QstateError, match="point defaults: --device cuda: CUDA is not available here"):
        run_suite(loaded, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
