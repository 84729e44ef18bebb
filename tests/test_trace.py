"""Trace format v1: round trip, validation, hostile files, shards, atomic writes, the recorder."""
import pickle
import re
import zipfile
from pathlib import Path

import pytest
import torch

from qstate_cli.errors import QstateError
from qstate_cli.trace import BLOCK, Recorder, load_trace, sample_blocks, save_trace
from qstate_cli.trace.schema import from_dict

from test_trainers import NoGroups  # Lightning's stand-in when configure_optimizers returns None



pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))


def train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 80, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def record(tmp_path, name="t.pt", steps=5, **kw):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99))
    path = tmp_path / name
    with Recorder(opt, path, model=model, **kw) as rec:
        train(model, opt, steps)
    return path, rec, model


def test_round_trip_keeps_everything(tmp_path):
    path, rec, model = record(tmp_path, blocks_per_tensor=2, record_params=True, seed=7)
    tr = load_trace(path)
    assert tr.optimizer == "adamw" and tr.hparams["betas"] == [0.8, 0.99] and tr.hparams["lr"] == 1e-3
    assert tr.seed == 7 and tr.step_start == 1 and tr.n_steps == 5 and tr.grad_dtype == "fp32"
    names = [n for n, _ in model.named_parameters()]
    assert [t.name for t in tr.tensors] == names and [t.index for t in tr.tensors] == [0, 1, 2, 3]
    w = tr.tensors[0]  # 64 x 80 = 5120 elements: 3 blocks, 2 recorded
    assert w.shape == (64, 80) and w.blocks.tolist() == sample_blocks(5120, 2, 7, 0).tolist()
    assert w.grads.shape == (5, w.n_recorded) and w.init is not None
    torch.testing.assert_close(w.grads, rec.trace().tensors[0].grads, rtol=0, atol=0)
    # the recorded elements are the parameter's values at those flat indices
    idx = w.element_index()
    torch.testing.assert_close(w.init, small_model()[0].weight.detach().reshape(-1)[idx], rtol=0, atol=0)


def test_block_sampling_is_seeded_sorted_and_bounded():
    a = sample_blocks(50 * BLOCK + 7, 5, seed=1, tensor_index=3)
    assert a.tolist() == sample_blocks(50 * BLOCK + 7, 5, seed=1, tensor_index=3).tolist()
    assert a.numel() == 5 and bool((a.diff() > 0).all()) and int(a.max()) <= 50
    assert a.tolist() != sample_blocks(50 * BLOCK + 7, 5, seed=2, tensor_index=3).tolist()
    assert sample_blocks(100, 5, 0, 0).tolist() == [0]  # small tensors: everything


