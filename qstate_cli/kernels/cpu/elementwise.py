"""The states optim/small.py steps together, on the CPU path (numba, elementwise_kernel.py),
the same bits as the reference's torch ops:

    adamw_step    AdamW / Adam whose m and v are each an unscaled 16-bit minifloat (bf16, fp16,
                  their :sqrt forms; nearest or stochastic) or fp32 (the `bf16`, `bf16-sr`,
                  `fp16`, `fp32` presets, and the fp32 states of tensors under min_quant_numel):
                  read back, rule (kernels/cpu/adamw._update), store, in one pass per run of
                  at most RUN elements of one tensor; the path "cpu-numba" (optim/base.py)
    momentum_step  Lion, SGD and Muon whose m is such a state, the same way (the rule:
                  kernels/cpu/lion.lion_rows, sgd.sgd_rows, muon.muon_rows); Muon's update is
                  written out for its Newton-Schulz, which stays in torch (Muon.apply_flat)
    encode, decode  a 16-bit minifloat state's codes and values, one pass each, for rules the
                  passes do not know (a subclass's), which stay small.py's torch ops

Before, small.py's torch ops did it all: bf16 ~7 ms, bf16-sr 20-27 ms a step for 262,144
elements on 2 threads, ~14 ms of it the stochastic draws' 32-bit hash emulated in torch; one
4 M-element bf16-sr AdamW step 1573 ms, now 14.5 (docs/cpu.md). Threads over runs of elements
(host.run_parts). No numba at import; the kernels compile on first use (cached on disk).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ...quant import hash as qhash
from . import unavailable_reason
from .host import layout_arrays, parts_of, run_parts
from .replay import _unscaled_layout, unscaled16

_KERNELS: dict = {}


def covers(spec) -> str | None:
    """None if these kernels encode and decode `spec`'s state on the CPU path, else why not."""
    if not unscaled16(spec) or spec.per_element_division:
        return f"{spec}: not an unscaled 16-bit minifloat"
    if spec.rounding not in ("nearest", "stochastic"):
        return f"{spec}: {spec.rounding} rounding of an unscaled state (a dither per block)"
    return unavailable_reason("cpu")


def pass_covers(spec) -> str | None:
    """None if adamw_step and momentum_step take this state: covers, or fp32 (the identity
    format: the states of tensors under min_quant_numel, the `fp32` preset), else why not."""
    if spec.fmt.kind == "identity" and spec.fmt.bits == 32 and not spec.has_scales:
        return unavailable_reason("cpu")
    return covers(spec)


def _pass_lay(spec) -> tuple:
    """The kernel's lay of a state the passes take: the minifloat's (_lay), or for fp32 one
    whose BITS column says 32 (read and stored as is; SQRT as the spec's, SIGNED, so
    codec.stored_value clamps nothing: quantizer.encode's identity format does not)."""
    if spec.fmt.kind == "identity":
        return (0, 32, 1, 0, 0, int(spec.sqrt), 0, 0, 0, 0, 0, 0)
    return _lay(spec)


def _kernels() -> dict:
    """elementwise_kernel's names (imported on first use: numba)."""
    if not _KERNELS:
        from . import elementwise_kernel as ek
        _KERNELS.update(RUN=ek.RUN, encode16=ek.encode16, decode16=ek.decode16, adamw=ek.adamw_kernel,
                        momentum=ek.momentum_kernel)
    return _KERNELS


@lru_cache(maxsize=64)
def _lay(spec) -> tuple:
    return layout_arrays(_unscaled_layout(spec, 1), None)[0]


def _starts(sizes) -> np.ndarray:
    """int64 [tensors + 2]: where each tensor starts in the concatenation, its end, and a
    sentinel past it (never reached). Shared (_run_table): read, never written."""
    return _run_table(tuple(sizes), _kernels()["RUN"])[0]


@lru_cache(maxsize=256)
def _run_table(sizes: tuple, run: int) -> tuple[np.ndarray, np.ndarray]:
    """(_starts, _runs) of tensors of `sizes` laid end to end, built once per sizes: a steady
    step passes the same tensors again (~20 us of numpy per step for 18 tensors)."""
    starts = np.zeros(len(sizes) + 2, np.int64)
    starts[1:-1] = np.cumsum(sizes)
    starts[-1] = np.iinfo(np.int64).max
    return starts, _runs(sizes, starts, run)


