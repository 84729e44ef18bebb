"""`qstate --version`, `--help` and `formats`, through CliRunner and as a real subprocess."""
import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from qstate_cli import __version__
from qstate_cli.cli import app
from qstate_cli.quant import FORMATS, PRESETS

runner = CliRunner()


def test_version_and_help():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"qstate {__version__}"
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "formats" in r.stdout


def test_formats_table_lists_every_format_rounding_and_preset():
    r = runner.invoke(app, ["formats"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for name in list(FORMATS) + list(PRESETS) + ["nearest", "stochastic", "bred"]:
        assert name in r.stdout


def test_formats_json_has_bytes_at_the_block_size():
    r = runner.invoke(app, ["formats", "--json", "--block-size", "64"])
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    rows = {row["format"]: row for row in doc["formats"]}
    assert rows["int4"]["bytes_per_element"] == 0.5 + 4 / 64
    assert rows["e4m3"]["bytes_per_element"] == 1 + 4 / 64  # floats scaled when a block is asked
    assert rows["fp32"]["bytes_per_element"] == 4
    presets = {row["preset"]: row for row in doc["presets"]}
    assert presets["bred-4bit"]["adamw_bytes_per_param"] == 1.0625
    assert presets["bred-4bit"]["m_only_bytes_per_param"] == 0.53125  # Lion/SGD/Muon: 4-bit m + fp32 scale/128
    assert presets["bnb-8bit"]["m_only_bytes_per_param"] == 1.015625
    assert {r_["rounding"] for r_ in doc["roundings"]} == {"nearest", "stochastic", "bred"}


def test_bad_block_size_is_a_one_line_usage_error():
    r = runner.invoke(app, ["formats", "--block-size", "33"])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and "block-size 33" in r.output


def test_real_subprocess():
    out = subprocess.run([sys.executable, "-m", "qstate_cli", "formats", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["formats"]) == len(FORMATS)
    bad = subprocess.run([sys.executable, "-m", "qstate_cli", "formats", "-b", "5000"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.startswith("error:")


def test_the_command_line_starts_without_dynamo_or_scipy():
    """Every `qstate` command imports the whole command tree; torch._dynamo (~3 s: the
    optimizers' step is kept out of torch.compile) and scipy.stats (~1.4 s: theory.py) are
    imported where they are used, not at start-up (`qstate --help` took 9.8 s with both)."""
    code = ("import sys, qstate_cli.cli; "
            "print(sorted(m for m in ('torch._dynamo', 'scipy', 'scipy.stats') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_fp4_presets_say_they_reproduce_the_paper_and_diverge_in_training():
    """fp4 / fp4-sr keep v on unsigned E2M2 with a zero level: AdamW diverges with them (a v
    read back as 0 blows up m / sqrt(v); tiny-lm: loss past twice the first by steps 4 and
    7), and the description said only "E2M1 m, unsigned E2M2 v (staleness paper)"."""
    r = runner.invoke(app, ["formats", "--json"])
    assert r.exit_code == 0, r.output
    presets = {row["preset"]: row["purpose"] for row in json.loads(r.stdout)["presets"]}
    for name in ("fp4", "fp4-sr"):
        text = presets[name]
        assert "staleness paper" in text and "diverges" in text and "read" in text and "as 0" in text, text
        assert all(good in text for good in ("bred-4bit", "bred-sr-4bit", "nearest-4bit")), text
        assert all(good in PRESETS for good in ("bred-4bit", "bred-sr-4bit", "nearest-4bit"))
    # the consoles take their width when the CLI is imported: a real process at COLUMNS=100
    out = subprocess.run([sys.executable, "-m", "qstate_cli", "formats"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    fp4_row = next(i for i, line in enumerate(lines) if line.startswith("│ fp4 ") and "staleness" in line)
    text = " ".join(line.strip("│ ").split("│")[-1].strip() for line in lines[fp4_row:fp4_row + 4])
    assert "AdamW diverges" in text  # wrapped at spaces in the purpose column, not cut
