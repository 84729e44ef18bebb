"""The static SASS budget (scripts/sass_budget.py): counts the hot path of the compiled
kernels for sm_90 on a CPU, and labels everything it prints a prediction."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qstate_cli.bench import budget
from qstate_cli.kernels import sass

ROOT = Path(__file__).resolve().parents[1]

# a loop whose body holds a fast/slow branch (the slow one calls out) and a masked arm
SYNTH = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   IMAD R1, R0, 0x4, RZ ;
.L_x_0:
        /*0020*/                   ISETP.GE.AND P0, PT, R1, R2, PT ;
        /*0030*/               @P0 BRA `(.L_x_3) ;
        /*0040*/                   LDG.E R4, desc[UR4][R6.64] ;
        /*0050*/                   FADD R4, R4, 1 ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
        /*0070*/                   CALL.REL.NOINC `($__internal_slowpath) ;
.L_x_1:
        /*0080*/                   BRA `(.L_x_2) ;
.L_x_3:
        /*0090*/               @P2 LDG.E R4, desc[UR4][R6.64] ;
        /*00a0*/                   FADD R4, R4, 1 ;
        /*00b0*/                   FADD R4, R4, 1 ;
        /*00c0*/                   FADD R4, R4, 1 ;
.L_x_2:
        /*00d0*/                   F2FP.BF16.F32.PACK_AB R5, RZ, R4 ;
        /*00e0*/                   STG.E desc[UR4][R6.64], R5 ;
        /*00f0*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0100*/              @P3 BRA `(.L_x_0) ;
        /*0110*/                   EXIT ;
.L_x_4:
        /*0120*/                   BRA `(.L_x_4) ;
"""


def test_hot_path_takes_the_short_arm_around_the_loop_and_never_a_call():
    hot = sass.hot_path(SYNTH)
    # around: ISETP BRA | LDG FADD BRA | BRA | F2FP STG IADD3 BRA
    assert hot.per_tile == {"integer": 2, "memory": 2, "float": 1, "conversion": 1, "control": 4}
    assert hot.per_program == {"integer": 1, "memory": 0, "float": 0, "conversion": 0, "control": 2}
    assert hot.tile_opcodes == {"BRA": 4, "F2FP": 1, "FADD": 1, "IADD3": 1, "ISETP": 1, "LDG": 1, "STG": 1}
    assert list(hot.tile_opcodes)[0] == "BRA"  # most first
    per = hot.per_element(elems_per_thread=2, tiles=8)
    assert per["control"] == pytest.approx((2 / 8 + 4) / 2)
    assert sass.classify("ULDC") == "memory" and sass.classify("LOP3") == "integer"


# a shuffle ptxas cannot prove convergent: BRA.DIV jumps to a collective fallback only
# when the warp is diverged; converged, it falls through to the plain shuffle
SYNTH_DIV = """
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0010*/                   BRA.DIV UR4, `(.L_x_9) ;
        /*0020*/                   SHFL.BFLY PT, R3, R0, 0x1, 0x1f ;
.L_x_5:
        /*0030*/                   FMNMX R0, R0, R3, !PT ;
        /*0040*/               @P3 BRA `(.L_x_0) ;
        /*0050*/                   EXIT ;
.L_x_9:
        /*0060*/                   WARPSYNC.COLLECTIVE R2, `(.L_x_6) ;
        /*0070*/                   SHFL.BFLY P5, R3, R0, R4, R5 ;
        /*0080*/                   ENDCOLLECTIVE ;
        /*0090*/                   BRA `(.L_x_5) ;
"""


def test_divergence_check_falls_through_to_the_converged_arm():
    hot = sass.hot_path(SYNTH_DIV)
    assert hot.per_tile == {"integer": 0, "memory": 1, "float": 1, "conversion": 0, "control": 2}


def test_h200_budget_is_the_issue_rate_over_the_copy_rate():
    dev = budget.H200
    assert dev.thread_instructions_per_s == pytest.approx(132 * 4 * 1.98e9 * 32)
    assert dev.budget(8.125) == pytest.approx(63.2, abs=0.05)
    assert budget.kernel_bytes_per_element("adamw", "bred-4bit", "bf16") == pytest.approx(8.125)
    assert budget.kernel_bytes_per_element("adamw", "bred-4bit", "fp32") == pytest.approx(14.125)
    assert budget.predicted_copy_fraction(2 * dev.budget(8.125), 8.125) == pytest.approx(0.5)
    assert budget.predicted_copy_fraction(10.0, 8.125) == 1.0


CACHE = {}