def _keys(specs: list, seed: int, tensor_ids: list, state_ids: tuple, step: int) -> np.ndarray:
    """uint32 [tensors + 1, 2 per state]: each tensor's (k1, k2) of each state's stream at this
    step (quant/hash.stream_keys, the reference's Stream(seed, tensor id, state id)); a last row
    of 0. All 0 where no state (specs, one per state id) draws: none rounds a minifloat
    stochastically."""
    keys = np.zeros((len(tensor_ids) + 1, 2 * len(state_ids)), np.uint32)
    if any(s.rounding == "stochastic" and s.fmt.kind != "identity" for s in specs):
        for i, t in enumerate(tensor_ids):
            keys[i] = [k for s in state_ids for k in qhash.stream_keys(seed, t, s, step)]
    return keys


def encode(x: torch.Tensor, spec, seed: int, tensor_ids: list, state_id: int, step: int, sizes: list) -> torch.Tensor:
    """int16 codes of the flat fp32 CPU tensor x (tensors of `sizes` elements laid end to end):
    quantizer.encode(x, spec, step, stream)[0] with each tensor's Stream(seed, tensor id,
    state id), as small.Streams draws them."""
    run, enc = _kernels()["RUN"], _kernels()["encode16"]
    x = x.detach().to(torch.float32).contiguous().reshape(-1)
    n = x.numel()
    codes = torch.empty(n, dtype=torch.int16)
    keys = _keys([spec], seed, tensor_ids, (state_id,), step)
    if n:
        run_parts(enc, n, run, (x.numpy(), codes.numpy().view(np.uint16), _lay(spec), _starts(sizes), keys, n))
    return codes


def _codes(t: torch.Tensor) -> np.ndarray:
    """A state's flat codes for the kernel: int16 as the uint16 bits, fp32 as they are."""
    return t.numpy().view(np.uint16) if t.dtype == torch.int16 else t.numpy()


def adamw_step(p32, g, codes: dict, specs: dict, fresh: dict, scalars: torch.Tensor,
               beta1: float, beta2: float, eps: float, l2_wd: float, step: int, seed: int, tensor_ids: list,
               sizes: list, state_ids: tuple) -> list:
    """One AdamW / Adam step of tensors laid end to end whose m and v it takes (pass_covers):
    p32 (fp32) and codes["m"], codes["v"] (int16 bits of a 16-bit minifloat, or fp32; read
    unless fresh) updated in place by one kernel pass (elementwise_kernel.adamw_kernel), what
    decode, optimizers.AdamW.update and encode give them, with kernels/cpu/adamw.py's arguments
    (scalars: rules.packed_scalars; l2_wd: Adam's coupled decay, else 0). g: fp32, read only;
    its non-finite elements step as 0. Each of p32, g, codes["m"] and codes["v"] is one flat
    contiguous tensor of all the elements, or a list of each tensor's own (contiguous, of its
    size in `sizes`): the parameters, gradients and states stepped where they are, with no
    copy in or out. Returns each tensor's count of non-finite gradient elements."""
    kernel = _kernels()["adamw"](_pass_lay(specs["m"]), _pass_lay(specs["v"]))
    keys = _keys([specs["m"], specs["v"]], seed, tensor_ids, state_ids, step)
    columns = (p32, g, codes["m"], codes["v"])
    likes = [_codes(t if isinstance(t, torch.Tensor) else t[0])[:0] for t in columns[2:]]
    return _run_pass(kernel, sizes, (addresses(columns, sizes), *likes), keys,
                     (scalars.detach().cpu().numpy(), float(beta1), 1.0 - float(beta1), float(beta2),
                      1.0 - float(beta2), float(eps), float(l2_wd), bool(fresh["m"]), bool(fresh["v"])))


