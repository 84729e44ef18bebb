"""The kernel path of QuantizedOptimizer: a param group steps in one (or a few) launches.

Per step, the parameters of a group that the kernels cover are grouped by what a launch
shares: device, parameter and gradient dtype, step counter, steps since reset (the
bias corrections), the step each state was written at, and whether it reads as zero
(never written, or reset now). Normally that is one launch per group. Each optimizer's
`launch_kernel(group, batch, run)` picks its kernel and hyper-parameters. While only the
gradients change, a group's one launch is stepped again (SteadyPlan) instead of planned
per parameter.

State layout: exactly the reference's (`optimizer.state[p]`: step, since_reset,
nonfinite, and per state {codes, scales, written}); the kernels update codes and scales
in place. Checkpoints therefore move freely between the reference and the kernel path,
and the random streams (seed, tensor id, state id, step) are the same on both.

Launch tables (kernels/launch.py) are cached per set of addresses: with stable gradient
buffers a step issues no host-to-device copy at all; otherwise one small non-blocking copy.

On CPU tensors the same launch goes to the CPU path (kernels/cpu, numba): `run.launch`
is then its launch function, with the Triton launcher's signature, and the batch a
cpu.CpuBatch (the members and the seed) instead of device address tables.

This module is the one seam between optim/ and kernels/: nothing else in optim imports
kernels. The host side (kernels/__init__.py, kernels/launch.py, kernels/cpu/__init__.py)
needs neither Triton nor numba; the kernel modules import them, so `launcher(name)` and
`cpu.launcher(name)` import them on first use.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import kernels
from ..kernels import cpu, launch
from ..kernels.cpu.host import CpuBatch, VALUE_DTYPES as CPU_VALUE_DTYPES
from . import rule_traits

MAX_CACHED_BATCHES = 16
# kernels/<module>.py -> its launch function (the optimizers' `kernel` attribute names the module)
LAUNCHERS = {"adamw": "adamw_step", "lion": "lion_step", "sgd": "sgd_step", "muon": "muon_momentum_step"}


def launcher(kernel: str) -> Callable:
    """The launch function of kernels/<kernel>.py (imports Triton the first time)."""
    module = importlib.import_module(f"{kernels.__name__}.{kernel}")
    return getattr(module, LAUNCHERS[kernel])


def kernels_unavailable(device) -> str | None:
    """None if kernels can run for tensors on `device`, else why not (kernels/__init__.py)."""
    return kernels.unavailable_reason(device)


def cpu_unavailable(device) -> str | None:
    """None if the CPU path can run for tensors on `device` (numba imports), else why not."""
    return cpu.unavailable_reason(device)


def why_reference(opt, group, p: torch.Tensor, on_cpu: bool = False) -> str | None:
    """None if the kernels (on_cpu: the CPU path) can step p in this group, else why the
    reference steps it."""
    if opt.kernel is None:
        return f"{type(opt).__name__} has no kernel"
    if not rule_traits.kernel_is_rule(type(opt)):
        return rule_traits.rewritten_rule(type(opt))
    if on_cpu:
        if not cpu.covers(opt.kernel):
            return f"{type(opt).__name__} has no CPU kernel"
        wrong = [t.dtype for t in (p, p.grad) if t is not None and t.dtype not in CPU_VALUE_DTYPES]
        if wrong:
            return f"dtype {wrong[0]} has no CPU kernel (fp32 and bf16 do)"
        if p.dtype == torch.bfloat16 and cpu.bf16_nan() is None:
            return "torch's bf16 cast gives NaNs more than one bit pattern here; the CPU kernels store one"
    if p.dtype not in launch.VALUE_KINDS:
        return f"parameter dtype {p.dtype} has no kernel (fp32, bf16, fp16 do)"
    if not p.is_contiguous():
        return "parameter is not contiguous"
    g = p.grad
    if g is not None and (g.is_sparse or g.dtype not in launch.VALUE_KINDS):
        return f"gradient ({g.dtype}{', sparse' if g.is_sparse else ''}) has no kernel"
    blocks = set()
    for name in opt.state_names:
        spec = opt.spec_for(group, p, name)
        reason = launch.why_not_covered(spec, minifloats=on_cpu)
        if reason:
            if p.numel() < group["min_quant_numel"]:
                return f"small tensor ({p.numel()} < min_quant_numel={group['min_quant_numel']}) keeps fp32 states"
            return f"state {name}: {reason}"
        blocks.add(spec.block)
    if len(blocks) > 1:
        return "m and v have different block sizes"
    return None


@dataclass
class Run:
    """What one launch shares (see module docstring)."""

    device: torch.device
    p_kind: int
    g_kind: int
    step: int
    since: int  # steps since the last reset, including this one (bias corrections)
    written: dict  # state name -> step its codes were written at (0 if fresh)
    fresh: dict  # state name -> reads as zero
    layouts: dict = field(default_factory=dict)  # state name -> launch.StateLayout
    tables: dict = field(default_factory=dict)  # state name -> code book tensor or None
    params: list = field(default_factory=list)
    members: list = field(default_factory=list)
    launch: Callable | None = None  # the kernel's launch function (launcher(opt.kernel))


def step_group(opt, group, params: list, ids: dict, on_cpu: bool = False) -> None:
    """Step `params` (all covered by the kernels, or on_cpu: by the CPU path) of one param group."""
    plan = _steady_plan(opt, group, params, ids, on_cpu)
    if plan is not None:
        _step_steady(opt, group, plan, on_cpu)
        return
    names = opt.state_names
    runs: dict[tuple, Run] = {}
    for p in params:
        step, since, written = opt.step_counters(group, p, ids[id(p)])
        st = opt.state[p]
        grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
        key = (p.get_device(), p.dtype, grad.dtype, step, since, written)
        run = runs.get(key)
        if run is None:
            run = runs[key] = Run(p.device, launch.VALUE_KINDS[p.dtype], launch.VALUE_KINDS[grad.dtype], step, since,
                                  written=dict(zip(names, written)), fresh={n: w == 0 for n, w in zip(names, written)},
                                  launch=cpu.launcher(opt.kernel) if on_cpu else launcher(opt.kernel))
            for n in names:
                layout = launch.kernel_layout(opt.spec_for(group, p, n), minifloats=on_cpu)
                run.layouts[n] = layout
                run.tables[n] = layout.table(p.device)
        run.params.append(p)
        run.members.append(launch.Member(param=p, grad=grad, states={n: (st[n]["codes"], st[n]["scales"]) for n in names},
                                         nonfinite=st["nonfinite"], tensor_id=ids[id(p)]))
    for run in runs.values():
        block = next(iter(run.layouts.values())).block
        if opt.kernel_needs_out:
            _attach_workspace(opt, run)
        batch = CpuBatch(run.members, group["seed"]) if on_cpu else _cached_batch(opt, run.members, block, group["seed"])
        opt.launch_kernel(group, batch, run)
        states = [opt.state[p] for p in run.params]
        _set_counters(opt, run, states)
    plans = opt.__dict__.setdefault("_plans", {})
    plans.pop(id(group), None)
    if len(runs) == 1 and not opt.kernel_needs_out:  # run, batch, states: the one launch's
        plans[id(group)] = SteadyPlan(group, group["states"], on_cpu, run, states, [p.data_ptr() for p in run.params],
                                      run.members[0].grad.dtype, batch if on_cpu else None)
        _drop_grads(run)


def _drop_grads(run: Run) -> None:
    """A kept plan holds no gradient between steps (the next backward may allocate new ones)."""
    for m in run.members:
        m.grad = None


def counter_tensors(opt, step: int, since: int) -> tuple[torch.Tensor, torch.Tensor]:
    """0-dim int64 tensors of step and since for a batched step's states (here and
    small.py): never mutated, so every state the step writes shares the same two, and opt's
    last pair is handed out again while the values are the same (the fused launch and the
    together pass of one step; 2.5 us per tensor made)."""
    last = opt.__dict__.get("_counter_tensors")
    if last is None or last[0] != step or last[1] != since:
        last = opt.__dict__["_counter_tensors"] = (step, since, torch.tensor(step, dtype=torch.int64),
                                                   torch.tensor(since, dtype=torch.int64))
    return last[2], last[3]


def _set_counters(opt, run: Run, states: list) -> None:
    """The host counters after a launch: one (never mutated) tensor per value, shared by the
    launch's parameters (what SteadyPlan checks)."""
    step_t, since_t = counter_tensors(opt, run.step, run.since)
    for st in states:
        st["step"], st["since_reset"] = step_t, since_t
        for n in opt.state_names:
            st[n]["written"] = step_t


