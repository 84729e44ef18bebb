"""Shell completion (cli/completion.py): the values TAB offers come from the tables that
define them and are accepted by the parsers that read them; a real `qstate` process
answers the shell's completion protocol."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from qstate_cli.bench.shapes import MODELS, model_shapes
from qstate_cli.cli import app, completion
from qstate_cli.optim.registry import OPTIMIZERS
from qstate_cli.quant.config import PRESETS, parse_config
from qstate_cli.quant.formats import FORMATS
from qstate_cli.trace.corpus import ENTRIES

AS_QSTATE = "import sys; sys.argv[0] = 'qstate'; from qstate_cli.cli import main; main()"


def test_every_preset_and_format_completes_and_parses():
    offered = completion.configs("")
    assert set(PRESETS) | set(FORMATS) <= set(offered)
    for name in offered:
        if not name.endswith("="):
            assert name == "none" or parse_config(name)
    assert completion.configs("bred") == [p for p in PRESETS if p.startswith("bred")]


@pytest.mark.parametrize("typed", ["m=", "int4:", "m=int4:bred:", "m=int4:bred:b128,v=lin", "e4m3:", "int8:", "bf16:",
                                   "m=int4,v=lin4nz:bred:b128:"])
def test_the_grammar_completes_its_next_part(typed):
    offered = completion.configs(typed)
    assert offered and all(o.startswith(typed) for o in offered)
    for o in offered:
        parse_config(o)  # each is already a whole configuration


def test_a_part_of_a_kind_already_given_is_not_offered_again():
    assert "int4:bred:stochastic" not in completion.configs("int4:bred:")
    assert "int4:b128:b256" not in completion.configs("int4:b128:")
    assert "int4:tensor" not in completion.configs("int4:")  # block scales only
    assert "e4m3:tensor" in completion.configs("e4m3:")
    assert "int8:softsign" in completion.configs("int8:") and "e4m3:softsign" not in completion.configs("e4m3:")


def test_a_state_already_named_is_not_offered_again():
    assert completion.configs("m=int4,") == ["m=int4,v="]


def test_after_a_whole_configuration_a_comma_offers_another():
    assert completion.configs("bred-4bit,bn") == ["bred-4bit,bnb-8bit"]
    assert "bred-4bit,m=" in completion.configs("bred-4bit,")
    assert completion.configs("bred-4bit,m=int4,") == ["bred-4bit,m=int4,v="]


def test_names_come_from_their_tables():
    assert completion.optimizers("") == list(OPTIMIZERS)
    assert completion.models("gpt2") == [m for m in MODELS if m.startswith("gpt2")]
    for m in completion.models(""):
        assert model_shapes(m)
    assert completion.traces("corpus:") == [f"corpus:{n}" for n in ENTRIES]
    assert completion.traces("nothing-like-it") == []  # the shell then completes a file name


def test_bench_train_offers_the_models_it_trains():
    from qstate_cli.train.study import TrainSettings

    complete = completion.for_option(TrainSettings, "model", ("--model", "-m"))
    assert complete("") == ["tiny-lm", "small-lm"]


def _bash(words: str, env_extra=None) -> list[str]:
    """What `qstate` answers bash's completion call for the command line `words`."""
    cword = len(words.split(" ")) - 1
    env = {**os.environ, "COMP_WORDS": words, "COMP_CWORD": str(cword), "_QSTATE_COMPLETE": "complete_bash",
           **(env_extra or {})}
    p = subprocess.run([sys.executable, "-c", AS_QSTATE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_a_real_process_completes_commands_flags_and_values():
    assert _bash("qstate bench ") == ["kernels", "memory", "headline", "train"]
    assert "--config" in _bash("qstate diagnose --")
    assert _bash("qstate bench kernels --optimizer ") == list(OPTIMIZERS)


def test_zsh_gets_values_with_colons():
    result = CliRunner().invoke(app, [], prog_name="qstate",
                                env={"_QSTATE_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "qstate diagnose corpus:s"})
    assert result.exit_code == 0
    for name in ENTRIES:
        assert (f"corpus\\\\:{name}" in result.output) == name.startswith("s")


def test_show_completion_prints_the_script_for_the_shell():
    """`qstate --show-completion` run from bash (the shell is detected from the parent process;
    `; exit $?` keeps bash from exec-ing qstate in its place)."""
    p = subprocess.run(["bash", "-c", '"$0" -c "$1" --show-completion; exit $?', sys.executable, AS_QSTATE],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "_QSTATE_COMPLETE=complete_bash" in p.stdout and "complete -o default -F _qstate_completion qstate" in p.stdout
