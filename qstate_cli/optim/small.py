"""Tensors with elementwise states, stepped together: the reference rule once over their concatenation.

Some states no kernel takes: the fp32 states of tensors under `min_quant_numel` (biases,
norms), and unscaled float states (`bf16`, `bf16-sr`, `fp16`, `e4m3`, ...). The
reference steps each such tensor with ~35 torch ops: ~0.8 ms per tensor and step on one CPU
thread (8 tensors of 1,024 elements: 6.2 ms, torch's fused AdamW 0.5 ms; docs/cpu.md,
"Step overhead"). Everything the reference does to them is elementwise:

    g   <- grad as fp32, non-finite elements counted and zeroed
    x   <- the stored states read back (zeros if never written or reset now), v clamped at 0
    p, new <- the optimizer's rule (elementwise for every `elementwise` optimizer;
              Muon's momentum too, its Newton-Schulz per matrix: `update_flat`)
    store  <- new rounded to the format, one storage unit (8, 16 or 32 bits) per element,
              no scale (quantizer.encode); stochastic rounding's uniform for element i of a
              tensor is uniform16 of counter i in that tensor's stream (`Streams` draws them
              for the concatenation: each element its tensor's keys and its index in it)

so the same ops over the tensors laid end to end give every element the same result (IEEE
products, sums, correctly rounded quotients and square roots, round to nearest: no op here
depends on an element's position or its neighbours). Tensors share one pass when they share
what the reference's scalars depend on: the step, the steps since reset, which states read
as zero, and the state specs. Each tensor then gets its own parameter values, states and
non-finite count, exactly what `QuantizedOptimizer._step_param` leaves
(tests/test_optim_small.py compares the two bit for bit, over steps, resets, dtypes, formats
and a checkpoint); the states are written in place, as the kernels write theirs (the
reference makes new tensors).

Only for CPU tensors and a backend other than "reference" (which keeps the per-tensor
definition); on CUDA the reference still steps them one by one. Where numba runs, the CPU path's
kernels (kernels/cpu/elementwise.py) take over, the same bits: AdamW / Adam, Lion, SGD and
Muon whose states are each a 16-bit minifloat (bf16, fp16) or fp32 step in one pass (decode,
rule, encode: _step_pass, path "cpu-numba"; Muon's Newton-Schulz after it, per matrix): where
every parameter and gradient of the run is fp32 and contiguous (not Muon), over the tensors
and their states where they lie, else over flat copies; a subclass that rewrites the rule
(one_pass_rule None) keeps the torch rule, with each 16-bit state's encode and decode one
pass each. While nothing but the gradients changes, optim/steady.py steps a run again
(TogetherRun) without reading each tensor's counters.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._utils import _flatten_dense_tensors as flatten, _unflatten_dense_tensors as unflatten

from ..quant import hash as qhash
from ..quant.quantizer import Stream, decode, encode
from ..quant.config import STATE_IDS
from . import chunked, rule_traits, sharding
from .fused import counter_tensors


def cpu_elementwise(spec) -> bool:
    """Whether the CPU path's kernels (kernels/cpu/elementwise.py) encode and decode this state."""
    return _elementwise().covers(spec) is None


def _elementwise():
    from ..kernels.cpu import elementwise  # no numba at import

    return elementwise


def one_pass(opt, group, p: torch.Tensor) -> bool:
    """Whether p steps together in one numba pass (_step_pass: AdamW / Adam, Lion, SGD or Muon
    whose states are unscaled 16-bit minifloats or fp32): the optimizers' path "cpu-numba" for it."""
    return steps_together(opt, group, p) and _pass_takes(opt, [opt.spec_for(group, p, n) for n in opt.state_names])


def _pass_takes(opt, specs: list) -> bool:
    return opt.one_pass_rule() is not None and all(_elementwise().pass_covers(spec) is None for spec in specs)


