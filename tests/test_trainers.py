"""Recording from trainers: the Recorder copies the gradients the optimizer reads (also
for a step called with a closure, and whatever zero_grad does), and the Hugging Face and
Lightning callbacks write the same trace as the plain Recorder on the same run. Small
models built from configs in the test: no weights are downloaded."""
import pytest
import torch

from qstate_cli.errors import QstateError
from qstate_cli.trace import Recorder, load_trace
from qstate_cli.trace.trainers import RecordingSession, pick_optimizer, unwrap_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

STEPS = 5


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batches(n=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 24, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def plain_trace(tmp_path, style: str):
    """The same run recorded with the plain Recorder, the loop written in `style`."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = tmp_path / f"{style}.pt"
    with Recorder(opt, path, model=model, blocks_per_tensor=None):
        for x, y in batches():
            if style == "zero-before":
                opt.zero_grad(set_to_none=True)
                loss_of(model, x, y).backward()
                opt.step()
            elif style == "zero-after":
                loss_of(model, x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:  # closure: the gradients are made inside step()

                def closure(x=x, y=y):
                    opt.zero_grad()
                    loss = loss_of(model, x, y)
                    loss.backward()
                    return loss

                opt.step(closure) if style == "closure-arg" else opt.step(closure=closure)
    return load_trace(path), model


def hand_grads():
    """The gradients of each step, computed by hand (what the trace must hold)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for x, y in batches():
        opt.zero_grad()
        loss_of(model, x, y).backward()
        out.append([p.grad.detach().reshape(-1).clone() for p in model.parameters()])
        opt.step()
    return out


def assert_same_trace(a, b):
    assert (a.n_steps, a.step_start, a.optimizer) == (b.n_steps, b.step_start, b.optimizer)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert torch.equal(ta.blocks, tb.blocks)
        assert torch.equal(ta.grads, tb.grads), ta.name


@pytest.mark.parametrize("style", ["zero-before", "zero-after", "closure-arg", "closure-kw"])
def test_recorder_copies_the_gradients_the_step_reads(tmp_path, style):
    trace, _ = plain_trace(tmp_path, style)
    want = hand_grads()
    assert trace.n_steps == STEPS
    for t in trace.tensors:
        for step in range(STEPS):
            assert torch.equal(t.grads[step], want[step][t.index]), (style, t.name, step)


def test_session_unwraps_trainer_optimizers_and_checks_options(tmp_path):
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)

    class Wrapper:  # accelerate's AcceleratedOptimizer keeps the torch optimizer here
        optimizer = opt

    assert unwrap_optimizer(Wrapper()) is opt
    with pytest.raises(QstateError, match="unknown recorder option"):
        RecordingSession(tmp_path / "t.pt", block_per_tensor=4)
    session = RecordingSession(tmp_path / "t.pt")
    session.start(opt)  # no optimizer step: nothing is written
    assert session.recorder is not None and session.finish() is None and not (tmp_path / "t.pt").exists()


class NoGroups(torch.optim.Optimizer):
    """Lightning's _MockOptimizer, built without lightning: what trainer.optimizers holds when
    configure_optimizers returns None (no parameter groups; step only runs the closure)."""

    def __init__(self):
        super().__init__([torch.zeros(1)], {})

    def add_param_group(self, param_group):
        pass

    def step(self, closure=None):
        return closure() if closure is not None else None


def test_session_without_an_optimizer_says_so_and_lets_training_go_on(tmp_path, capsys):
    """The Lightning callback crashed a run without an optimizer (IndexError on param_groups[0])."""
    class Wrapper:
        optimizer = NoGroups()

    for optimizer in (None, NoGroups(), Wrapper()):
        session = RecordingSession(tmp_path / "t.pt")
        session.start(optimizer)
        assert capsys.readouterr().err == "qstate: no optimizer to record: nothing recorded\n"
        assert session.recorder is None and session.finish() is None and not (tmp_path / "t.pt").exists()
    assert pick_optimizer([], 0) is None


