"""scripts/gpu_check.sh is the one GPU run a session may get, so its commands are checked
here on CPU: every `qstate` command line in it parses and passes its options' checks (the
device by name only), and every test file its pytest stages name exists. An option renamed
in the CLI and not in the script would otherwise cost a stage of the lent machine."""
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qstate_cli.cli import app, output

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "gpu_check.sh").read_text()
runner = CliRunner()


def _lines() -> list[str]:
    """The script's lines with backslash continuations joined."""
    return re.sub(r"\\\n\s*", " ", SCRIPT).splitlines()


def _values(out_dir: Path) -> dict[str, str]:
    """The script's variables as it sets them (defaults), and the loop variables' values."""
    return {"NUMEL": "100000000", "BENCH_NUMEL": "2^27", "OUT_DIR": str(out_dir), "REPLAY_STEPS": "400",
            "CPU_REPLAY_STEPS": "200", "trace": "demo", "b": "auto", "n": "8"}


def qstate_commands(out_dir: Path) -> list[list[str]]:
    """Every `"$PY" -m qstate_cli ...` command, its arguments up to a redirection or `||`."""
    values = _values(out_dir)
    commands = []
    for line in _lines():
        if line.lstrip().startswith("#") or '"$PY" -m qstate_cli' not in line:
            continue
        rest = line.split('"$PY" -m qstate_cli', 1)[1]
        rest = re.split(r"\s(?:\|\||>|&&)\s", rest)[0]
        rest = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], rest)
        commands.append(shlex.split(rest))
    return commands


class Checked(Exception):
    """Raised where the engine would start: the options parsed and passed their checks."""


def test_the_script_names_the_commands_it_is_known_to_run(tmp_path):
    names = [" ".join(c[:2]) for c in qstate_commands(tmp_path)]
    assert names.count("bench headline") == 1 and names.count("bench kernels") == 2
    assert names.count("bench memory") == 1 and sum(n.startswith("diagnose") for n in names) == 3


@pytest.mark.parametrize("index", range(7))
def test_each_qstate_command_of_the_gpu_check_parses_and_passes_its_checks(index, tmp_path, monkeypatch):
    command = qstate_commands(tmp_path)[index]

    def check_only(execute, options, *args, **kwargs):
        options.check(here=False)  # as `suite validate` checks a CUDA point on a CPU machine
        raise Checked(" ".join(command))

    monkeypatch.setattr(output, "run_engine", check_only)
    r = runner.invoke(app, command, env={"COLUMNS": "200"})
    assert isinstance(r.exception, Checked), f"qstate {' '.join(command)}: exit {r.exit_code}: {r.output}"


def test_every_test_file_the_pytest_stages_name_exists():
    named = set(re.findall(r"tests/test_[\w]+\.py", SCRIPT))
    assert len(named) >= 9
    assert sorted(n for n in named if not (ROOT / n).exists()) == []
    for marker in re.findall(r"-m (\w+) tests", SCRIPT):  # `pytest -m cuda tests`: a marker pytest knows
        assert marker in (ROOT / "pyproject.toml").read_text()