def addresses(columns: tuple, sizes: list) -> np.ndarray:
    """int64 [tensors, columns]: where each tensor's elements start in each column (a flat
    tensor of all of them: its start plus the tensor's offset; a list: that tensor's own),
    for elementwise_kernel.tensor_views."""
    offsets = _starts(sizes)[:len(sizes)]
    at = np.array([[t.data_ptr() for t in col] if not isinstance(col, torch.Tensor)
                   else col.data_ptr() + offsets * col.element_size() for col in columns], np.int64)
    return np.ascontiguousarray(at.T)


def _run_pass(kernel, sizes: list, arrays: tuple, keys: np.ndarray, rest: tuple) -> list:
    """kernel(b0, b1, part, *arrays, runs, starts, keys, bad, *rest) over the runs of the
    tensors of `sizes` laid end to end (one block per run: RUN elements of one tensor, or the
    rest of it), split over threads (host.run_parts); returns each tensor's count in bad."""
    run = _kernels()["RUN"]
    starts, runs = _run_table(tuple(sizes), run)
    parts = parts_of(int(starts[-2]))
    bad = np.zeros((parts, len(sizes)), np.int64)
    run_parts(kernel, len(runs) * run, run, arrays + (runs, starts, keys, bad) + rest, parts=parts)
    return bad.sum(0).tolist()


def _runs(sizes: list, starts: np.ndarray, run: int) -> np.ndarray:
    """int64 [runs, 2]: (first element, tensor) of each run of at most `run` elements of one
    tensor: each tensor's runs of `run` elements, then the rest."""
    nruns = -(-np.asarray(sizes, np.int64) // run)
    owner = np.repeat(np.arange(len(sizes)), nruns)
    first = np.arange(owner.size) - np.repeat(np.cumsum(nruns) - nruns, nruns)  # the run's index in its tensor
    return np.stack([starts[owner] + first * run, owner], 1)


RULES = {"lion": 0, "sgd": 1, "muon": 2}  # elementwise_kernel.LION, SGD, MUON


def momentum_step(rule: str, p32, g, codes, spec, fresh: bool,
                  scalars: torch.Tensor, hyper: tuple, nesterov: bool, use_wd: bool, step: int, seed: int,
                  tensor_ids: list, sizes: list, state_id: int, out: torch.Tensor | None = None) -> list:
    """One Lion, SGD or Muon (`rule`) step of tensors laid end to end whose one state m it
    takes (pass_covers), in one kernel pass (elementwise_kernel.momentum_kernel): codes (flat:
    int16 bits of a 16-bit minifloat, or fp32; read unless fresh) and p32 (fp32, flat; Lion,
    SGD) updated in place, what decode, the optimizer's update and encode give them; Muon's
    update (before Newton-Schulz) written to out (fp32, flat). scalars: rules.packed_scalars;
    hyper: the kernel's 4 hyper-parameters (Lion: b1, 1 - b1, b2, 1 - b2; SGD: momentum,
    1 - dampening, weight decay, 0; Muon: momentum, 1 - momentum, 0, 0), each rounded to fp32
    as the fused kernels take them; use_wd: SGD's weight decay != 0. g: fp32, read only; its
    non-finite elements step as 0. p32, g and codes: flat, or lists of each tensor's own, as
    adamw_step takes them (Muon: flat, its out too). Returns each tensor's count of them."""
    kernel = _kernels()["momentum"](_pass_lay(spec))
    out_np = out.numpy() if out is not None else np.zeros(1, np.float32)
    like = _codes(codes if isinstance(codes, torch.Tensor) else codes[0])[:0]
    return _run_pass(kernel, sizes, (addresses((p32, g, codes, codes), sizes), like, out_np),
                     _keys([spec], seed, tensor_ids, (state_id,), step),
                     (RULES[rule], scalars.detach().cpu().numpy(), np.array(hyper, np.float32), bool(nesterov),
                      bool(use_wd), bool(fresh)))


def decode(codes: torch.Tensor, spec) -> torch.Tensor:
    """The stored values (fp32, flat) of int16 codes: quantizer.decode(codes, None, spec, n, step)."""
    run, dec = _kernels()["RUN"], _kernels()["decode16"]
    codes = codes.contiguous().reshape(-1)
    n = codes.numel()
    out = torch.empty(n, dtype=torch.float32)
    if n:
        run_parts(dec, n, run, (codes.numpy().view(np.uint16), out.numpy(), _lay(spec), n))
    return out
