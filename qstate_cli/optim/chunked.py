"""The reference step of one parameter (QuantizedOptimizer._step_param), whole or in chunks.

One piece of a parameter steps as

    g      <- fp32 gradient, NaN/Inf elements counted into `nonfinite` and set to 0
    x_hat  <- each state decoded to fp32 (`read`: v clamped at 0, a dithered read-back below 0)
    p, new <- the optimizer's rule (fp32; an fp64 parameter's values updated in fp64)
    codes  <- encode(new) per state;  parameter <- p (rounded to its dtype)

An elementwise rule (AdamW, Adam, Lion, SGD: `elementwise`, optim/rule_traits.py) gives each
element's new parameter and states from that element's p, g and read-back states alone, and
every random bit comes from a global counter (quant/quantizer.py: element offset + i, block
offset // B + b). So a tensor of n elements may step as consecutive chunks [a, b) of its
flat (row-major) elements, each decoded, updated and encoded alone with the state's Stream
shifted to offset + a, and give the same bits as one piece, when every chunk start a is a
multiple of

    L = lcm(2, DITHER_BLOCK, every state's block)       (elements)

(whole blocks: the same absmax, scale and BReD dither per block; an even start: whole bytes
of 4-bit codes and whole pairs of stochastic rounding's 16-bit uniforms). Only the last chunk
holds the tensor's short last block. The one-piece step makes ~50-150 bytes of fp32
temporaries per element (decoded states, the rule's intermediates, the encoder's blocks);
in chunks of CHUNK elements they are ~CHUNK * that, plus the new codes and scales (the
state's own size), whatever the tensor's size.

Stepped whole: a tensor of at most one chunk; a rule that needs the whole tensor (Muon's
Newton-Schulz; a subclass that rewrites `update` without declaring `elementwise` beside it);
a state with one scale for the whole tensor (`tensor`: te-fp8; its absmax needs every new
value first); a non-contiguous parameter (no flat view to write its chunks to); a gradient
sharing the parameter's storage (a chunk written before a later one is read).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..quant.config import DITHER_BLOCK
from ..quant.quantizer import encode
from ..quant.state import QuantizedState
from . import rule_traits

# Elements per chunk (rounded up to a multiple of L, module docstring). On a CPU (one thread),
# one AdamW step of a 4,194,304-element fp32 tensor grew the process's peak RSS above the
# memory before it by, per element, in one piece / chunks of 2^20 / 2^18 / 2^17 elements:
# bred-4bit 80-85 / 25 / 5-9 / 3.2 bytes (0.39 / 0.25 / 0.22 / 0.23 s a step), fp32 states
# 50 / 24 / 14-15 / 11.5 (8 of them the new states). On a GPU (a DTensor shard) each chunk is ~60
# kernel launches: DEVICE_CHUNK keeps them few (an estimate, not measured: ~400 MB transient).
CHUNK = 1 << 18
DEVICE_CHUNK = 1 << 22


def chunk_elements(specs, numel: int, on_cpu: bool = True) -> int | None:
    """Elements per chunk for states of these specs on a tensor of `numel` elements: CHUNK
    (DEVICE_CHUNK off the CPU) rounded up to a multiple of L (module docstring); None when
    the tensor is one chunk or a state holds one scale for the whole tensor."""
    specs = list(specs)
    if any(spec.tensor_scale for spec in specs):
        return None
    unit = math.lcm(2, DITHER_BLOCK, *(spec.dither_block for spec in specs))
    size = -(-max(int(CHUNK if on_cpu else DEVICE_CHUNK), 1) // unit) * unit
    return size if numel > size else None


def chunk_size(opt, states: dict, local: torch.Tensor, grad: torch.Tensor) -> int | None:
    """chunk_elements for this parameter's step, or None where it steps whole (module docstring)."""
    if not rule_traits.elementwise(type(opt)) or not local.is_contiguous() or local.numel() <= 2:
        return None
    if grad.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        return None
    return chunk_elements((q.spec for q in states.values()), local.numel(), local.device.type == "cpu")


def read(states: dict) -> dict[str, torch.Tensor]:
    """{name: fp32 value} of states ({name: QuantizedState}) as the rule reads them: decoded
    (zeros if never written), v clamped at 0 (a dithered v can read back below 0)."""
    return clamp_v({name: q.decode() for name, q in states.items()})