class Payload:
    """Pickles as a call to exec that writes a file: what a hostile trace would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def test_hostile_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned.txt"
    evil = tmp_path / "evil.pt"
    torch.save({"format": "qstate-trace", "schema_version": 1, "x": Payload(marker)}, evil)
    # the payload is live: an unsafe load runs it (proves the test can fail)
    live = tmp_path / "live.txt"
    torch.save({"x": Payload(live)}, tmp_path / "live.pt")
    torch.load(tmp_path / "live.pt", weights_only=False)
    assert live.exists()
    with pytest.raises(QstateError, match=r"evil\.pt: refused"):
        load_trace(evil)
    assert not marker.exists()
    raw = tmp_path / "raw.pt"  # a plain pickle (not a zip archive) never reaches an unpickler
    raw.write_bytes(pickle.dumps({"x": Payload(marker)}))
    with pytest.raises(QstateError, match="a raw pickle, refused because loading one can run code"):
        load_trace(raw)
    assert not marker.exists()


def test_truncated_corrupt_and_empty_files_are_refused(tmp_path):
    path, _, _ = record(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(QstateError, match=r"cut\.pt: "):
        load_trace(cut)
    flipped = bytearray(data)  # damage a stored tensor's bytes inside a valid archive
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 64)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    flipped[start: start + 8] = b"\xff" * 8
    bad = tmp_path / "crc.pt"
    bad.write_bytes(bytes(flipped))
    try:  # damaged tensor bytes either load (no CRC check on mmap) or are refused with one
        load_trace(bad)  # line; never another exception
    except QstateError as exc:
        assert "crc.pt" in str(exc)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(QstateError, match="empty file"):
        load_trace(tmp_path / "empty.pt")
    with pytest.raises(QstateError, match="no such trace"):
        load_trace(tmp_path / "missing.pt")


def _dict(tmp_path):
    path, rec, _ = record(tmp_path)
    return rec.trace().to_dict()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(schema_version=3), "newer than this qstate reads"),
    (lambda d: d.update(schema_version=0), "unsupported trace schema_version 0"),
    (lambda d: d.pop("seed"), "missing 'seed'"),
    (lambda d: d.update(format="other"), "not a qstate trace"),
    (lambda d: d.update(block_size=1024), "records blocks of 2048"),
    (lambda d: d.update(grad_dtype="fp8"), "grad_dtype 'fp8'"),
    (lambda d: d["tensors"][1].update(grads=torch.zeros(5, 3)), r"tensor 1 \('0.bias'\): grads have shape \(5, 3\)"),
    (lambda d: d["tensors"][0].update(blocks=torch.tensor([2, 1])), "ascending, distinct"),
    (lambda d: d["tensors"][0].update(grads=d["tensors"][0]["grads"].half()), "grads are torch.float16"),
    (lambda d: d["tensors"][2].update(name="0.weight"), "appears more than once"),
])
def test_schema_errors_name_the_file_and_the_problem(tmp_path, edit, message):
    d = _dict(tmp_path)
    edit(d)
    with pytest.raises(QstateError, match=message) as exc:
        from_dict(d, "x.pt")
    assert str(exc.value).startswith("x.pt: ") and "\n" not in str(exc.value)
    torch.save(d, tmp_path / "bad.pt")  # and the same through a file
    with pytest.raises(QstateError, match=message):
        load_trace(tmp_path / "bad.pt")


def test_sharded_directory_loads_as_one(tmp_path):
    import shutil

    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shards = tmp_path / "shards"
    with Recorder(opt, shards / "rank0.pt", model=model, include=r"^0\."), \
            Recorder(opt, shards / "rank1.pt", model=model, include=r"^2\."):
        train(model, opt, 4)
    tr = load_trace(shards)
    assert [t.name for t in tr.tensors] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [t.index for t in tr.tensors] == [0, 1, 2, 3] and tr.n_steps == 4
    assert len(tr.meta["shards"]) == 2
    with pytest.raises(QstateError, match="no parameters selected"):
        Recorder(opt, None, model=model, include="^9")
    dup = tmp_path / "dup"  # the same tensor in two shards
    dup.mkdir()
    shutil.copy(shards / "rank0.pt", dup / "a.pt")
    shutil.copy(shards / "rank0.pt", dup / "b.pt")
    with pytest.raises(QstateError, match="'0.weight' is in both"):
        load_trace(dup)
    other = tmp_path / "other"  # shards of different runs
    with Recorder(opt, other / "a.pt", model=model, include=r"^0\.bias$"):
        train(model, opt, 3)
    shutil.copy(shards / "rank1.pt", other / "b.pt")
    with pytest.raises(QstateError, match=r"no step is recorded by every shard \(a.pt: steps 5..7; b.pt: steps "
                                          r"1..4\); shards must come from one run"):
        load_trace(other)
    (tmp_path / "none").mkdir()
    with pytest.raises(QstateError, match="holds no"):
        load_trace(tmp_path / "none")


def test_writes_are_atomic(tmp_path, monkeypatch):
    path, rec, _ = record(tmp_path)
    before = path.read_bytes()
    tr = rec.trace()

    def boom(obj, f, *a, **k):  # save_trace hands torch.save an open file (trace/io.py)
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(QstateError, match=r": cannot write \(disk full\)$"):  # one line, not an OSError traceback
        save_trace(tr, path)
    assert path.read_bytes() == before  # the old trace is untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_recorder_bounds_steps_blocks_and_size(tmp_path):
    path, rec, _ = record(tmp_path, steps=10, start=3, blocks_per_tensor=1, grad_dtype="bf16",
                          include="weight")
    tr = load_trace(path)
    assert tr.step_start == 3 and tr.n_steps == 10 - 2 and tr.grad_dtype == "bf16"
    assert [t.name for t in tr.tensors] == ["0.weight", "2.weight"]
    assert tr.tensors[0].blocks.numel() == 1 and tr.tensors[0].grads.dtype == torch.bfloat16
    path, rec, _ = record(tmp_path, name="w.pt", steps=10, exclude="bias")
    assert [t.name for t in load_trace(path).tensors] == ["0.weight", "2.weight"]
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(QstateError, match="over max_mib"):
        Recorder(opt, None, model=model, steps=1000, max_mib=0.1)
    with Recorder(opt, tmp_path / "cap.pt", model=model, blocks_per_tensor=None, max_mib=0.1):
        train(model, opt, 20)  # open-ended: stops at the cap
    tr = load_trace(tmp_path / "cap.pt")
    assert tr.optimizer == "sgd" and tr.hparams["momentum"] == 0.9
    assert tr.n_steps == int(0.1 * 2**20 // (tr.recorded_elements * 4))


def test_recorder_keeps_nonfinite_gradients_and_zero_fills_unused_ones(tmp_path):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    rec = Recorder(opt, None, model=model)
    with rec:
        x = torch.randn(4, 80)
        model(x).sum().backward()
        model[0].weight.grad[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        model[2].bias.grad = None
        opt.step()
    tr = rec.trace()
    g = tr.tensors[0].grads[0]
    assert torch.isnan(g[0]) and torch.isposinf(g[1]) and torch.isneginf(g[2])
    assert torch.equal(tr.tensors[3].grads, torch.zeros(1, 3))


@pytest.mark.parametrize("doc", ["README.md", "docs/diagnose.md"])
def test_readme_example_runs(tmp_path, monkeypatch, doc):
    text = (Path(__file__).resolve().parents[1] / doc).read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "Recorder(" in c)
    assert len(code.strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{doc} recorder example", "exec"), {})
    tr = load_trace(tmp_path / "my_trace.pt")
    assert tr.optimizer == "adamw" and tr.n_steps == 100


def test_recorder_without_an_optimizer_hook(tmp_path):
    model = small_model()
    rec = Recorder(params=model.parameters(), optimizer_name="lion", hparams={"betas": [0.9, 0.99]},
                   blocks_per_tensor=None)
    for _ in range(3):
        model(torch.randn(2, 80)).sum().backward()
        rec.capture()
        model.zero_grad()
    tr = rec.trace()
    assert tr.optimizer == "lion" and tr.n_steps == 3 and tr.tensors[0].name == "param0"
    with pytest.raises(QstateError, match="needs an optimizer"):
        Recorder(params=model.parameters())
    rec = Recorder(None, tmp_path / "c.pt", params=model.parameters(), optimizer_name="adamw")  # no hparams=
    with rec:  # an AttributeError on the missing optimizer's param_groups before
        model(torch.randn(2, 80)).sum().backward()
        rec.capture()
    assert load_trace(tmp_path / "c.pt").hparams == {}


def test_recorder_samples_live_blocks_and_warns_about_zero_tensors(tmp_path, capsys):
    """An embedding of 16 blocks whose training touches only rows 0..59 (blocks 0 and 1):
    the sampled blocks are those two, not the hash's first choice among dead ones; a tensor
    that never gets a gradient is named on stderr and in the trace's meta."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(512, 64)  # 32768 elements = 16 blocks of 2048 (32 rows each)
    unused = torch.nn.Linear(64, 64)
    model = torch.nn.ModuleDict({"emb": emb, "unused": unused})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dead_choice = sample_blocks(emb.weight.numel(), 2, 0, 0)
    assert not set(dead_choice.tolist()) <= {0, 1}  # without looking, the hash picks dead blocks
    with Recorder(opt, tmp_path / "e.pt", model=model, blocks_per_tensor=2) as rec:
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            loss = emb(torch.randint(0, 60, (8,), generator=g)).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    err = capsys.readouterr().err
    assert "unused.weight" in err and "zero at every one of 4 steps" in err
    tr = load_trace(tmp_path / "e.pt")
    assert tr.tensors[0].blocks.tolist() == [0, 1]
    assert tr.meta["zero_tensors"] == ["unused.weight", "unused.bias"] == rec.zero_tensors()


