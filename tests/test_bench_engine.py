"""The bench engines without the CLI: peers present and missing, out-of-memory rows,
other optimizers, the suite hooks. Small sizes; nothing asserts on timing."""
import sys

import pytest
import torch

from qstate_cli.bench import group, kernels, memory, workset
from qstate_cli.bench.timing import Item
from qstate_cli.bench.kernels import KernelsOptions
from qstate_cli.bench.memory import MemoryOptions
from qstate_cli.errors import QstateError
from qstate_cli.suites import hook_for

FAST = dict(warmup_ms=0, rep_ms=1, copy_numel=4096)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def run_kernels(**kw):
    return kernels.run(kernels.plan(KernelsOptions(**{**FAST, **kw})))


def by_name(rows):
    return {r["name"]: r for r in rows}


def test_missing_peers_are_reported_not_crashed_on(monkeypatch):
    for mod in ("bitsandbytes", "torchao", "torchao.optim"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    rows = by_name(run_kernels(numel=[4096], config=["nearest-4bit"],
                               baseline=["bnb-adamw8bit", "torchao-adamw4bit", "torch-foreach"]))
    for name, path in (("bnb-adamw8bit", "bnb"), ("torchao-adamw4bit", "torchao")):
        assert rows[name]["status"] == "unavailable" and rows[name]["path"] == path
        assert "not importable" in rows[name]["reason"] and "qstate-cli[peers]" in rows[name]["reason"]
        assert rows[name]["time_ms"] is None and rows[name]["bytes_moved"] > 0
    assert rows["nearest-4bit"]["status"] == rows["torch-foreach"]["status"] == "ok"
    mem = by_name(memory.run(memory.plan(MemoryOptions(numel=[4096], config=["nearest-4bit"],
                                                       baseline=["bnb-adamw8bit"]))))
    assert mem["bnb-adamw8bit"]["status"] == "unavailable" and mem["nearest-4bit"]["status"] == "ok"


def test_bitsandbytes_and_torchao_available_path():
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("torchao.optim")
    # torchao compiles per shape (seconds on a CPU); eager mode runs the same optimizer
    with torch.compiler.set_stance("force_eager"):
        rows = by_name(run_kernels(numel=[8192], config=["bred-4bit"],
                                   baseline=["bnb-adamw8bit", "torchao-adamw4bit"]))
    bnb, ao = rows["bnb-adamw8bit"], rows["torchao-adamw4bit"]
    assert bnb["status"] == "ok" and bnb["path"] == "bnb" and bnb["compile_ms"] is None
    assert bnb["config"] == "m=de8:nearest:b256,v=de8u:nearest:b256"
    assert bnb["bytes_per_elem"] == 12 + 2 * 2 * (1 + 4 / 256)
    assert ao["status"] == "ok", ao["reason"]
    assert ao["path"] == "torchao" and ao["compile_ms"] >= 0 and ao["bytes_per_elem"] == 14.125
    # their real state after one step, against the bytes model
    mem = by_name(memory.run(memory.plan(MemoryOptions(numel=[8192], config=["bred-4bit"],
                                                       baseline=["bnb-adamw8bit", "torchao-adamw4bit"]))))
    # bitsandbytes: codes + absmax of m and v, plus its two 256-entry fp32 code books
    assert mem["bnb-adamw8bit"]["state_bytes"] == mem["bnb-adamw8bit"]["expected_state_bytes"] + 2 * 256 * 4
    assert mem["bnb-adamw8bit"]["expected_state_bytes"] == 2 * (8192 + 32 * 4)
    ao_mem = mem["torchao-adamw4bit"]
    assert ao_mem["expected_state_bytes"] == 2 * (4096 + 64 * 4) == mem["bred-4bit"]["expected_state_bytes"]
    assert 0 <= ao_mem["state_bytes"] - ao_mem["expected_state_bytes"] < 0.05 * ao_mem["expected_state_bytes"]


def _failing_steps(monkeypatch, exc, groups=None):
    """Make every step of the first `groups` groups (None: all) raise `exc` (when timed)."""
    real, calls = group.measure_rounds, []

    def boom():
        raise exc

    def rounds(items, *args, **kw):
        calls.append(1)
        if groups is None or len(calls) <= groups:
            items = [Item(boom) for _ in items]
        return real(items, *args, **kw)

    monkeypatch.setattr(group, "measure_rounds", rounds)


def test_out_of_memory_marks_the_row_failed_and_the_sweep_goes_on(monkeypatch):
    _failing_steps(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), groups=1)
    rows = run_kernels(numel=[4096, 8192], config=["nearest-4bit"], baseline=["none"])
    assert [(r["numel"], r["status"]) for r in rows] == [(4096, "ok"), (4096, "failed"), (8192, "ok")]
    assert rows[1]["reason"].startswith("out of memory")


