"""One options dataclass per command (qstate_cli/options.py): the CLI's flags and a suite
point's keys are the same fields, values are parsed once, and the kinds table names them."""
import pytest
import typer

from qstate_cli.bench.kernels import KernelsOptions
from qstate_cli.cli import app
from qstate_cli.cli.output import OUTPUT_FLAGS
from qstate_cli.errors import QstateError
from qstate_cli.kinds import KINDS, load, runnable_kinds
from qstate_cli.options import option_fields
from qstate_cli.quant import StateConfig, parse_config
from qstate_cli.train.study import TrainSettings


def command(path: str):
    cmd = typer.main.get_command(app)
    for part in path.split():
        cmd = cmd.commands[part]
    return cmd


@pytest.mark.parametrize("kind", runnable_kinds())
def test_a_kinds_command_line_is_its_options(kind):
    """Every flag of the kind's command but the output flags is a field of its options
    dataclass, and every field is a flag: what a suite may set is what the CLI may set."""
    k = KINDS[kind]
    fields = {f.name for f in option_fields(load(k.options, kind))}
    cmd = command(k.command)
    outputs = {f"out_{name}" for name in OUTPUT_FLAGS}
    params = {p.name for p in cmd.params} - outputs - {"help"}
    assert params == fields
    for f in option_fields(load(k.options, kind)):
        flag = next(p for p in cmd.params if p.name == f.name)
        if f.metadata["argument"]:
            assert flag.param_type_name == "argument"
        else:
            assert f"--{f.name.replace('_', '-')}" in flag.opts or set(f.metadata["flags"]) <= set(flag.opts)


def test_values_are_parsed_once_whoever_fills_the_options():
    cfg = parse_config("bred-4bit")
    by_suite = KernelsOptions.from_params({"numel": "2^12, 1e3", "config": "bred-4bit", "baseline": "none",
                                           "rep_ms": 1, "copy_numel": "2^10", "optimizer": "AdamW"})
    assert by_suite.numel == [4096, 1000] and by_suite.config == [cfg] and isinstance(by_suite.config[0], StateConfig)
    assert by_suite.baseline == ["none"] and by_suite.rep_ms == 1.0 and isinstance(by_suite.rep_ms, float)
    assert by_suite.copy_numel == 1024 and by_suite.optimizer == "adamw"
    by_hand = KernelsOptions(numel=[4096, 1000], config=[cfg], baseline=["none"], rep_ms=1.0, copy_numel=1024)
    assert by_hand.to_params() == {**by_suite.to_params(), "optimizer": "adamw"}
    assert KernelsOptions.from_params(by_suite.to_params()) == by_suite  # round trip through plain JSON
    assert by_suite.to_params()["config"] == ["bred-4bit"]


def test_bad_parameters_are_one_clear_error():
    with pytest.raises(QstateError, match="bench kernels: unknown parameter 'nmel'; did you mean numel"):
        KernelsOptions.from_params({"nmel": 5})
    with pytest.raises(QstateError, match="bench kernels: bits must be int, got 'four'"):
        KernelsOptions.from_params({"bits": "four"})
    with pytest.raises(QstateError, match="whole number"):
        KernelsOptions.from_params({"numel": 1.5})
    with pytest.raises(QstateError, match="did you mean bred-4bit"):
        KernelsOptions.from_params({"config": ["bred4bit"]})
    assert KernelsOptions.from_params({"warmup_ms": None}).warmup_ms is None  # null: the default


def test_frozen_options_parse_too():
    s = TrainSettings.from_params({"config": "bf16, bred-4bit", "threads": 0, "steps": "12"})
    assert s.config == ["bf16", "bred-4bit"] and s.threads is None and s.steps == 12
    assert TrainSettings(threads=3).threads == 3


def test_a_state_configuration_with_commas_stays_one_item():
    from qstate_cli.options import split_items

    assert split_items("m=int4:bred:b128,v=lin4nz:bred:b128") == ["m=int4:bred:b128,v=lin4nz:bred:b128"]
    assert split_items(["bred-4bit,m=int4,v=lin4nz", "sr-4bit"]) == ["bred-4bit", "m=int4,v=lin4nz", "sr-4bit"]
    assert split_items("4096, 8192") == ["4096", "8192"]