@dataclass
class SteadyPlan:
    """A group's last launch when it was one: reused while only the gradients change
    (_steady_plan) instead of reading each parameter's counters back from 0-dim tensors and
    building its launch key and Member; the step's Python went from ~17 to ~10 us per tensor
    (docs/cpu.md, "The steady step")."""

    group: dict
    states_config: object  # group["states"] when the plan was made (a new one: new layouts)
    on_cpu: bool
    run: Run
    states: list  # opt.state[p] of each member's parameter (load_state_dict replaces them)
    addresses: list  # each parameter's data_ptr (p.data = ... moves it)
    grad_dtype: torch.dtype
    batch: CpuBatch | None  # the CPU launch's batch, launched again (host.member_table reuses its table)


def _steady_plan(opt, group, params: list, ids: dict, on_cpu: bool) -> SteadyPlan | None:
    """The group's SteadyPlan if this step launches exactly as its last one did: the same
    parameters in the same order (at the same addresses, same dtypes, same tensor ids), their
    state dicts, counters and code / scale tensors the very objects the last step left, and
    each gradient of the same dtype; None otherwise (step_group then plans afresh)."""
    plan = opt.__dict__.get("_plans", {}).get(id(group))
    if plan is None or plan.group is not group or plan.on_cpu != on_cpu or plan.states_config is not group["states"] \
            or len(params) != len(plan.run.members):
        return None
    run, state = plan.run, opt.state
    step_t = plan.states[0]["step"]
    since_t = plan.states[0]["since_reset"]
    first = run.members[0]
    p_dtype, g_dtype, device = first.param.dtype, plan.grad_dtype, first.param.get_device()
    for p, m, st, ptr in zip(params, run.members, plan.states, plan.addresses):
        if p is not m.param or state.get(p) is not st or st["step"] is not step_t or st["since_reset"] is not since_t \
                or p.dtype is not p_dtype or p.grad.dtype is not g_dtype or p.get_device() != device \
                or ids[id(p)] != m.tensor_id or p.data_ptr() != ptr:
            return None
        for n, (codes, scales) in m.states.items():
            sn = st[n]
            if sn["written"] is not step_t or sn["codes"] is not codes or sn["scales"] is not scales:
                return None
    return plan


