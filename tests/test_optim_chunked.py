"""The reference steps a large tensor of an elementwise rule in chunks (optim/chunked.py):
bit for bit what it leaves stepping the tensor in one piece, for every preset, over steps,
resets, non-finite gradients, parameter dtypes, sizes that are not a multiple of the chunk
or of the block (a short last block), and a shard's nonzero offset (aligned or not)."""
from __future__ import annotations

import pytest
import torch

from qstate_cli.optim import chunked
from qstate_cli.optim.optimizers import SGD, Adam, AdamW, Lion, Muon
from qstate_cli.quant.config import PRESETS, parse_config
from qstate_cli.quant.quantizer import Stream
from qstate_cli.quant.state import QuantizedState

BUILD = {
    "adamw": lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "adam-l2": lambda ps, **kw: Adam(ps, lr=1e-2, weight_decay=0.1, **kw),
    "lion": lambda ps, **kw: Lion(ps, lr=1e-3, weight_decay=0.1, **kw),
    "sgd-nesterov": lambda ps, **kw: SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=True, **kw),
}
WHOLE = 1 << 40  # one chunk
STEP_IN_CHUNKS = chunked.step_in_chunks


def _grads(shape, steps: int, seed: int, nonfinite: bool) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        g = torch.randn(shape, generator=gen) * 10.0 ** (-i % 3)
        if nonfinite and i == 1:
            flat = g.view(-1)
            flat[3], flat[-1], flat[flat.numel() // 2] = float("nan"), float("inf"), -float("inf")
        out.append(g)
    return out


def _run(monkeypatch, chunk: int, build, config, shape, dtype, steps=4, reset=None, nonfinite=True, seed=0):
    """Parameter values and states after each step, stepped by the reference in chunks of `chunk`."""
    monkeypatch.setattr(chunked, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(seed + 1)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
    opt = build([p], states=config, reset=reset, seed=7, min_quant_numel=0, backend="reference")
    chunks = []
    monkeypatch.setattr(chunked, "step_in_chunks", lambda *a: (chunks.append(a[-1]), STEP_IN_CHUNKS(*a)))
    history = []
    for g in _grads(shape, steps, seed, nonfinite):
        p.grad = g.to(dtype)
        opt.step()
        st = opt.state[p]
        history.append((p.detach().clone(), {k: (v.clone() if isinstance(v, torch.Tensor) else
                                                  {kk: vv.clone() for kk, vv in v.items()}) for k, v in st.items()}))
    return history, chunks


def _same(a, b) -> None:
    for (pa, sa), (pb, sb) in zip(a, b, strict=True):
        assert pa.dtype == pb.dtype and torch.equal(pa.view(-1).view(torch.uint8), pb.view(-1).view(torch.uint8))
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], dict):
                assert sa[k].keys() == sb[k].keys(), k
                for kk in sa[k]:
                    x, y = sa[k][kk], sb[k][kk]
                    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (k, kk)
            else:
                assert torch.equal(sa[k], sb[k]), k


@pytest.mark.filterwarnings("ignore:AdamW v=e2m2")
@pytest.mark.parametrize("config", sorted(PRESETS))
def test_every_preset_steps_in_chunks_as_in_one_piece(monkeypatch, config):
    shape = (7, 301)  # 2107 elements: no multiple of any block or chunk
    whole, none = _run(monkeypatch, WHOLE, BUILD["adamw"], config, shape, torch.float32)
    parts, used = _run(monkeypatch, 1, BUILD["adamw"], config, shape, torch.float32)
    assert not none
    if parse_config(config).spec("m").tensor_scale:  # te-fp8: one absmax over the tensor, stepped whole
        assert not used
    else:
        assert used and all(size < 2107 for size in used)
    _same(whole, parts)


@pytest.mark.parametrize("name", sorted(BUILD))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("config", ["bred-4bit", "sr-4bit", "bf16-sr", "fp32", "flashoptim-8bit",
                                    "m=int4:bred:b96,v=lin4nz:bred:b96"])
def test_rules_dtypes_and_resets_in_chunks(monkeypatch, name, dtype, config):
    shape = (1001,)  # odd: the last chunk ends inside a byte of 4-bit codes
    kw = dict(steps=5, reset=2)  # reset after steps 2 and 4: a first step again, states read as zeros
    whole, _ = _run(monkeypatch, WHOLE, BUILD[name], config, shape, dtype, **kw)
    parts, used = _run(monkeypatch, 200, BUILD[name], config, shape, dtype, **kw)
    assert used and min(used) >= 200
    _same(whole, parts)


@pytest.mark.parametrize("chunk", [1, 257, 1000, 1536])
def test_chunk_sizes(monkeypatch, chunk):
    shape = (3, 1024)  # a multiple of the block: the last chunk ends on a block edge (or not, by size)
    whole, _ = _run(monkeypatch, WHOLE, BUILD["adamw"], "bred-sr-4bit", shape, torch.float32, steps=3)
    parts, used = _run(monkeypatch, chunk, BUILD["adamw"], "bred-sr-4bit", shape, torch.float32, steps=3)
    assert used and all(size % 128 == 0 for size in used)
    _same(whole, parts)


def test_nonfinite_elements_counted_once(monkeypatch):
    parts, used = _run(monkeypatch, 1, BUILD["adamw"], "bred-4bit", (5000,), torch.float32, steps=3)
    assert used and int(parts[-1][1]["nonfinite"]) == 3


def test_what_steps_whole(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK", 256)
    p = torch.nn.Parameter(torch.randn(64, 64))
    p.grad = torch.randn_like(p)
    sizes = {}
    for name, opt in (("muon", Muon([p], min_quant_numel=0)), ("adamw", BUILD["adamw"]([p], min_quant_numel=0))):
        sizes[name] = chunked.chunk_size(opt, opt.load_states(opt.param_groups[0], p, 0), p.detach(), p.grad)
    assert sizes == {"muon": None, "adamw": 256}  # Newton-Schulz needs the whole matrix (rule_traits.elementwise)
    spec = parse_config("te-fp8").spec("m")
    assert chunked.chunk_elements([spec], 1 << 30) is None


@pytest.mark.parametrize("offset", [0, 384, 100])  # a shard's first element: aligned, and not
@pytest.mark.parametrize("config", ["bred-4bit", "sr-4bit", "fp8-sr", "bred-8bit"])
def test_a_shards_offset_steps_in_chunks_as_in_one_piece(config, offset):
    """The states of one shard (Stream offset = its first element's flat index in the whole
    tensor): chunks shift the offset by their start, so every counter is the unchunked one's."""
    cfg = parse_config(config)
    opt = AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2, states=cfg, backend="reference")
    group = opt.param_groups[0]
    n = 3001
    gen = torch.Generator().manual_seed(offset)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]

    def run(size):
        states = {name: QuantizedState(cfg.spec(name), (n,), Stream(3, 5, i, offset)) for i, name in enumerate(("m", "v"))}
        st = {"nonfinite": torch.zeros((), dtype=torch.int64)}
        p = p0.clone()
        out = []
        for step, g in enumerate(grads, start=1):
            first = {name: q.written == 0 for name, q in states.items()}
            if size is None:
                chunked.step_whole(opt, group, states, st, p, g, step, step, first)
            else:
                chunked.step_in_chunks(opt, group, states, st, p, g, step, step, first, size)
            out.append([p.clone()] + [t.clone() for q in states.values() for t in (q.codes, q.scales)])
        return out

    for a, b in zip(run(None), run(512), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