def steps_together(opt, group, p: torch.Tensor) -> bool:
    """True if p (routed to the reference) can step in a pass with the group's other such
    tensors. A tensor above one chunk (chunked.CHUNK) that the numba pass does not take steps
    alone, in the reference's chunks (optim/chunked.py): a flat copy of it would make the
    torch rule's ~100 bytes of temporaries per element of the whole tensor."""
    if opt.backend == "reference" or p.device.type != "cpu" or p.numel() == 0 or p.dtype == torch.float64:
        return False  # (an fp64 parameter: the reference updates it in fp64, base._step_param)
    if sharding.is_dtensor(p) or not rule_traits.flat_rule(type(opt)):
        return False  # (a rewritten rule that is not elementwise and has no update_flat of its own: one by one)
    specs = [opt.spec_for(group, p, n) for n in opt.state_names]
    if not all(elementwise(spec) for spec in specs):
        return False
    return p.numel() <= chunked.CHUNK or _pass_takes(opt, specs)


def elementwise(spec) -> bool:
    """Whether a state's encode and decode are elementwise: no scale, one storage unit per
    element (a 4-bit format packs two elements in a byte), rounded to nearest or stochastically
    (one uniform per element; BReD's dither is per block)."""
    return spec.rounding in ("nearest", "stochastic") and not spec.has_scales and spec.fmt.bits >= 8


def step_together(opt, group, params: list, ids: dict) -> list:
    """Step `params` (each passed steps_together) of one param group, one pass per shared run;
    returns each run as it left it (TogetherRun)."""
    names = opt.state_names
    runs: dict[tuple, list] = {}
    for p in params:
        step, since, written = opt.step_counters(group, p, ids[id(p)])
        specs = tuple(opt.spec_for(group, p, n) for n in names)
        runs.setdefault((step, since, written, specs), []).append(p)
    done = []
    for (step, since, written, specs), run in runs.items():
        tensor_ids, specs = [ids[id(p)] for p in run], dict(zip(names, specs))
        _step_run(opt, group, run, tensor_ids, step, since, dict(zip(names, written)), specs)
        done.append(TogetherRun(run, tensor_ids, specs, step, since).left(opt))
    return done


@dataclass
class TogetherRun:
    """One run of step_together as its step left it, which optim/steady.py steps again while
    nothing but the gradients changes: its parameters and their tensor ids, state specs,
    counters (step, since: this step's; step_t, since_t: the shared tensors _count stored) and
    state dicts. _step_run reads the codes from the state dicts at each step."""

    params: list
    tensor_ids: list
    specs: dict  # state name -> spec
    step: int
    since: int
    states: list = field(default_factory=list)
    step_t: torch.Tensor | None = None
    since_t: torch.Tensor | None = None

    def left(self, opt) -> "TogetherRun":
        self.states = [opt.state[p] for p in self.params]
        return self._counters_left()

    def _counters_left(self) -> "TogetherRun":
        self.step_t, self.since_t = self.states[0]["step"], self.states[0]["since_reset"]
        return self

    def holds(self, opt, params: list, ids: dict) -> bool:
        """Whether params are this run's, with the tensor ids, state dicts and counters it left
        (the very objects: a state dict loaded or set by hand, or a counter written, replaces one)."""
        if len(params) != len(self.params):
            return False
        state, step_t, since_t = opt.state, self.step_t, self.since_t
        for p, q, tid, st in zip(params, self.params, self.tensor_ids, self.states):
            if p is not q or state.get(p) is not st or st["step"] is not step_t or st["since_reset"] is not since_t \
                    or ids[id(p)] != tid or any(st[n]["written"] is not step_t for n in self.specs):
                return False
        return True

    def step_again(self, opt, group) -> None:
        """The run's next step, its counters advanced as opt.step_counters advances each
        parameter's (one reset decision: every parameter of the run has the same counters)."""
        step, self.since, reset = opt.reset_policy.advance(self.step, self.since)
        written = {n: 0 if reset else self.step for n in self.specs}
        self.step = step
        _step_run(opt, group, self.params, self.tensor_ids, step, self.since, written, self.specs)
        self._counters_left()  # the state dicts are the ones holds() found


