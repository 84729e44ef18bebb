"""`qstate doctor` on training-checkpoint folders (Hugging Face Trainer's checkpoint-N/,
accelerate's save_state) and on the files in them that are not an optimizer checkpoint:
the folder reads as its optimizer file, saying so; model.safetensors' header (read by
hand, with limits) gives shapes only where they are unambiguous; a .safetensors or .json
file passed directly is named for what it is."""
import json
import math

import pytest
import torch
from typer.testing import CliRunner

import qstate_cli.optim as qoptim
from qstate_cli.cli import app
from qstate_cli.doctor import folders
from qstate_cli.doctor.run import DoctorOptions, execute

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
runner = CliRunner()


def write_safetensors(path, shapes: dict) -> None:
    """A safetensors file as the format lays it out: 8-byte little-endian header length, the
    JSON header, then the (here zero) data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in sorted(shapes.items()):
        n = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(offset))


def mlp():
    torch.manual_seed(0)  # 0.weight 96x64 and 2.weight 64x96: the same element count, different shapes
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64))


def train(model, opt, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()


def hf_folder(tmp_path, opt_of, name="checkpoint-3", model_file=True):
    """A Trainer checkpoint folder: optimizer.pt (parameters by index), model.safetensors,
    trainer_state.json, scheduler.pt."""
    model = mlp()
    opt = opt_of(model)
    train(model, opt)
    d = tmp_path / name
    d.mkdir()
    torch.save(opt.state_dict(), d / "optimizer.pt")
    if model_file:
        write_safetensors(d / "model.safetensors", {n: tuple(t.shape) for n, t in model.state_dict().items()})
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": []}))
    torch.save({"last_epoch": 3}, d / "scheduler.pt")
    return d


def decay_groups(model):
    """As the Trainer builds its AdamW: weights with decay, biases without, from model.parameters()."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}],
                             lr=1e-3)


def doctor(*args):
    return runner.invoke(app, ["doctor", *map(str, args)])


def test_a_trainer_checkpoint_folder_reads_as_its_optimizer_pt(tmp_path):
    """It said 'a folder, but not a torch.distributed.checkpoint directory (no .metadata)'."""
    d = hf_folder(tmp_path, decay_groups)
    folder = execute(DoctorOptions(checkpoint=str(d)))
    direct = execute(DoctorOptions(checkpoint=str(d / "optimizer.pt")))
    keys = ("param", "group", "shape", "states", "state_bytes", "step", "errors")
    assert [[r[k] for k in keys] for r in folder.records] == [[r[k] for k in keys] for r in direct.records]
    assert [r["shape"] for r in folder.records] == ["96x64", "64x96", "96", "64"]
    assert folder.meta["checkpoint_file"] == str(d / "optimizer.pt") and "checkpoint_file" not in direct.meta
    (source,) = [f for f in folder.extras["findings"] if f["check"] == "source"]
    assert source["severity"] == "info" and source["message"].startswith(
        f"read optimizer.pt of this Hugging Face Trainer checkpoint folder ({d})")
    assert "parameters by index: optimizer.pt keeps no names" in source["message"]
    r = doctor(d)
    assert r.exit_code == 0 and "read optimizer.pt of this Hugging Face Trainer checkpoint folder" in r.output
    assert "healthy" in r.output


def test_qstate_flat_states_take_unambiguous_shapes_from_model_safetensors(tmp_path):
    """qstate's codes keep no shape: the header gives it where the element count has one shape
    (the biases), not for two weights of 6,144 elements shaped 96x64 and 64x96; by name where
    the optimizer was built from named_parameters (param_names)."""
    d = hf_folder(tmp_path, lambda m: qoptim.AdamW(m.parameters(), lr=1e-3, states="bred-4bit"))
    res = execute(DoctorOptions(checkpoint=str(d)))
    assert [(r["shape"], r["shape_known"]) for r in res.records] == [
        ("6,144 elements", False), ("96", True), ("6,144 elements", False), ("64", True)]
    (source,) = [f["message"] for f in res.extras["findings"] if f["check"] == "source"]
    assert "shapes from the header of model.safetensors for 2 parameter(s) whose states keep none" in source
    assert "2 left unknown" in source

    named = hf_folder(tmp_path, lambda m: qoptim.AdamW(m.named_parameters(), lr=1e-3, states="bred-4bit"),
                      name="named")
    res = execute(DoctorOptions(checkpoint=str(named)))
    assert [(r["param"], r["shape"]) for r in res.records] == [
        ("0.weight", "96x64"), ("0.bias", "96"), ("2.weight", "64x96"), ("2.bias", "64")]
    (source,) = [f["message"] for f in res.extras["findings"] if f["check"] == "source"]
    assert "by index" not in source and "left unknown" not in source

    bare = hf_folder(tmp_path, lambda m: qoptim.AdamW(m.parameters(), lr=1e-3, states="bred-4bit"), name="bare",
                     model_file=False)
    res = execute(DoctorOptions(checkpoint=str(bare)))
    assert not any(r["shape_known"] for r in res.records)
    assert any("(no model.safetensors beside it)" in f["message"] for f in res.extras["findings"])


