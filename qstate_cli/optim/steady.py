"""A param group stepped again as its last step stepped it, without routing each parameter.

base.step routes every parameter of a group (base._route: the fused kernels, the together
pass of optim/small.py, or the reference) and then plans the launches. While only the
gradients change, the next step routes and plans the same way. This module keeps what a
group's last step did, when it was the usual case, and steps the group from that record:

    WholeGroup        the group's parameters in order, with what each one's route read (its
                      dtype, its gradient's dtype, device, size and contiguity), the fused
                      launch's SteadyPlan (optim/fused.py) and the together pass's one run
                      (small.TogetherRun), either of them possibly absent
    remember          after a routed step: a WholeGroup when every parameter had a gradient
                      and went to one fused launch or one together run (none to the
                      reference), else no record
    ready             before routing: the group's WholeGroup if the record still holds (the
                      same objects, route inputs, counters and states that the last step
                      left; the same backend, `states` and min_quant_numel), else None;
                      it only reads, so base.step asks every group first, and when all hold
                      it skips its own scans (sparse gradients, DTensors: ~20 us for 29
                      tensors), which a recorded parameter and its gradient cannot fail
    step_ready        steps the group from the record `ready` returned

Routing cost ~0.85 us per parameter and step, the together pass's counters and specs about as
much again (docs/cpu.md, "The whole group unrouted"). The bits are the routed step's:
tests/test_kernels_cpu_launch.py and tests/test_optim_small.py step both ways against the
reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fused
from .small import TogetherRun


@dataclass
class WholeGroup:
    group: dict
    states_config: object  # group["states"] then
    backend: str
    min_quant_numel: int
    params: list  # the group's parameters, in order
    fused: list  # per parameter: True if the fused launch stepped it, False if the together run did
    inputs: list  # per parameter: route_inputs(p) then
    plan: fused.SteadyPlan | None
    together: TogetherRun | None


def route_inputs(p: torch.Tensor) -> tuple:
    """What base._route and base.step read of p besides the group (a parameter object keeps
    its type, so a recorded one is no DTensor): dtypes, device, size, contiguity, where its
    elements lie (a parameter moved onto another's memory steps by the reference: optim/aliasing.py)
    and the gradient's layout (a sparse one is refused before any parameter steps)."""
    g = p.grad
    return p.dtype, g.dtype, g.layout, p.device, p.numel(), p.is_contiguous(), p.data_ptr()


def remember(opt, group, fused_params: dict, runs: list) -> None:
    """Record the group's routed step just taken (fused_params: on_cpu -> the parameters of
    fused.step_group; runs: small.step_together's), or drop the group's record where the step
    was not one fused launch and at most one together run covering every parameter."""
    wholes = opt.__dict__.setdefault("_wholes", {})
    wholes.pop(id(group), None)
    params = list(group["params"])
    if len(fused_params) > 1 or len(runs) > 1 or any(p.grad is None for p in params):
        return
    launched = next(iter(fused_params.values()), [])
    together = runs[0] if runs else None
    if len(launched) + (len(together.params) if together else 0) != len(params):  # some stepped by the reference
        return
    plan = opt.__dict__.get("_plans", {}).get(id(group)) if launched else None
    if launched and (plan is None or len(plan.run.params) != len(launched)
                     or any(p is not q for p, q in zip(plan.run.params, launched))):
        return
    mine = {id(p) for p in launched}
    wholes[id(group)] = WholeGroup(group, group["states"], opt.backend, group["min_quant_numel"], params,
                                   [id(p) in mine for p in params], [route_inputs(p) for p in params], plan, together)


def ready(opt, group, ids: dict) -> WholeGroup | None:
    """The group's WholeGroup if the group can step from it (module docstring), else None;
    reads only, so base.step checks every group before it steps any."""
    w = opt.__dict__.get("_wholes", {}).get(id(group))
    if w is None or w.group is not group or w.states_config is not group["states"] or w.backend != opt.backend \
            or w.min_quant_numel != group["min_quant_numel"] or len(group["params"]) != len(w.params):
        return None
    launched, together = [], []
    for p, q, in_launch, seen in zip(group["params"], w.params, w.fused, w.inputs):
        if p is not q or p.grad is None or route_inputs(p) != seen:
            return None
        (launched if in_launch else together).append(p)
    plan = w.plan
    if plan is not None and (opt.__dict__.get("_plans", {}).get(id(group)) is not plan
                             or fused._steady_plan(opt, group, launched, ids, plan.on_cpu) is not plan):
        return None
    if w.together is not None and not w.together.holds(opt, together, ids):
        return None
    return w


def step_ready(opt, group, w: WholeGroup) -> None:
    """Step the group from the record `ready` returned (nothing changed in between)."""
    if w.plan is not None:
        fused._step_steady(opt, group, w.plan, w.plan.on_cpu)
    if w.together is not None:
        w.together.step_again(opt, group)
