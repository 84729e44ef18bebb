"""A Triton too old for the kernels (kernels.MIN_TRITON, 3.6, compiled for CUDA: 3.5 has
triton.constexpr_function but compiles tl.math.div_rn to a flushing division, older ones
lack it; kernels.MIN_TRITON_INTERPRET, 3.7, in the interpreter: 3.6's hands the options
namedtuple to a constexpr_function as a plain tuple) is refused: kernels.unavailable_reason
says so, the optimizers step on the reference path with that reason, and `bench kernels`
rows say it, instead of a crash at the first launch. No GPU needed: triton's version is patched."""
import pytest
import torch

from qstate_cli import kernels
from qstate_cli.bench import kernels as bench_kernels
from qstate_cli.bench.kernels import KernelsOptions
from qstate_cli.errors import QstateError
from qstate_cli.optim import AdamW

CUDA_OLD = "triton 3.5 is older than 3.6, which the kernels need"
INTERPRETER_OLD = "triton 3.6 is older than 3.7, which the kernels need in Triton's interpreter"


@pytest.mark.parametrize("version, problem", [
    ("3.2.0", "triton 3.2 is older than 3.6, which the kernels need"), ("3.5.1", CUDA_OLD),
    ("2.9.9", "triton 2.9 is older than 3.6, which the kernels need"), ("3.6.0", None), ("3.6.1+git9a3b", None),
    ("3.9.0", None), ("4.0", None), ("10.1.0", None), ("", None), (None, None), ("main", None)])
def test_the_version_floor(version, problem):
    assert kernels.triton_version_problem(version) == problem


def test_the_interpreter_needs_3_7():
    assert kernels.triton_version_problem("3.6.0", kernels.MIN_TRITON_INTERPRET, " in Triton's interpreter") \
        == INTERPRETER_OLD
    assert kernels.triton_version_problem("3.7.0", kernels.MIN_TRITON_INTERPRET) is None


@pytest.fixture
def triton_at(monkeypatch):
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return lambda version: monkeypatch.setattr(triton, "__version__", version)


def test_an_old_triton_is_unavailable_on_every_device(triton_at, monkeypatch):
    triton_at("3.5.0")
    assert kernels.unavailable_reason("cuda") == CUDA_OLD  # checked before CUDA itself
    triton_at("3.6.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernels.unavailable_reason("cuda") is None  # compiled: 3.6 is enough
    for device in ("cpu", "meta"):
        assert kernels.unavailable_reason(device) == INTERPRETER_OLD and not kernels.available(device)
    monkeypatch.delenv("TRITON_INTERPRET")  # no interpreter asked for: that is the reason, whatever the version
    assert kernels.unavailable_reason("cpu") == "tensors on cpu need TRITON_INTERPRET=1 to run the kernels in Triton's interpreter"


def test_the_optimizers_fall_back_to_the_reference_and_say_why(triton_at):
    triton_at("3.6.0")
    p = torch.nn.Parameter(torch.zeros(8192, device="meta"))  # not a CPU tensor: auto would take the kernels
    opt = AdamW([p], states="bred-4bit")
    assert opt.path_for(p) == "reference" and opt.why_reference(p) == INTERPRETER_OLD
    q = torch.nn.Parameter(torch.zeros(8192))
    with pytest.raises(QstateError, match=r"backend='triton' needs .*\(triton 3\.6 is older than 3\.7, which the "
                                          r"kernels need in Triton's interpreter\)"):
        AdamW([q], states="bred-4bit", backend="triton").path_for(q)


def test_bench_kernels_rows_say_why(triton_at):
    triton_at("3.2.0")
    rows = bench_kernels.run(bench_kernels.plan(KernelsOptions(
        numel=[4096], config=["bred-4bit"], baseline=["none"], backend=["triton"], device="cpu", warmup_ms=0,
        rep_ms=1, copy_numel=4096)))
    (row,) = [r for r in rows if r["name"] == "bred-4bit"]
    assert row["status"] == "unavailable" and row["time_ms"] is None
    assert "triton 3.2 is older than 3.7, which the kernels need in Triton's interpreter" in row["reason"]
