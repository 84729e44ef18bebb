"""Recording from trainers: the Recorder copies the gradients the optimizer reads (also
for a step called with a closure, and whatever zero_grad does), and the Hugging Face and
Lightning callbacks write the same trace as the plain Recorder on the same run. Small
models built from configs in the test: no weights are downloaded."""
import pytest
import torch

from qstate_cli.errors import QstateError
from qstate_cli.trace import Recorder, load_trace
from qstate_cli.trace.trainers import RecordingSession, unwrap_optimizer

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


# -- Lightning -----------------------------------------------------------------------------

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

def hf_trainer(tmp_path, callbacks=(), accumulation=1):
    transformers = pytest.importorskip("transformers",
                                       reason="transformers is not installed (pip install 'qstate-cli[trainers]')")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=STEPS, learning_rate=1e-3,
                                          per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
                                          max_grad_norm=1.0, report_to=[], save_strategy="no", logging_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True)
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
