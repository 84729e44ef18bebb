"""A tiny byte-level transformer language model on text that ships with Python.

Data: the English help topics in the standard library's `pydoc_data.topics` (about
460 kB: the language reference that `help()` shows), encoded as bytes (vocabulary 256),
split 90/10 into train and validation. Every Python has it, so a newcomer can train,
record a trace and diagnose it without downloading anything.

Model: token + position embeddings, `n_layer` pre-LayerNorm blocks (causal multi-head
attention via scaled_dot_product_attention, GELU MLP of width 4*d), final LayerNorm, and
an untied output head. The default (d=64, 2 layers, 4 heads, context 64) has ~0.14 M
parameters and trains at dozens of steps per second on 2 CPU cores.

Everything is seeded: the same (seed, batch_size, seq_len) gives the same batches and
the same initialization, so runs that differ only in optimizer state storage are
comparable step for step.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TinyLMConfig:
    vocab: int = 256  # bytes
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    seq_len: int = 64


SIZES = {
    "tiny-lm": TinyLMConfig(),
    "small-lm": TinyLMConfig(d_model=128, n_layer=4, n_head=4, seq_len=128),
}


@lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    """The standard library's pydoc topics, concatenated in key order."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


@lru_cache(maxsize=2)
def corpus(split: str) -> torch.Tensor:
    """uint8 tensor of the train (first 90%) or val (last 10%) bytes."""
    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8)
    cut = int(0.9 * data.numel())
    if split == "train":
        return data[:cut].clone()
    if split == "val":
        return data[cut:].clone()
    raise ValueError(f"split must be train or val, not {split!r}")


def batches(split: str, batch_size: int, seq_len: int, seed: int):
    """Endless deterministic stream of (inputs, targets), int64 [batch, seq_len]."""
    data = corpus(split)
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=g)
        chunk = data[starts[:, None] + offsets].long()
        yield chunk[:, :-1], chunk[:, 1:]


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):  # x: [B, T, d]
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (B, T, self.n_head, d // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))  # [B, h, T, d/h]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyLMConfig = TinyLMConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx):  # idx: [B, T] int64 -> logits [B, T, vocab]
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))

    def loss(self, idx, targets) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def named_shapes(cfg: TinyLMConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of TinyLM(cfg).named_parameters(), in its order, without building it
    (a model on the meta device initializes through torch._refs, whose import of dynamo
    cost `bench memory` and `suite validate` 1-2 s)."""
    d, out = cfg.d_model, [("tok.weight", (cfg.vocab, cfg.d_model)), ("pos.weight", (cfg.seq_len, cfg.d_model))]
    for i in range(cfg.n_layer):
        out += [(f"blocks.{i}.{name}", shape) for name, shape in (
            ("ln1.weight", (d,)), ("ln1.bias", (d,)), ("qkv.weight", (3 * d, d)), ("qkv.bias", (3 * d,)),
            ("proj.weight", (d, d)), ("proj.bias", (d,)), ("ln2.weight", (d,)), ("ln2.bias", (d,)),
            ("fc.weight", (4 * d, d)), ("fc.bias", (4 * d,)), ("out.weight", (d, 4 * d)), ("out.bias", (d,)))]
    return out + [("ln.weight", (d,)), ("ln.bias", (d,)), ("head.weight", (cfg.vocab, d))]


def build(name: str = "tiny-lm", seed: int = 0) -> TinyLM:
    """The model named `name` with a seeded initialization."""
    if name not in SIZES:
        from ..errors import QstateError
        from ..quant.formats import suggest

        raise QstateError(f"unknown model {name!r}{suggest(name, SIZES)}")
    torch.manual_seed(seed)
    return TinyLM(SIZES[name])


@torch.no_grad()
def evaluate(model: TinyLM, batch_size: int = 32, n_batches: int = 8, seed: int = 1234) -> float:
    """Mean validation loss (nats per byte) over fixed, seeded batches."""
    was_training = model.training
    model.eval()
    it = batches("val", batch_size, model.cfg.seq_len, seed)
    losses = [float(model.loss(*next(it))) for _ in range(n_batches)]
    model.train(was_training)
    return sum(losses) / len(losses)