def _run(*args, tmp_path):
    """The script as a subprocess; one count cache for the whole module (the first test
    compiles, later ones read its counts: what the cache is for)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["QSTATE_CACHE"] = CACHE.setdefault("dir", str(tmp_path / "cache"))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_budget.py"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_script_compiles_a_variant_for_sm90_on_the_cpu_and_writes_the_report(tmp_path):
    out = _run("--json", "--only", "sgd:m=int4:bred:b128:bf16", "--report", str(tmp_path / "b"), tmp_path=tmp_path)
    if out.returncode == 1 and "cannot compile for sm_90" in out.stderr:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert rec["kernel"] == "sgd" and rec["param_dtype"] == "bf16" and rec["kind"] == "prediction"
    assert 10 < rec["sass_per_elem"] < 500
    assert rec["sass_per_elem"] == pytest.approx(sum(rec[c + "_per_elem"] for c in sass.CLASSES), abs=0.05)
    assert 0 < rec["predicted_copy_fraction"] <= 1
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["kind"] == "sass-budget" and doc["records"] == [rec]
    assert "PREDICTION" in (tmp_path / "b.md").read_text()
    again = _run("--json", "--only", "sgd:m=int4:bred:b128:bf16", tmp_path=tmp_path)  # from the cache
    assert json.loads(again.stdout) == rec
    ops = json.loads(_run("--json", "--opcodes", "--only", "sgd:m=int4:bred:b128:bf16", tmp_path=tmp_path).stdout)
    assert {k: v for k, v in ops.items() if k not in ("tile_instructions", "tile_opcodes")} == rec
    assert sum(ops["tile_opcodes"].values()) == ops["tile_instructions"] > 0
    assert ops["tile_opcodes"].get("LDG", 0) > 0 and ops["tile_opcodes"].get("STG", 0) > 0  # loads, stores
    table = _run("--opcodes", "--only", "sgd:m=int4:bred:b128:bf16", tmp_path=tmp_path).stdout
    assert f"tile loop: {ops['tile_instructions']} instructions" in table and " LDG " in table


def test_unknown_variant_is_one_line_and_exit_2(tmp_path):
    out = _run("--only", "adamw:nope", tmp_path=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "no variant matches" in out.stderr


def test_measured_rows_are_printed_beside_the_prediction(tmp_path):
    from qstate_cli.quant import parse_config
    from qstate_cli.results import document, write_json_atomic

    rows = [{"name": "bred-4bit", "optimizer": "sgd", "config": parse_config("bred-4bit").canonical(),
             "param_dtype": "bf16", "status": "ok", "pct_of_copy": 61.0, "gbps": 2600.0, "path": "triton",
             "timing": "cuda-graph"},
            {"name": "copy", "optimizer": None, "config": "copy", "param_dtype": "fp32", "status": "ok"}]
    write_json_atomic(tmp_path / "k.json", document("kernels", rows))
    out = _run("--json", "--beside", str(tmp_path / "k.json"), tmp_path=tmp_path)
    if out.returncode == 1 and "cannot compile for sm_90" in out.stderr:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert row["name"] == "bred-4bit" and row["kernel"] == "sgd" and row["measured_pct_of_copy"] == 61.0
    assert 0 < row["predicted_pct_of_copy"] <= 100
    missing = _run("--beside", str(tmp_path / "none.json"), tmp_path=tmp_path)
    assert missing.returncode == 2 and "none.json" in missing.stderr


def test_beside_takes_rows_the_compiled_kernels_stepped():
    """A row that fell back to the reference (or ran in Triton's interpreter) was set beside
    the sm_90 prediction; a cache-resident row (pct_of_copy None) then crashed the script's
    print (TypeError on None's format), as on a CPU-only run of scripts/gpu_check.sh."""
    from qstate_cli.quant import parse_config

    config = parse_config("bred-4bit").canonical()
    prediction = {"kernel": "adamw", "states": config, "param_dtype": "bf16", "predicted_copy_fraction": 0.5,
                  "sass_per_elem": 40.0, "budget_per_elem": 80.0}
    rows = [{"name": f"bred-4bit {path}", "optimizer": "adamw", "config": config, "param_dtype": "bf16",
             "status": "ok", "pct_of_copy": pct, "path": path}
            for path, pct in (("triton", None), ("reference", 3.0), ("triton-interpreter", 0.1), ("triton", 55.0))]
    shown = budget.beside(rows, [prediction])
    assert [(r["name"], r["measured_pct_of_copy"]) for r in shown] == [("bred-4bit triton", None),
                                                                        ("bred-4bit triton", 55.0)]
    assert shown[0]["predicted_pct_of_copy"] == 50.0