def test_session_passes_hparams_and_optimizer_name_to_the_recorder(tmp_path):
    """The Recorder's hparams= (and optimizer_name=, which its own warning tells users to pass)
    were refused by the callbacks as unknown options."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = RecordingSession(tmp_path / "t.pt", hparams={"betas": [0.5, 0.6], "eps": 1e-6}, optimizer_name="adam")
    session.start(opt, model)
    for x, y in batches(2):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    trace = load_trace(session.finish())
    assert trace.hparams == {"betas": [0.5, 0.6], "eps": 1e-6} and trace.optimizer == "adam" and trace.n_steps == 2


def test_picking_one_of_several_optimizers_says_which(capsys):
    """Lightning with several optimizers recorded optimizers[0] silently."""
    first, second = torch.optim.SGD(mlp().parameters(), lr=0.1), torch.optim.AdamW(mlp().parameters())
    assert pick_optimizer([first], 0) is first and capsys.readouterr().err == ""
    assert pick_optimizer([first, second], 0) is first
    assert ("qstate: records optimizer 0 of 2 (SGD); optimizer=1 picks another (start/steps count that optimizer's "
            "steps)") in capsys.readouterr().err
    assert pick_optimizer([first, second], 1) is second
    assert "records optimizer 1 of 2 (AdamW); optimizer=0 picks another" in capsys.readouterr().err
    with pytest.raises(QstateError, match=r"optimizer=2: this run has 2 optimizers \(optimizer=0..1\)"):
        pick_optimizer([first, second], 2)


# -- Lightning -----------------------------------------------------------------------------

def lightning_trainer(L, callbacks, steps=STEPS):
    return L.Trainer(max_steps=steps, callbacks=callbacks, accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_lightning_callbacks_keep_each_recorded_groups_hyper_parameters(tmp_path, capsys):
    """Two callbacks recording one group each (include=) both kept group 0's betas."""
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install 'qstate-cli[trainers]')")
    from qstate_cli.trace.lightning import QstateTraceCallback

    class Two(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(24, 16), torch.nn.Linear(16, 4)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.b(torch.tanh(self.a(x))), y)

        def configure_optimizers(self):
            return torch.optim.AdamW([{"params": self.a.parameters()},
                                      {"params": self.b.parameters(), "betas": (0.8, 0.99)}], lr=1e-2)

    a = QstateTraceCallback(tmp_path / "a.pt", include=r"^a\.", blocks_per_tensor=None)
    b = QstateTraceCallback(tmp_path / "b.pt", include=r"^b\.", blocks_per_tensor=None)
    c = QstateTraceCallback(tmp_path / "c.pt", include=r"^b\.", hparams={"betas": [0.5, 0.6]})
    lightning_trainer(L, [a, b, c]).fit(Two(), train_dataloaders=torch.utils.data.DataLoader(batches(), batch_size=None))
    assert load_trace(a.path).hparams["betas"] == [0.9, 0.999]
    assert load_trace(b.path).hparams["betas"] == [0.8, 0.99] and [t.name for t in load_trace(b.path).tensors] == [
        "b.weight", "b.bias"]
    assert load_trace(c.path).hparams == {"betas": [0.5, 0.6]}
    assert "differ" not in capsys.readouterr().err


def test_lightning_run_without_an_optimizer_trains_and_records_nothing(tmp_path, capsys):
    """configure_optimizers returning None is a valid run: the callback crashed it."""
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install 'qstate-cli[trainers]')")
    from qstate_cli.trace.lightning import QstateTraceCallback

    class NoOptimizer(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.steps = 0

        def training_step(self, batch, _):
            self.steps += 1
            return loss_of(self.net, *batch)

        def configure_optimizers(self):
            return None

    module, callback = NoOptimizer(), QstateTraceCallback(tmp_path / "t.pt")
    lightning_trainer(L, [callback], steps=3).fit(module, train_dataloaders=torch.utils.data.DataLoader(
        batches(), batch_size=None))
    assert module.steps == 3 and callback.path is None and not (tmp_path / "t.pt").exists()
    assert "qstate: no optimizer to record: nothing recorded" in capsys.readouterr().err


def test_lightning_callback_records_the_optimizer_it_is_told(tmp_path, capsys):
    """With several optimizers it recorded optimizers[0] only, silently; optimizer= picks one."""
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install 'qstate-cli[trainers]')")
    from qstate_cli.trace.lightning import QstateTraceCallback

    class TwoOptimizers(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(24, 16), torch.nn.Linear(16, 4)

        def training_step(self, batch, _):
            x, y = batch
            for opt in self.optimizers():
                opt.zero_grad()
            self.manual_backward(torch.nn.functional.cross_entropy(self.b(torch.tanh(self.a(x))), y))
            for opt in self.optimizers():
                opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.AdamW(self.b.parameters(), lr=1e-2)

    callback = QstateTraceCallback(tmp_path / "b.pt", optimizer=1, blocks_per_tensor=None)
    lightning_trainer(L, [callback]).fit(TwoOptimizers(), train_dataloaders=torch.utils.data.DataLoader(
        batches(), batch_size=None))
    trace = load_trace(callback.path)
    assert trace.optimizer == "adamw" and [t.name for t in trace.tensors] == ["b.weight", "b.bias"]
    # trainer.global_step counts both optimizers' steps (max_steps=5 ends in the third batch); the trace
    # counts the recorded optimizer's own: 3
    assert trace.n_steps == 3 and trace.step_start == 1
    assert "qstate: records optimizer 1 of 2 (AdamW); optimizer=0 picks another" in capsys.readouterr().err
    with pytest.raises(QstateError, match="an index into trainer.optimizers"):
        QstateTraceCallback(tmp_path / "x.pt", optimizer=-1)


def test_lightning_callback_trace_equals_the_plain_recorder(tmp_path):
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install 'qstate-cli[trainers]')")
    from qstate_cli.trace.lightning import QstateTraceCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, _):
            x, y = batch
            return loss_of(self.net, x, y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = [b for b in batches()]
    callback = QstateTraceCallback(tmp_path / "lightning.pt", blocks_per_tensor=None)
    trainer = L.Trainer(max_steps=STEPS, callbacks=[callback], accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    got = load_trace(callback.path)
    want, _ = plain_trace(tmp_path, "zero-before")
    assert [t.name for t in got.tensors] == [f"net.{t.name}" for t in want.tensors]
    for t in got.tensors:
        t.name = t.name.removeprefix("net.")
    assert_same_trace(got, want)


def test_lightning_callback_writes_the_steps_before_an_error(tmp_path):
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install 'qstate-cli[trainers]')")
    from qstate_cli.trace.lightning import QstateTraceCallback

    class Failing(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, index):
            if index == 3:
                raise RuntimeError("boom at step 4")
            return loss_of(self.net, *batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = QstateTraceCallback(tmp_path / "partial.pt")
    trainer = L.Trainer(max_steps=STEPS, callbacks=[callback], accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing(), train_dataloaders=torch.utils.data.DataLoader(batches(), batch_size=None))
    assert load_trace(tmp_path / "partial.pt").n_steps == 3


# -- Hugging Face ----------------------------------------------------------------------------

def hf_trainer(tmp_path, callbacks=(), accumulation=1, **extra):
    transformers = pytest.importorskip("transformers",
                                       reason="transformers is not installed (pip install 'qstate-cli[trainers]')")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16), generator=g)]
    args = transformers.TrainingArguments(**{
        "output_dir": str(tmp_path / "hf"), "max_steps": STEPS, "learning_rate": 1e-3, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": accumulation, "max_grad_norm": 1.0, "report_to": [], "save_strategy": "no",
        "logging_strategy": "no", "use_cpu": True, "seed": 0, "disable_tqdm": True, **extra})
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))