def clamp_v(x_hat: dict) -> dict:
    """x_hat with v (if any) clamped at 0: a dithered v can read back below 0."""
    if "v" in x_hat:
        x_hat["v"] = x_hat["v"].clamp(min=0.0)
    return x_hat


def finite_grad(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad as fp32 with its NaN/Inf elements set to 0, the mask of those elements)."""
    g = grad.to(torch.float32)
    bad = ~torch.isfinite(g)
    return g.masked_fill(bad, 0.0), bad


def update_piece(opt, group, local: torch.Tensor, grad: torch.Tensor, x_hat: dict, since: int,
                 first: dict, st: dict):
    """(new parameter values, {name: new fp32 state}) of one piece: `local` the parameter's
    values, `grad` its gradient's (NaN/Inf elements counted into st['nonfinite'] and read as 0)."""
    g, bad = finite_grad(grad)
    st["nonfinite"] += bad.sum()
    p_in = local if local.dtype == torch.float64 else local.to(torch.float32)  # fp64: updated in fp64
    return opt.update(group, p_in, g, x_hat, since, first)


def step_whole(opt, group, states: dict, st: dict, local, grad, step: int, since: int, first: dict) -> None:
    """One piece: the whole tensor (module docstring)."""
    p32, new = update_piece(opt, group, local, grad, read(states), since, first, st)
    for name, q in states.items():
        q.encode(new[name], step)
    local.copy_(p32)


def step_in_chunks(opt, group, states: dict, st: dict, local, grad, step: int, since: int, first: dict,
                   size: int) -> None:
    """Chunks of `size` elements (a multiple of L), each stepped as step_whole steps the tensor;
    the new codes and scales are written into new tensors (the old ones are read to the end),
    then handed to the states as encode would hand them."""
    flat_p, flat_g = local.view(-1), grad.reshape(-1)
    n = flat_p.numel()
    out: dict[str, list] = {}
    for a in range(0, n, size):
        b = min(a + size, n)
        pieces = {name: _piece(q, a, b) for name, q in states.items()}
        p32, new = update_piece(opt, group, flat_p[a:b], flat_g[a:b], read(pieces), since, first, st)
        for name, q in states.items():
            codes, scales = encode(new[name], q.spec, step, pieces[name].stream)
            if name not in out:
                out[name] = [torch.empty(q.codes.numel(), dtype=codes.dtype, device=codes.device),
                             None if scales is None else
                             torch.empty(q.scales.numel(), dtype=scales.dtype, device=scales.device)]
            (c0, c1), blocks = _code_range(q.spec, a, b), _scale_range(q.spec, a, b)
            out[name][0][c0:c1] = codes
            if scales is not None:
                out[name][1][blocks[0]:blocks[1]] = scales
        flat_p[a:b].copy_(p32)
    for name, q in states.items():
        q.codes, q.scales = out[name]
        q.written = int(step)


def _piece(q: QuantizedState, a: int, b: int) -> QuantizedState:
    """Elements [a, b) of q (a a multiple of L): views of its codes and scales, its stream at
    offset + a, the step it was written at."""
    c0, c1 = _code_range(q.spec, a, b)
    blocks = _scale_range(q.spec, a, b)
    tensors = {"codes": q.codes[c0:c1], "written": q.written}
    if q.scales is not None:
        tensors["scales"] = q.scales[blocks[0]:blocks[1]]
    return QuantizedState.from_tensors(q.spec, (b - a,), replace(q.stream, offset=q.stream.offset + a), tensors)


def _code_range(spec, a: int, b: int) -> tuple[int, int]:
    """Where elements [a, b) sit in a state's codes: one value per element (fp32, 16-bit
    patterns) or ceil(bits / 8) bytes packed (a even)."""
    bits = spec.fmt.bits
    if spec.fmt.kind == "identity" or bits >= 16:
        return a, b
    return a * bits // 8, -(-b * bits // 8)


def _scale_range(spec, a: int, b: int) -> tuple[int, int] | None:
    """The blocks elements [a, b) cover (a a multiple of the block), or None (unscaled)."""
    if not spec.scaled:
        return None
    return a // spec.block, -(-b // spec.block)
