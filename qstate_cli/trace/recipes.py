"""How each corpus trace is recorded (corpus.py names them): real training loops, or a
synthetic gradient process, all seeded, on one CPU thread, through the public Recorder.

Each recipe is `record(out, steps, seed, log) -> summary dict` and writes one trace file,
whole or not at all (Recorder(partial=False): the file is a cache entry named by its steps).
Nothing is downloaded: the data ship with Python (pydoc topics) or with a package
(scikit-learn's digits).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch

from ..runtime import torch_threads
from .recorder import Recorder

Log = Callable[[str], None] | None


# -- synthetic-heavy -------------------------------------------------------------------

SYNTH_TENSORS = 4  # tensors of SYNTH_NUMEL elements, one magnitude decade apart
SYNTH_NUMEL = 2048
SYNTH_DOF = 3.0  # Student-t degrees of freedom: finite variance, infinite kurtosis
SYNTH_REGIME = 750  # steps between regime changes of a tensor's gradient scale
SYNTH_SPIKE_P = 0.005  # per tensor and step: a x20 gradient spike


class HeavyTailedGradients:
    """A heavy-tailed, non-stationary gradient process (one tensor j, element i, step t):

        g = a(t) * r_j(t // 750) * spike_j(t) * 10**-j * s_i * (mu_i + eps / sqrt(3))

    s_i = exp(1.5 z) (log-normal element scales: magnitudes within a block spread over
    decades, as real layers' do), mu_i ~ 0.3 N(0, 1) (a persistent signal),
    eps ~ Student-t with 3 degrees of freedom (unit variance after / sqrt(3); heavy tails),
    a(t) = 10**(-t / (2 T)) (g^2 falls tenfold over the T steps, as over a fine-tune),
    r_j = exp(0.5 z) per regime of 750 steps, spike_j = 20 with probability 0.005.
    """

    def __init__(self, steps: int, seed: int, numel: int = SYNTH_NUMEL):
        self.steps, self.numel = steps, numel
        self.gen = torch.Generator().manual_seed(seed)
        n = (SYNTH_TENSORS, numel)
        self.s = torch.exp(1.5 * torch.randn(n, generator=self.gen))
        self.s *= (10.0 ** -torch.arange(SYNTH_TENSORS, dtype=torch.float32))[:, None]
        self.mu = 0.3 * torch.randn(n, generator=self.gen)
        self.t_dist = torch.distributions.StudentT(SYNTH_DOF)
        self.regime = torch.ones(SYNTH_TENSORS)

    def __call__(self, t: int) -> torch.Tensor:
        """Gradients of step t (0-based), [tensors, numel] fp32."""
        if t % SYNTH_REGIME == 0:
            self.regime = torch.exp(0.5 * torch.randn(SYNTH_TENSORS, generator=self.gen))
        eps = self._student_t((SYNTH_TENSORS, self.numel)) / math.sqrt(SYNTH_DOF / (SYNTH_DOF - 2))
        spike = torch.where(torch.rand(SYNTH_TENSORS, generator=self.gen) < SYNTH_SPIKE_P, 20.0, 1.0)
        a = self.amplitude(t)
        return (a * self.regime * spike)[:, None] * self.s * (self.mu + eps)

    def amplitude(self, t: int) -> float:
        """a(t) = 10**(-t / (2 T)): the mean g^2 falls tenfold from step 0 to step T."""
        return 10.0 ** (-t / (2 * self.steps))

    def _student_t(self, shape) -> torch.Tensor:
        """Student-t samples from the seeded generator: z / sqrt(chi2_nu / nu), chi2 as a
        sum of nu squared normals (nu = 3)."""
        z = torch.randn(shape, generator=self.gen)
        chi2 = torch.randn((int(SYNTH_DOF), *shape), generator=self.gen).pow(2).sum(0)
        return z / torch.sqrt(chi2 / SYNTH_DOF)


def record_synthetic(out: Path, steps: int, seed: int, log: Log = None, numel: int = SYNTH_NUMEL) -> dict:
    """The corpus recipe (4 tensors of `numel` elements; the corpus uses SYNTH_NUMEL, the
    replay benchmark scripts/bench_replay.py a larger numel)."""
    t0 = time.perf_counter()
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(SYNTH_TENSORS)]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    process = HeavyTailedGradients(steps, seed, numel)
    meta = {"source": "qstate corpus", "model": "synthetic-heavy",
            "data": "heavy-tailed non-stationary synthetic gradients (trace/recipes.py)"}
    with torch_threads(1), Recorder(opt, out, blocks_per_tensor=None, steps=steps, seed=seed, grad_dtype="bf16",
                                    meta=meta, partial=False) as rec:
        for t in range(steps):
            g = process(t)
            for j, p in enumerate(params):
                p.grad = g[j].clone()
            opt.step()
            _progress(log, t + 1, steps, t0)
    return {"steps": steps, "recorded_elements": rec.n_rec, "train_s": round(time.perf_counter() - t0, 1)}


# -- digits-cnn ------------------------------------------------------------------------

def record_digits(out: Path, steps: int, seed: int, log: Log = None) -> dict:
    from ..models import digits_cnn

    digits_cnn.load(seed)  # fails fast (clear message) without scikit-learn
    t0 = time.perf_counter()
    with torch_threads(1):
        model = digits_cnn.build(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
        data = digits_cnn.batches(32, seed)
        meta = {"source": "qstate corpus", "model": "digits-cnn", "batch_size": 32,
                "data": "sklearn.datasets.load_digits (8x8 images)"}
        with Recorder(opt, out, model=model, blocks_per_tensor=2, steps=steps, seed=seed, grad_dtype="bf16",
                      meta=meta, partial=False) as rec:
            for step in range(1, steps + 1):
                x, y = next(data)
                loss = model.loss(x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                _progress(log, step, steps, t0, f"loss {float(loss.detach()):.3f}")
        acc = digits_cnn.accuracy(model, seed)
    return {"steps": steps, "recorded_elements": rec.n_rec, "train_loss": round(float(loss.detach()), 4),
            "val_accuracy": round(acc, 4), "train_s": round(time.perf_counter() - t0, 1)}


# -- the byte-level LMs (the demo's recipe) ----------------------------------------------

def lm_recipe(model: str, batch_size: int, lr: float, blocks_per_tensor: int):
    """A recipe that records the tiny-LM family through `qstate trace demo`'s code."""
    def record(out: Path, steps: int, seed: int, log: Log = None) -> dict:
        from .demo import DemoSettings, run_demo

        return run_demo(out, DemoSettings(steps=steps, model=model, batch_size=batch_size, lr=lr,
                                          blocks_per_tensor=blocks_per_tensor, seed=seed), log)
    return record


def _progress(log: Log, step: int, steps: int, t0: float, extra: str = "") -> None:
    if log and (step % max(1, steps // 5) == 0 or step == steps):
        log(f"step {step}/{steps}  {extra}  ({time.perf_counter() - t0:.0f} s)")