class Streams:
    """The random streams of tensors laid end to end, as quantizer.encode draws from a Stream:
    element j of the concatenation is element j - start_t of tensor t, so its uniform is
    uniform16 of counter j - start_t with tensor t's keys (the reference's Stream(seed, tensor
    id, state id)); the padding encode adds past the end gets keys 0 (its codes are dropped)."""

    def __init__(self, seed: int, tensor_ids: list, state_id: int, sizes: list):
        self.seed, self.tensor_ids, self.state_id = seed, tensor_ids, state_id
        self.sizes = torch.tensor(sizes)

    def element_uniforms(self, step: int, n: int, device) -> torch.Tensor:
        k1, k2 = zip(*(qhash.stream_keys(self.seed, t, self.state_id, step) for t in self.tensor_ids))
        total = int(self.sizes.sum())
        starts = torch.cumsum(self.sizes, 0) - self.sizes
        counter = torch.arange(n) - torch.nn.functional.pad(starts.repeat_interleave(self.sizes), (0, n - total))
        keys = tuple(torch.nn.functional.pad(torch.tensor(k).repeat_interleave(self.sizes), (0, n - total))
                     for k in (k1, k2))
        return qhash.uniform16(tuple(k.to(device) for k in keys), counter.to(device))


def _step_run(opt, group, params: list, tensor_ids: list, step: int, since: int, written: dict,
              specs: dict) -> None:
    if _pass_takes(opt, list(specs.values())):
        _step_pass(opt, group, params, tensor_ids, step, since, written, specs)  # counts its non-finite g
        return
    sizes = [p.numel() for p in params]
    if sum(sizes) > chunked.CHUNK and len(params) > 1:  # the torch rule's temporaries: a chunk's at most
        for a, b in _batches(sizes, chunked.CHUNK):
            _step_run(opt, group, params[a:b], tensor_ids[a:b], step, since, written, specs)
        return
    # one flat copy of each list (torch's bucket flattening, as DDP uses): mixed dtypes are promoted
    # to one that holds them all exactly, so .to(fp32) rounds once, as the reference's p.to(fp32) does
    g, bad = chunked.finite_grad(flatten([p.grad for p in params]))
    counts = _segment_sums(bad, sizes) if bool(bad.any()) else [0] * len(params)
    # a 16-bit minifloat's encode and decode by the CPU path's kernels where numba runs (the same bits)
    fast = {name: cpu_elementwise(spec) for name, spec in specs.items()}
    x_hat, first = {}, {}
    for name, w in written.items():
        first[name] = w == 0
        if w == 0:
            x_hat[name] = torch.zeros(g.numel(), dtype=torch.float32, device=g.device)
        else:
            codes = flatten([opt.state[p][name]["codes"] for p in params])
            x_hat[name] = (_elementwise().decode(codes, specs[name]) if fast[name]
                           else decode(codes, None, specs[name], codes.numel(), w))
    chunked.clamp_v(x_hat)  # as the reference step
    p32, new = opt.update_flat(group, [p.shape for p in params], flatten(params).to(torch.float32), g, x_hat,
                               since, first)
    for name in new:  # in place, as the kernels store their states
        if fast[name]:
            codes = _elementwise().encode(new[name], specs[name], group["seed"], tensor_ids, STATE_IDS[name], step,
                                          sizes)
        else:
            drawn = specs[name].rounding == "stochastic"
            stream = Streams(group["seed"], tensor_ids, STATE_IDS[name], sizes) if drawn else Stream()
            codes = encode(new[name], specs[name], step, stream)[0]
        torch._foreach_copy_([opt.state[p][name]["codes"] for p in params], codes.split(sizes))
    torch._foreach_copy_(params, unflatten(p32, params))  # rounds to each parameter's dtype, as copy_ does
    _count(opt, params, counts, step, since, list(new))


def _batches(sizes: list, cap: int) -> list[tuple[int, int]]:
    """Consecutive ranges [a, b) of the tensors, each holding at most `cap` elements (or one
    tensor): every element's result is its own, so stepping them apart gives the same bits."""
    out, a, total = [], 0, 0
    for k, size in enumerate(sizes):
        if k > a and total + size > cap:
            out.append((a, k))
            a, total = k, 0
        total += size
    return out + [(a, len(sizes))]