def test_out_of_memory_allocating_a_size_fails_its_rows_only(monkeypatch):
    real = workset.Tensors

    def tensors(shapes, *args):
        if shapes == [(8192,)]:
            raise RuntimeError("CUDA error: out of memory")
        return real(shapes, *args)

    monkeypatch.setattr(workset, "Tensors", tensors)
    rows = run_kernels(numel=[8192, 4096], config=["nearest-4bit"], baseline=["torch-fused"])
    assert [(r["name"], r["numel"], r["status"]) for r in rows[1:]] == [
        ("nearest-4bit", 8192, "failed"), ("torch-fused", 8192, "failed"),
        ("nearest-4bit", 4096, "ok"), ("torch-fused", 4096, "ok")]
    assert "out of memory allocating 8,192 elements" in rows[1]["reason"]


def test_a_bug_in_a_row_is_failed_not_fatal(monkeypatch):
    _failing_steps(monkeypatch, ValueError("boom"))
    rows = run_kernels(numel=[4096], config=["nearest-4bit"], baseline=["torch-fused"])
    assert rows[1]["status"] == "failed" and rows[1]["reason"] == "ValueError: boom"
    assert rows[2]["status"] == "unavailable"  # a baseline that raises cannot run here


@pytest.mark.parametrize("optimizer, baseline, states", [
    ("lion", "bnb-lion8bit", 1), ("sgd", "torch-fused", 1), ("muon", "torch-muon", 1)])
def test_one_state_optimizers_and_their_baselines(optimizer, baseline, states):
    if baseline.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
    rows = by_name(run_kernels(optimizer=optimizer, numel=[4096], config=["bred-4bit"], baseline=[baseline]))
    ours = rows["bred-4bit"]
    assert ours["status"] == "ok" and ours["optimizer"] == optimizer
    assert ours["bytes_per_elem"] == 12 + states * 2 * (0.5 + 4 / 128)
    if baseline == "torch-muon" and not hasattr(torch.optim, "Muon"):
        assert rows[baseline]["status"] == "unavailable"  # test_torch_muon_missing_is_unavailable
        pytest.skip(f"torch {torch.__version__} has no torch.optim.Muon (new in torch 2.9): the torch-muon "
                    f"baseline cannot run")
    assert rows[baseline]["status"] == "ok", rows[baseline]["reason"]


def test_torch_muon_missing_is_unavailable(monkeypatch):
    """A torch without torch.optim.Muon (before 2.9): the torch-muon row says so, the sweep goes on."""
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    rows = by_name(run_kernels(optimizer="muon", numel=[4096], config=["bred-4bit"], baseline=["torch-muon"]))
    assert rows["bred-4bit"]["status"] == "ok"
    row = rows["torch-muon"]
    assert row["status"] == "unavailable" and row["time_ms"] is None
    assert row["reason"] == f"torch {torch.__version__} has no torch.optim.Muon"


