"""The CPU path's one launch per step (kernels/cpu/host.member_table, run_members): every
tensor of a launch stepped by one kernel call, the launch's blocks split over threads across
tensors, the table of addresses cached while the tensors stay, the random streams' keys
computed in the kernel (codec.step_keys), and the optimizers' routing memoized
(optim/base._route). Skipped where numba is not installed."""
import numpy as np
import pytest
import torch

from kernel_parity import assert_same_state, make_pair, step_both
from qstate_cli.kernels import cpu
from qstate_cli.kernels.launch import Member
from qstate_cli.optim import SGD, AdamW, Lion, Muon
from qstate_cli.runtime import torch_threads

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")
# each tensor under host.MIN_THREAD_ELEMENTS (one thread apiece before), 134,231 elements in all
SMALL = [(200, 200), (33, 7), (150, 200), (256, 250)]
# the presets `make test-cpu-path` compiles already (tests/test_kernels_cpu*.py): no new compilation in CI
OPTIMIZERS = [(AdamW, dict(states="sr-4bit", lr=1e-2, weight_decay=0.1)),
              (Lion, dict(states="bred-4bit", lr=1e-3, weight_decay=0.1)),
              (SGD, dict(states="sr-4bit", lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
              (Muon, dict(states="nearest-4bit", lr=0.02, momentum=0.95))]


@needs_numba
@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=["adamw-sr", "lion-bred", "sgd-sr", "muon-nearest"])
def test_two_threads_split_a_launch_of_small_tensors_across_them(cls, kw):
    """Two ranges of the launch's blocks, the edge inside the third tensor: codes, scales,
    parameters and per-tensor non-finite counts (a NaN, +Inf and -Inf in every gradient at
    step 2) equal the reference's at every step."""
    from qstate_cli.kernels.cpu import host
    with torch_threads(2):
        ref, ker = make_pair(cls, SMALL, backend="cpu", device="cpu", **kw)
        block = ker.spec_for(ker.param_groups[0], ker.param_groups[0]["params"][0], "m").block
        blocks = np.cumsum([0] + [-(-torch.Size(s).numel() // block) for s in SMALL])
        assert host.parts_of(int(sum(torch.Size(s).numel() for s in SMALL))) == 2
        assert blocks[2] < blocks[-1] // 2 < blocks[3]  # the edge: inside (150, 200)
        gen = torch.Generator().manual_seed(1)
        for t in range(1, 4):
            step_both(ref, ker, gen, poison=(t == 2))
            assert_same_state(ref, ker, t)
        assert ker.nonfinite_count() == 3 * len(SMALL)


@needs_numba
def test_the_table_is_kept_while_the_tensors_stay_and_follows_a_new_gradient():
    """Same parameters, states and gradients: the cached table, nothing rebuilt. Gradients
    allocated anew (a backward after zero_grad(set_to_none=True)): the same table with the
    new addresses, and the step still equals the reference."""
    from qstate_cli.kernels.cpu import adamw
    ref, ker = make_pair(AdamW, [(300,), (17, 9)], backend="cpu", device="cpu", states="bred-4bit")
    seen = []
    run_members = adamw.run_members
    adamw.run_members = lambda kernel, table, block, args: seen.append(table) or run_members(kernel, table, block, args)
    try:
        gen = torch.Generator().manual_seed(3)
        step_both(ref, ker, gen)  # builds the table
        for p in ker.param_groups[0]["params"]:
            p.grad.mul_(0.5)  # the same gradient tensors, new values
        for p in ref.param_groups[0]["params"]:
            p.grad.mul_(0.5)
        ref.step()
        ker.step()
        assert_same_state(ref, ker, 2)
        step_both(ref, ker, gen)  # new gradient tensors
        assert_same_state(ref, ker, 3)
    finally:
        adamw.run_members = run_members
    assert seen[0] is seen[1] is seen[2]
    grads = [p.grad.data_ptr() for p in ker.param_groups[0]["params"]]
    assert list(seen[2].arrays[:, 2]) == grads
    assert list(seen[2].first) == [0, -(-300 // 128), -(-300 // 128) + -(-153 // 128)]


@needs_numba
def test_a_launch_refuses_members_of_different_dtypes():
    from qstate_cli.kernels.cpu import adamw, host
    members = []
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.zeros(256, dtype=dtype)
        members.append(Member(param=p, grad=torch.zeros_like(p), nonfinite=torch.zeros((), dtype=torch.int64),
                              states={n: (torch.zeros(128, dtype=torch.uint8), torch.zeros(2)) for n in "mv"},
                              tensor_id=len(members)))
    with pytest.raises(ValueError, match="share one dtype"):
        host.member_table(host.CpuBatch(members), adamw._columns, 128, 2)


@needs_numba
@pytest.mark.parametrize("key,step", [(0, 0), (0xFFFFFFFF, 1), (0x9E3779B9, 0xFFFFFFFF), (12345, 1 << 31),
                                      (0xDEADBEEF, 7)])
def test_the_kernels_keys_are_the_hosts(key, step):
    """codec.step_keys (in the kernels) against host.keys (quant/hash.stream_keys' last two)."""
    from qstate_cli.kernels.cpu import codec, host
    got = codec.step_keys(np.uint32(key), host.step_words(step)[0])
    assert [int(k) for k in got] == host.keys(key, step)


@needs_numba
def test_routing_follows_what_it_reads_after_it_is_memoized():
    """The memoized route changes with the backend, the group's min_quant_numel, the
    parameter's dtype and layout (optim/base._route's key), and the reason names the cause."""
    p = torch.nn.Parameter(torch.randn(64, 32))
    p.grad = torch.randn(64, 32)
    opt = AdamW([p], states="nearest-4bit", min_quant_numel=4096, backend="reference")
    assert opt.why_reference(p) == "backend='reference' was asked for"
    opt.backend = "auto"
    # a small tensor's fp32 states: AdamW steps them in small.py's one numba pass (a route of 3)
    group = opt.param_groups[0]
    assert opt.path_for(p) == cpu.PATH and opt.why_reference(p) is None and len(opt._route(group, p)) == 3
    # a subclass that rewrites the rule: neither Lion's kernel nor its one pass is its rule (optim/rule_traits.py)
    rewritten = type("MyLion", (Lion,), {"update": lambda self, *a: Lion.update(self, *a)})
    assert rewritten([p], states="nearest-4bit").why_reference(p) == "MyLion rewrites `update`: Lion's kernel is not its rule"
    assert Lion([p], states="nearest-4bit", min_quant_numel=4096).path_for(p) == cpu.PATH  # Lion's own pass
    group["min_quant_numel"] = 0
    assert opt.path_for(p) == cpu.PATH and opt.why_reference(p) is None and len(opt._route(group, p)) == 2
    p.data = p.data.double()
    p.grad = torch.randn(64, 32, dtype=torch.float64)
    assert "float64" in opt.why_reference(p)
    p.data = torch.randn(32, 64).t()
    p.grad = torch.randn(64, 32)
    assert opt.why_reference(p) == "parameter is not contiguous"
    p.data = torch.randn(64, 32)
    assert opt.path_for(p) == cpu.PATH


@needs_numba
def test_a_steady_step_reuses_the_launch_until_something_but_the_gradients_changes(monkeypatch):
    """optim/fused.SteadyPlan: from the second step the group's last launch is stepped again
    (its counters advanced once for the launch, a reset included), and a moved parameter or
    a loaded state dict plans afresh; every step equals the reference bit for bit."""
    from qstate_cli.optim import fused
    steady = []
    step_steady = fused._step_steady
    monkeypatch.setattr(fused, "_step_steady", lambda *a: steady.append(len(steady)) or step_steady(*a))
    ref, ker = make_pair(AdamW, SMALL, backend="cpu", device="cpu", states="sr-4bit", reset=3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(5)
    took = []
    for t in range(1, 8):
        if t == 5:  # a parameter moved to new memory (p.data = ...): a new launch table
            for opt in (ref, ker):
                p = opt.param_groups[0]["params"][1]
                p.data = p.data.clone()
        if t == 6:  # a checkpoint loaded: new state dicts and groups
            ker.load_state_dict(ker.state_dict())
        before = len(steady)
        step_both(ref, ker, gen, poison=(t == 3))
        assert_same_state(ref, ker, t)
        took.append(len(steady) > before)
    assert took == [False, True, True, True, False, False, True]
    assert [int(ker.state[p]["since_reset"]) for p in ker.param_groups[0]["params"]] == [1] * len(SMALL)  # reset at 7
    assert ker.nonfinite_count() == 3 * len(SMALL)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_whole_group_steps_from_its_plan_unrouted_until_a_route_could_change(backend, monkeypatch):
    """optim/steady.ready: from the second step no parameter of a group the plan holds whole
    is routed (base._route is not called), and every step equals the reference bit for bit.
    It declines (None, nothing stepped) where a route could differ: a parameter without a
    gradient, one made non-contiguous or shrunk at the same address (what the plan's own
    address check does not see), a sparse gradient, another backend or min_quant_numel;
    undone, the group steps from the record again. On both fused paths (`triton`: Triton's interpreter here)."""
    from qstate_cli.kernels import unavailable_reason
    from qstate_cli.optim import steady
    why = cpu.unavailable_reason("cpu") if backend == "cpu" else unavailable_reason(torch.device("cpu"))
    if why is not None:
        pytest.skip(why)
    ref, ker = make_pair(AdamW, [(64, 48), (300,)], backend=backend, device="cpu", states="sr-4bit",
                         weight_decay=0.1)
    routes = []
    route = type(ker)._route
    monkeypatch.setattr(ker, "_route", lambda group, p: routes.append(p) or route(ker, group, p))
    gen = torch.Generator().manual_seed(8)

    def step(t, routed):
        del routes[:]
        step_both(ref, ker, gen)
        assert (len(routes) > 0) == routed, f"step {t}: {len(routes)} routes"
        assert_same_state(ref, ker, t)

    step(1, routed=True)
    step(2, routed=False)
    group, ids = ker.param_groups[0], ker.tensor_ids()
    w, b = group["params"]
    wd, bd, wg = w.data, b.data, w.grad
    changes = {"no gradient": (lambda: setattr(w, "grad", None), lambda: setattr(w, "grad", wg)),
               "non-contiguous": (lambda: setattr(w, "data", wd.t()), lambda: setattr(w, "data", wd)),
               "shrunk": (lambda: setattr(b, "data", bd[:150]), lambda: setattr(b, "data", bd)),
               "sparse gradient": (lambda: setattr(w, "grad", wg.to_sparse()), lambda: setattr(w, "grad", wg)),
               "backend": (lambda: setattr(ker, "backend", "reference"), lambda: setattr(ker, "backend", backend)),
               "min_quant_numel": (lambda: group.update(min_quant_numel=1000),
                                   lambda: group.update(min_quant_numel=0))}
    before = [t.clone() for t in (wd, bd, *ker.state[w]["m"].values())]
    for name, (change, undo) in changes.items():
        change()
        assert w.data_ptr() == wd.data_ptr() and b.data_ptr() == bd.data_ptr()
        assert steady.ready(ker, group, ids) is None, name
        undo()
    assert all(torch.equal(a, c) for a, c in zip(before, (wd, bd, *ker.state[w]["m"].values())))
    whole = steady.ready(ker, group, ids)
    assert whole is not None  # everything undone: it steps (the reference too)
    steady.step_ready(ker, group, whole)
    ref.step()
    assert_same_state(ref, ker, 3)
    step(4, routed=False)
    b.data = bd.clone()  # moved: planned afresh, then steady again
    ref.param_groups[0]["params"][1].data = ref.param_groups[0]["params"][1].data.clone()
    step(5, routed=True)
    step(6, routed=False)


@needs_numba
def test_a_kept_plan_holds_no_gradient_between_steps():
    """The plan keeps its launch's members, not their gradients: a gradient dropped by
    zero_grad(set_to_none=True) is freed before the next backward allocates its successor."""
    import gc
    import weakref
    p = torch.nn.Parameter(torch.randn(300, 7))
    opt = AdamW([p], states="nearest-4bit", backend="cpu", min_quant_numel=0)
    for _ in range(2):
        p.grad = torch.randn(300, 7)
        opt.step()
    assert opt._plans  # the plan kept
    grad = weakref.ref(p.grad)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None