def _step_pass(opt, group, params: list, tensor_ids: list, step: int, since: int, written: dict,
               specs: dict) -> None:
    """_step_run for states the CPU path's one pass takes (kernels/cpu/elementwise.py: AdamW /
    Adam's m and v, Lion's, SGD's or Muon's m, each a 16-bit minifloat or fp32): the
    non-finite count, decode, rule and encode in one numba pass over the flat parameters,
    gradients (read only: one fp32 gradient may be a view of it) and codes, the same bits;
    Muon's Newton-Schulz and parameter update then in torch (Muon.apply_flat). AdamW / Adam,
    Lion and SGD with every parameter and gradient fp32 and contiguous step them and their
    states where they are (no flat copies in or out: tiny-lm's step 671 -> ~500 us, docs/cpu.md)."""
    fresh = {name: w == 0 for name, w in written.items()}
    sizes = [p.numel() for p in params]
    rule = opt.one_pass_rule()
    codes = {name: [opt.state[p][name]["codes"] for p in params] for name in specs}
    if rule != "muon" and all(_in_place(p) for p in params) and all(c.is_contiguous() for cs in codes.values()
                                                                    for c in cs):
        counts = _pass(opt, group, rule, params, [p.grad for p in params], codes, specs, fresh, since, step,
                       tensor_ids, sizes)
        _count(opt, params, counts, step, since, list(specs))
        return
    g = flatten([p.grad for p in params]).to(torch.float32)
    # (one contiguous fp32 tensor: flatten gives back a view of it, stepped in place; the copies
    # back below are then copies onto themselves)
    p32 = flatten(params).to(torch.float32)
    flat = {name: torch.empty(g.numel(), dtype=torch.float32 if specs[name].fmt.kind == "identity" else torch.int16)
            if fresh[name] else flatten(codes[name]) for name in specs}
    out = torch.empty_like(g) if rule == "muon" else None  # the momentum update, for Newton-Schulz
    counts = _pass(opt, group, rule, p32, g, flat, specs, fresh, since, step, tensor_ids, sizes, out)
    if out is not None:
        p32 = opt.apply_flat(group, [p.shape for p in params], p32, out)
    for name in specs:
        torch._foreach_copy_(codes[name], flat[name].split(sizes))
    torch._foreach_copy_(params, unflatten(p32, params))
    _count(opt, params, counts, step, since, list(specs))


def _pass(opt, group, rule: str, p, g, codes: dict, specs: dict, fresh: dict, since: int, step: int,
          tensor_ids: list, sizes: list, out: torch.Tensor | None = None) -> list:
    """The one pass of `rule` (elementwise.adamw_step or momentum_step) over p, g and the states'
    codes (each flat, or a list of each tensor's own); returns each tensor's non-finite count."""
    ew = _elementwise()
    if rule == "adamw":
        scalars, l2 = opt.kernel_scalars(group, since, "cpu")
        beta1, beta2 = group["betas"]
        return ew.adamw_step(p, g, codes, specs, fresh, scalars, beta1, beta2, group["eps"], l2, step,
                             group["seed"], tensor_ids, sizes, (STATE_IDS["m"], STATE_IDS["v"]))
    return ew.momentum_step(rule, p, g, codes["m"], specs["m"], fresh["m"], step=step, seed=group["seed"],
                            tensor_ids=tensor_ids, sizes=sizes, state_id=STATE_IDS["m"], out=out,
                            **opt.pass_arguments(group, since))


def _in_place(p: torch.Tensor) -> bool:
    """Whether the pass can step p and its gradient where they are: both fp32 and contiguous
    (the states' codes must be contiguous too: the caller checks)."""
    g = p.grad
    return p.dtype == g.dtype == torch.float32 and p.is_contiguous() and g.is_contiguous()


def _count(opt, params: list, counts: list, step: int, since: int, names: list) -> None:
    """Each tensor's non-finite count and step counters after a pass (shared, never mutated)."""
    step_t, since_t = counter_tensors(opt, step, since)  # never mutated: shared with optim/fused.py's launch
    for p, count in zip(params, counts):
        st = opt.state[p]
        if count:
            st["nonfinite"] += count
        st["step"], st["since_reset"] = step_t, since_t
        for name in names:
            st[name]["written"] = step_t


def _segment_sums(flags: torch.Tensor, sizes: list) -> list:
    """[flags[a:b].sum() for each consecutive segment of `sizes`], from one cumulative sum."""
    total = flags.cumsum(0)[torch.tensor(sizes).cumsum(0) - 1]
    return torch.diff(total, prepend=total.new_zeros(1)).tolist()