def test_the_header_reader_matches_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    tensors = {"a.weight": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16), "c": torch.zeros(())}
    st.save_file(tensors, str(tmp_path / "m.safetensors"))
    shapes, n = folders.safetensors_shapes(tmp_path / "m.safetensors")
    assert shapes == {"a.weight": (3, 5), "b": (7,), "c": ()} and n > 0


def test_an_accelerate_folder_reads_optimizer_bin_and_names_the_others(tmp_path):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt)
    d = tmp_path / "state"
    d.mkdir()
    torch.save(opt.state_dict(), d / "optimizer.bin")
    torch.save(torch.optim.SGD(model.parameters(), lr=0.1).state_dict(), d / "optimizer_1.bin")
    res = execute(DoctorOptions(checkpoint=str(d), against=str(d)))
    assert res.meta["summary"]["errors"] == 0 and len(res.records) == 4
    messages = {f["check"]: f["message"] for f in res.extras["findings"]}
    assert messages["source"].startswith(f"read optimizer.bin of this accelerate save_state folder ({d}); "
                                         f"not optimizer_1.bin (pass it to check that one)")
    assert messages["against-source"].startswith(f"--against {d}: read optimizer.bin")


@pytest.mark.parametrize("header", [
    (2**62).to_bytes(8, "little") + b"{}",  # a length past the file
    (200_000).to_bytes(8, "little") + b"[" * 200_000,  # nesting deeper than the JSON parser recurses
    None,  # a header over the read limit (a sparse file: nothing is written)
    b"",  # a shape that is not non-negative integers
])
def test_a_hostile_model_header_is_not_used_and_costs_nothing(tmp_path, header):
    d = hf_folder(tmp_path, lambda m: qoptim.AdamW(m.parameters(), lr=1e-3, states="bred-4bit"))
    f = d / "model.safetensors"
    if header is None:
        n = folders.MAX_HEADER_BYTES + 1
        with f.open("wb") as fh:
            fh.write(n.to_bytes(8, "little"))
            fh.truncate(8 + n)
    elif header == b"":
        raw = json.dumps({"0.bias": {"dtype": "F32", "shape": [-96], "data_offsets": [0, 0]}}).encode()
        f.write_bytes(len(raw).to_bytes(8, "little") + raw)
    else:
        f.write_bytes(header)
    res = execute(DoctorOptions(checkpoint=str(d)))
    assert res.meta["summary"]["errors"] == 0 and not any(r["shape_known"] for r in res.records)
    (source,) = [f["message"] for f in res.extras["findings"] if f["check"] == "source"]
    assert f"{f}: " in source and "not used for shapes" in source


def test_files_of_a_checkpoint_folder_that_are_not_its_optimizer_say_what_they_are(tmp_path):
    """model.safetensors and trainer_state.json were 'not a torch.save zip archive (raw pickles
    are refused ...)'; a folder saved without its optimizer, 'not a torch.distributed.checkpoint'."""
    d = hf_folder(tmp_path, decay_groups)
    cases = {d / "model.safetensors": "a safetensors file of 4 tensors (model weights; no optimizer state)",
             d / "trainer_state.json": "a JSON file (the Hugging Face Trainer's step count and logs; no optimizer "
                                       "state)"}
    for path, what in cases.items():
        r = doctor(path)
        assert r.exit_code == 2 and "raw pickles" not in r.output and "Traceback" not in r.output
        assert f"{path}: {what}: pass {d / 'optimizer.pt'} or the folder {d}" in " ".join(r.output.split())
    (d / "optimizer.pt").unlink()
    r = doctor(d)
    assert r.exit_code == 2 and "saved without its optimizer: save_only_model=True?" in " ".join(r.output.split())
    r = doctor(d / "model.safetensors")
    assert "pass the optimizer checkpoint (optimizer.pt, optimizer.bin) or the checkpoint folder" in " ".join(
        r.output.split())