def test_hf_callback_trace_equals_the_plain_recorder(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'qstate-cli[trainers]')")
    from qstate_cli.trace.hf import QstateTraceCallback

    callback = QstateTraceCallback(tmp_path / "hf.pt", blocks_per_tensor=2)
    trainer = hf_trainer(tmp_path, [callback], accumulation=2)
    with callback:
        trainer.train()
    got = load_trace(callback.path)
    assert got.n_steps == STEPS  # optimizer steps, not the 2 x STEPS micro-batches

    # the same run with a plain Recorder on the optimizer the Trainer will use
    trainer = hf_trainer(tmp_path, accumulation=2)
    trainer.create_optimizer()
    with Recorder(trainer.optimizer, tmp_path / "plain.pt", model=trainer.model, blocks_per_tensor=2):
        trainer.train()
    assert_same_trace(got, load_trace(tmp_path / "plain.pt"))
    names = {n for n, _ in trainer.model.named_parameters()}
    assert {t.name for t in got.tensors} <= names
    assert all(float(t.grads.float().abs().max()) > 0 for t in got.tensors if "wte" in t.name)


def test_hf_callback_writes_the_steps_before_ctrl_c(tmp_path):
    transformers = pytest.importorskip("transformers",
                                       reason="transformers is not installed (pip install 'qstate-cli[trainers]')")
    from qstate_cli.trace.hf import QstateTraceCallback

    class CtrlC(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise KeyboardInterrupt

    callback = QstateTraceCallback(tmp_path / "partial.pt")
    trainer = hf_trainer(tmp_path, [callback, CtrlC()])
    with pytest.raises(KeyboardInterrupt), callback:
        trainer.train()
    assert load_trace(tmp_path / "partial.pt").n_steps == 2


def test_hf_callback_reused_for_a_resumed_run_says_where_it_records_and_what_it_replaces(tmp_path, capsys):
    """Reusing one callback for train(resume_from_checkpoint=...) recorded from the resumed step on,
    whatever start said, and replaced the first trace, both silently. The replacement stays."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'qstate-cli[trainers]')")
    from qstate_cli.trace.hf import QstateTraceCallback

    callback = QstateTraceCallback(tmp_path / "t.pt", start=2, steps=2, blocks_per_tensor=1)
    with callback:
        hf_trainer(tmp_path, [callback], max_steps=4, save_strategy="steps", save_steps=2).train()
    first = load_trace(tmp_path / "t.pt")
    assert (first.step_start, first.n_steps) == (2, 2)
    assert "is before" not in capsys.readouterr().err
    with callback:
        hf_trainer(tmp_path, [callback], max_steps=4, save_strategy="no").train(
            resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-2"))
    err = capsys.readouterr().err
    assert "qstate: start=2 is before this run's first step 3 (a resumed run): recording from 3" in err
    assert f"qstate: replacing {tmp_path / 't.pt'} (steps 2..3)" in err
    second = load_trace(tmp_path / "t.pt")
    assert (second.step_start, second.n_steps) == (3, 2)