def _step_steady(opt, group, plan: SteadyPlan, on_cpu: bool) -> None:
    """step_group's launch from the plan: the counters advance as step_counters advances
    them (one reset decision for the launch: every member has the same step and since), and
    each member takes its parameter's new gradient."""
    last = plan.run
    step, since, reset = opt.reset_policy.advance(last.step, last.since)
    written = {n: 0 if reset else last.step for n in opt.state_names}
    run = Run(last.device, last.p_kind, last.g_kind, step, since, written=written,
              fresh={n: w == 0 for n, w in written.items()}, layouts=last.layouts, tables=last.tables,
              params=last.params, members=last.members, launch=last.launch)
    for m in run.members:
        g = m.param.grad
        m.grad = g if g.is_contiguous() else g.contiguous()
    block = next(iter(run.layouts.values())).block
    if on_cpu:
        if plan.batch.seed != group["seed"]:
            plan.batch = CpuBatch(run.members, group["seed"])
        batch = plan.batch
    else:
        batch = _cached_batch(opt, run.members, block, group["seed"])
    opt.launch_kernel(group, batch, run)
    _set_counters(opt, run, plan.states)
    _drop_grads(run)
    plan.run = run


def _cached_batch(opt, members, block, seed):
    cache = opt.__dict__.setdefault("_kernel_batches", {})
    key = launch.batch_key(members, block, seed)
    batch = cache.get(key)
    if batch is None:
        if len(cache) >= MAX_CACHED_BATCHES:
            cache.clear()
        batch = cache[key] = launch.build_batch(members, block, seed)
    return batch


def _attach_workspace(opt, run: Run) -> None:
    """Give each member an fp32 output view (Muon's update) in one reused buffer; offsets
    are multiples of 4 elements, so every view stays 16-byte aligned."""
    sizes = [-(-m.param.numel() // 4) * 4 for m in run.members]
    key = (run.device, tuple(id(p) for p in run.params))
    spaces = opt.__dict__.setdefault("_kernel_workspaces", {})
    ws = spaces.get(key)
    if ws is None or ws.numel() < sum(sizes):
        if len(spaces) >= MAX_CACHED_BATCHES:
            spaces.clear()
        ws = spaces[key] = torch.empty(sum(sizes), dtype=torch.float32, device=run.device)
    offset = 0
    for m, size in zip(run.members, sizes):
        m.out = ws[offset:offset + m.param.numel()].view(m.param.shape)
        offset += size