def test_recorder_says_which_groups_replay_with_the_first_groups_hyper_parameters(tmp_path, capsys):
    """The trace keeps param_groups[0]'s betas and eps, and the replay steps every tensor with
    them: a recorded group with other betas was replayed wrongly without a word. Groups
    differing only in what the replay does not read (lr, weight decay) are not named."""
    model = small_model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": weights, "betas": (0.9, 0.95), "eps": 1e-6},
                             {"params": biases, "betas": (0.8, 0.999), "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3)
    with Recorder(opt, tmp_path / "g.pt", model=model):
        train(model, opt, 3)
    err = capsys.readouterr().err
    assert ("these groups differ: param_groups[1]: betas [0.8, 0.999] (group 0: [0.9, 0.95]), eps 1e-08 "
            "(group 0: 1e-06)") in err and "lr" not in err.split("differ:")[1] and "weight_decay" not in err
    assert load_trace(tmp_path / "g.pt").hparams["betas"] == [0.9, 0.95]
    with Recorder(opt, tmp_path / "w.pt", model=model, include="weight"):  # group 1 not recorded: no word
        train(model, opt, 2)
    assert "differ" not in capsys.readouterr().err
    opt = torch.optim.AdamW([{"params": weights}, {"params": biases, "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3)
    with Recorder(opt, tmp_path / "l.pt", model=model):
        train(model, opt, 2)
    assert "differ" not in capsys.readouterr().err


def test_a_recorder_that_never_reached_its_start_says_so(tmp_path, capsys):
    """start=200 on a 5-step run wrote no file and said nothing."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(opt, tmp_path / "late.pt", model=model, start=200, steps=50):
        train(model, opt, 5)
    assert not (tmp_path / "late.pt").exists()
    assert ("no step recorded, so no trace written to " + str(tmp_path / "late.pt") + " (the optimizer took 5 "
            "steps; start=200)") in capsys.readouterr().err


def test_recording_an_optimizer_the_replay_cannot_step_says_so_at_once(tmp_path, capsys):
    """RMSprop recorded silently; only `qstate diagnose` refused the finished trace."""
    model = small_model()
    Recorder(torch.optim.RMSprop(model.parameters()), None, model=model)
    assert "this records 'rmsprop', which `qstate diagnose` will refuse: pass optimizer_name=" in capsys.readouterr().err
    Recorder(torch.optim.RMSprop(model.parameters()), None, model=model, optimizer_name="adam")
    assert capsys.readouterr().err == ""


def test_trace_info_counts_dead_blocks(tmp_path):
    import json
    import subprocess
    import sys

    from typer.testing import CliRunner

    from qstate_cli.cli import app
    from qstate_cli.trace import synthetic

    trace = synthetic.with_dead_blocks(synthetic.gaussian(4 * BLOCK, 3), 3)
    path = save_trace(trace, tmp_path / "dead.pt")
    r = CliRunner().invoke(app, ["trace", "info", str(path), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["summary"]["dead_blocks"].startswith("3 of 4 recorded blocks")
    assert doc["tensors"][0]["dead_blocks"] == 3
    out = subprocess.run([sys.executable, "-m", "qstate_cli", "trace", "info", str(path)], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "COLUMNS": "200"})
    assert out.returncode == 0 and "3 of 4 recorded blocks" in out.stdout


def three_groups():
    """a, b, c in three groups of an AdamW: group 1 (b) with its own betas and seed, group 2 (c) other betas."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "b": torch.nn.Linear(16, 16),
                                 "c": torch.nn.Linear(16, 4)})
    opt = torch.optim.AdamW([{"params": model["a"].parameters()},
                             {"params": model["b"].parameters(), "betas": (0.8, 0.99), "seed": 7},
                             {"params": model["c"].parameters(), "betas": (0.7, 0.9)}], lr=1e-2)

    def steps(n):
        for _ in range(n):
            opt.zero_grad()
            model["c"](torch.tanh(model["b"](torch.tanh(model["a"](torch.randn(8, 16)))))).pow(2).mean().backward()
            opt.step()
    return model, opt, steps


def test_the_trace_keeps_the_hyper_parameters_of_the_recorded_group(tmp_path, capsys):
    """A trace recorded with include= choosing group 1's tensors kept group 0's betas (0.9, 0.999),
    and diagnose replayed it with the wrong beta2. It keeps the group of its first recorded
    tensor (its seed too), and names other recorded groups that differ."""
    model, opt, steps = three_groups()
    with Recorder(opt, tmp_path / "b.pt", model=model, include=r"^b\."):
        steps(3)
    trace = load_trace(tmp_path / "b.pt")
    assert [t.name for t in trace.tensors] == ["b.weight", "b.bias"]
    assert trace.hparams["betas"] == [0.8, 0.99] and trace.seed == 7 and trace.meta["hparams_group"] == 1
    assert "differ" not in capsys.readouterr().err
    with Recorder(opt, tmp_path / "bc.pt", model=model, exclude=r"^a\."):
        steps(2)
    assert load_trace(tmp_path / "bc.pt").hparams["betas"] == [0.8, 0.99]
    err = capsys.readouterr().err
    assert ("keeps the hyper-parameters of param_groups[1] (the group of the first recorded tensor, b.weight)" in err
            and "these groups differ: param_groups[2]: betas [0.7, 0.9] (group 1: [0.8, 0.99])" in err)
    with Recorder(opt, tmp_path / "a.pt", model=model, include=r"^a\."):
        steps(1)
    assert load_trace(tmp_path / "a.pt").hparams["betas"] == [0.9, 0.999]


def test_an_optimizer_without_parameter_groups_is_refused_in_one_line(tmp_path):
    """It raised IndexError (param_groups[0]) from inside the Recorder."""
    assert NoGroups().param_groups == []
    with pytest.raises(ValueError, match="cannot record NoGroups: it has no parameter groups") as info:
        Recorder(NoGroups(), tmp_path / "t.pt")
    assert isinstance(info.value, QstateError) and "\n" not in str(info.value)


def test_a_start_before_a_resumed_runs_first_step_is_said(tmp_path, capsys):
    """After a resume (the optimizer's state loaded: 3 steps taken), start=2 recorded 4..5 silently."""
    model, opt, steps = three_groups()
    steps(3)
    model2, opt2, steps2 = three_groups()
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(opt.state_dict())
    capsys.readouterr()
    with Recorder(opt2, tmp_path / "r.pt", model=model2, start=2, steps=2):
        steps2(3)
    assert ("qstate: start=2 is before this run's first step 4 (a resumed run): recording from 4"
            in capsys.readouterr().err)
    assert (load_trace(tmp_path / "r.pt").step_start, load_trace(tmp_path / "r.pt").n_steps) == (4, 2)
    with Recorder(opt2, tmp_path / "s.pt", model=model2, start=8, steps=1):  # at or after the first step: no note
        steps2(3)
    assert "is before" not in capsys.readouterr().err and load_trace(tmp_path / "s.pt").step_start == 8


def test_writing_over_an_earlier_trace_says_what_it_replaces(tmp_path, capsys):
    """One callback reused for a second train() replaced the first trace silently; the overwrite stays."""
    path = tmp_path / "t.pt"
    record(tmp_path, steps=3)
    assert "replacing" not in capsys.readouterr().err
    record(tmp_path, steps=2)
    assert f"qstate: replacing {path} (steps 1..3)" in capsys.readouterr().err
    assert load_trace(path).n_steps == 2
    (tmp_path / "old.pt").write_bytes(b"from before")
    record(tmp_path, name="old.pt", steps=1)
    assert f"replacing {tmp_path / 'old.pt'} (a file that was there before this recording)" in capsys.readouterr().err
    assert load_trace(tmp_path / "old.pt").n_steps == 1


def test_a_trace_keeps_every_hyper_parameter_a_registered_optimizer_takes(tmp_path):
    """The recorded keys are torch's usual ones plus every registered optimizer's own (a hand
    list missed Muon's Newton-Schulz settings, and would miss a new rule's)."""
    from qstate_cli.optim import Muon
    from qstate_cli.trace.hparams import HPARAM_KEYS

    assert {"ns_steps", "ns_coefficients", "adjust_lr_fn", "betas", "momentum"} <= set(HPARAM_KEYS)
    model = small_model()
    opt = Muon(model.parameters(), ns_steps=3, adjust_lr_fn="match_rms_adamw", states="fp32")
    with Recorder(opt, tmp_path / "m.pt", model=model):
        train(model, opt, 2)
    hp = load_trace(tmp_path / "m.pt").hparams
    assert hp["ns_steps"] == 3 and hp["adjust_lr_fn"] == "match_rms_adamw" and hp["momentum"] == 0.95