def test_default_baselines_follow_bits():
    names = lambda bits: [s.name for s, _ in kernels.plan(KernelsOptions(bits=bits)).subjects]  # noqa: E731
    assert names(4) == ["nearest-4bit", "sr-4bit", "bred-4bit", "torchao-4bit", "torch-fused", "torch-foreach",
                        "bf16-states", "bnb-adamw8bit", "torchao-adamw4bit"]
    assert "torchao-adamw8bit" in names(8) and "torchao-adamw4bit" not in names(8)
    every = kernels.plan(KernelsOptions(baseline=["all"])).subjects
    assert {"torchao-adamw4bit", "torchao-adamw8bit"} <= {s.name for s, _ in every}


def test_suite_points():
    out = hook_for("kernels")({"numel": "2^12", "config": "bred-4bit", "baseline": "none", "rep_ms": 1,
                               "warmup_ms": 0, "copy_numel": 4096})
    assert [(r["name"], r["status"]) for r in out["records"]] == [("copy", "ok"), ("bred-4bit", "ok")]
    mem = hook_for("memory")({"numel": [8192], "config": ["nearest-4bit"], "baseline": ["none"]})
    assert mem["records"][0]["expected_state_bytes"] == 2 * (4096 + 64 * 4)
    with pytest.raises(QstateError, match="unknown parameter 'json'"):
        hook_for("kernels")({"json": "out.json"})
    with pytest.raises(QstateError, match="did you mean numel"):
        hook_for("memory")({"numl": 5})


@pytest.mark.cuda
def test_cuda_rows_events_flush_graph_and_measured_memory():
    # backend "reference": this checks the bench machinery, whatever the kernels' state
    rows = run_kernels(device="cuda", numel=[1 << 20], dtype=["bf16"], config=["bred-4bit"], backend=["reference"],
                       baseline=["torch-fused"], copy_numel=1 << 24)
    for r in rows:
        assert r["device"] == "cuda" and r["l2_flush_bytes"] > 0, r
    assert rows[0]["status"] == "ok" and rows[2]["status"] == "ok"
    graph = run_kernels(device="cuda", numel=[1 << 20], config=["bred-4bit"], baseline=["torch-fused"], backend=["reference"],
                        cuda_graph=True, copy_numel=1 << 24)
    assert graph[2]["status"] == "ok" and graph[2]["cuda_graph"]  # torch fused, capturable
    assert graph[1]["status"] in ("ok", "unavailable")            # ours: capture may be refused
    mem = by_name(memory.run(memory.plan(MemoryOptions(device="cuda", numel=[1 << 20], config=["bred-4bit"],
                                                       baseline=["torch-fused"], backend="reference"))))
    for r in mem.values():
        assert r["status"] == "ok" and r["measured_reason"] is None
        # the caching allocator rounds each tensor up (512 B blocks): measured >= counted
        assert r["state_bytes"] <= r["measured_state_bytes"] <= 1.01 * r["state_bytes"] + 64 * 1024
        assert r["peak_extra_mib"] >= 0


def test_flashoptim_and_transformer_engine_run_only_when_named_and_say_why_they_cannot():
    assert not {"flashoptim-adamw", "te-fusedadam"} & {s.name for s, _ in kernels.plan(KernelsOptions(bits=4)).subjects}
    rows = by_name(run_kernels(numel=[4096], config=["nearest-4bit"], baseline=["flashoptim-adamw", "te-fusedadam"]))
    for name, module in (("flashoptim-adamw", "flashoptim"), ("te-fusedadam", "transformer_engine")):
        row = rows[name]
        try:
            __import__(module)
        except Exception:  # noqa: BLE001 - not here: the row says so
            assert row["status"] == "unavailable" and module in row["reason"], row
        else:  # here (a GPU machine with .peers/): it ran or said why not
            assert row["status"] in ("ok", "unavailable"), row
    assert rows["flashoptim-adamw"]["bytes_per_elem"] == 12 + 2 * 2 * (1 + 2 / 32)  # fp32: no correction
    assert rows["te-fusedadam"]["bytes_per_elem"] == 28
