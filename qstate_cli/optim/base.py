"""QuantizedOptimizer: a torch.optim.Optimizer whose states are stored as QuantizedState.

Per parameter, `optimizer.state[p]` holds plain tensors only (so a checkpoint loads with
`weights_only=True`):

    step         int64: optimizer steps taken (keys the random streams; never reset)
    since_reset  int64: steps since the last reset (drives bias correction)
    nonfinite    int64: gradient elements that were NaN/Inf (treated as 0, see below)
    m, v         {"codes", "scales", "written"} of each QuantizedState

Policy for non-finite gradients: each NaN/Inf gradient element is replaced by 0 before
the update (the element's moments decay, its parameter still moves by its decayed
momentum) and counted in `nonfinite`; nothing crashes and nothing else is touched.

Random streams: stream (seed, tensor_id, state_id) with tensor_id = the parameter's
position across param_groups and state_id = 0 for m, 1 for v.

Tensors with fewer than `min_quant_numel` elements keep fp32 states (as bitsandbytes
does below 4096); pass 0 to quantize everything.

Backends (`backend=`): "reference" steps every parameter with the pure-torch rules;
"triton" uses the fused kernels (on CUDA tensors, or in Triton's interpreter on CPU when
TRITON_INTERPRET=1 is set); "cpu" the fused CPU path (kernels/cpu: numba, CPU tensors,
fp32 or bf16); "auto" (default) is triton for CUDA tensors when the kernels are
available, cpu for CPU tensors when numba imports, and reference otherwise. Either way a
parameter the kernels do not cover (states in fp32 or a minifloat format, small tensors
below `min_quant_numel`, fp64 or non-contiguous parameters, m and v with different block
sizes, on the CPU path fp16 and optimizers without a CPU kernel, a parameter sharing memory
with another of its group: optim/aliasing.py; `why_reference(p)` says
which, and also why "auto" found no path) is stepped by the reference. `path_for(p)` names
what steps p: "triton", "triton-interpreter", "cpu-numba" or "reference" (benchmarks label
every row with it; "cpu-numba" also for AdamW / Adam, Lion, SGD and Muon whose states are
bf16, fp16 or fp32, which optim/small.py steps together in one numba pass). All paths keep
the same state layout, so checkpoints move between them (optim/fused.py). With a backend
other than "reference", the CPU tensors the reference steps whose states are stored
elementwise (fp32, as below min_quant_numel; bf16, fp16 or fp8 without scales, rounded to
nearest or stochastically) step together, in one pass of the same ops (optim/small.py;
Muon's Newton-Schulz still per matrix, `update_flat`).
"""
from __future__ import annotations


import torch

from ..errors import QstateError
from ..quant.config import MIN_QUANT_NUMEL, STATE_IDS, StateConfig, StateSpec, parse_config, parse_spec
from ..quant.quantizer import Stream
from ..quant.state import QuantizedState
from . import aliasing, chunked, collectives, fused, guards, hparams, rule_traits, sharded_state, sharding, small, steady
from .borrowed import HANDED, copy_on_write, handed_out, own_dicts, unshare
from .checkpoint import load
from .spec_checks import check_state_spec
from .reset import ResetPolicy, auto_period

FP32_SPEC = parse_spec("fp32")
SHARDED_PATH_REASON = ("sharded (DTensor) parameter: the reference steps its local shard "
                       "(the kernels take no global counter offset yet)")
BACKENDS = ("auto", "reference", "triton", "cpu")  # what steps a parameter (module docstring)
# torch.compiler.disable, but importing torch._dynamo (~3 s) at the first step instead of when
# this module is imported (every qstate command imports it): torch's own lazy form where this
# torch has it, else the public one (a compiled training loop still runs the step eagerly:
# tests/test_optim.py::test_a_compiled_training_loop_steps_as_eager)
_eager_only = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


MAX_ROUTES = 256  # distinct (parameter kind, group) routes an optimizer remembers
BORROWED = "_borrowed_states"  # __dict__ key: parameters whose loaded states share the loaded dict's storage


class QuantizedOptimizer(torch.optim.Optimizer):
    state_names: tuple[str, ...] = ("m",)
    kernel: str | None = None  # the fused kernel module (kernels/<kernel>.py; fused.launcher)
    kernel_needs_out = False  # the kernel writes an fp32 update per parameter (Muon)
    elementwise = False  # `update` is elementwise (optim/rule_traits.py: counts only beside the `update` it describes)
    adam_moments = False  # m, v are Adam's moments: diagnose's Gaussian model applies (AdamW's docstring)
    later_hparams: dict = {}  # hyper-parameters added after checkpoints were saved: a group without one loads its default

    def __init__(self, params, defaults: dict, states="bred-4bit", reset=None, seed: int = 0,
                 min_quant_numel: int = MIN_QUANT_NUMEL, backend: str = "auto"):
        hparams.check(defaults, ValueError)  # as torch.optim's constructors (optim/hparams.py)
        defaults = dict(defaults, states=parse_config(states), seed=int(seed), min_quant_numel=int(min_quant_numel))
        for name in self.state_names:  # a configuration without a spec for one of them fails here, not at step 1
            check_state_spec(type(self).__name__, name, defaults["states"].spec(name))
        super().__init__(params, defaults)
        if not rule_traits.elementwise(type(self)):  # Muon: refused when built, not at the first step (after the others stepped)
            self._refuse_shards()
        self.reset_policy = ResetPolicy.parse(reset)
        if self.reset_policy.auto:
            self.reset_policy = self._resolve_auto_reset()
        if backend not in BACKENDS:
            raise QstateError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")
        self.backend = backend

    def path_for(self, p: torch.Tensor) -> str:
        """'triton', 'triton-interpreter', 'cpu-numba' or 'reference': what steps parameter p."""
        return self._route_of(p)[0]

    def why_reference(self, p: torch.Tensor) -> str | None:
        """Why the reference steps p (None if a fused path steps it)."""
        return self._route_of(p)[1]

    def _route_of(self, p: torch.Tensor, group: dict | None = None, shared: set | None = None) -> tuple:
        """_route, or the reference where a fused path would step p and p overlaps another
        parameter of its group (optim/aliasing.py); a caller asking of every parameter (audit)
        passes the group and its aliasing.overlapping set, made once."""
        group = self._group_of(p) if group is None else group
        route = self._route(group, p)
        if route[0] != "reference" and id(p) in (aliasing.overlapping(group["params"]) if shared is None else shared):
            return "reference", aliasing.OVERLAP_REASON
        return route

    def _route(self, group, p: torch.Tensor) -> tuple[str, str | None]:
        """(path, why the reference steps p or None); raises where an explicit backend cannot run.
        Memoized on everything the answer reads (the backend, p's type, device, dtype, layout
        and size, its gradient's dtype and sparsity, the group's states and min_quant_numel):
        routing every parameter afresh cost ~6 us each per step (docs/cpu.md, "One launch per step")."""
        g = p.grad
        states = group["states"]
        key = (self.backend, type(p), p.device, p.dtype, p.is_contiguous(), p.numel(),
               None if g is None else (g.dtype, g.is_sparse), group["min_quant_numel"], id(states))
        routes = self.__dict__.setdefault("_routes", {})
        hit = routes.get(key)
        if hit is None:
            if len(routes) >= MAX_ROUTES:
                routes.clear()
            hit = routes[key] = (self._route_afresh(group, p), states)  # holding states keeps its id unique
        return hit[0]

    def _route_afresh(self, group, p: torch.Tensor) -> tuple[str, str | None]:
        if self.backend == "reference":
            return "reference", "backend='reference' was asked for"
        if sharding.is_dtensor(p):
            return "reference", SHARDED_PATH_REASON
        on_cpu = self.backend == "cpu" or (self.backend == "auto" and p.device.type == "cpu")
        unavailable = fused.cpu_unavailable(p.device) if on_cpu else fused.kernels_unavailable(p.device)
        if unavailable is not None:
            if self.backend == "cpu":
                raise QstateError(f"backend='cpu' needs numba and CPU tensors ({unavailable})")
            if self.backend == "triton":
                raise QstateError(f"backend='triton' needs Triton and a CUDA device or TRITON_INTERPRET=1 "
                                  f"({unavailable})")
            return "reference", unavailable
        why = fused.why_reference(self, group, p, on_cpu=on_cpu)
        if why is not None and on_cpu and small.one_pass(self, group, p):
            return fused.cpu.PATH, None, True  # stepped together in one numba pass (optim/small.py)
        if why is not None:
            return "reference", why
        if on_cpu:
            return fused.cpu.PATH, None
        return ("triton" if p.is_cuda else "triton-interpreter"), None

    def _group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise QstateError("parameter is not in this optimizer")

    # ---- configuration -------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """As torch's, checked (optim/guards.py); its `states` held parsed (a name is parsed here, once)."""
        if "states" in param_group:
            param_group["states"] = parse_config(param_group["states"])
        super().add_param_group(param_group)
        guards.check_new_group(self)  # the group just added (taken out again where refused)
        self.__dict__.pop(collectives.AGREED, None)  # checked across ranks again at the next step

    def config(self, group) -> StateConfig:
        states = group["states"]  # a name set by hand: parsed (base.step stores it parsed: optim/guards.py)
        return states if isinstance(states, StateConfig) else parse_config(states)

    __getstate__ = guards.getstate  # copies and pickles keep backend, reset_policy, ...; no caches
    __setstate__ = guards.setstate

    def spec_for(self, group, p: torch.Tensor, name: str) -> StateSpec:
        if p.numel() < group["min_quant_numel"]:
            return FP32_SPEC
        return self.config(group).spec(name)

    def tensor_ids(self) -> dict[int, int]:
        ids, i = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                ids[id(p)] = i
                i += 1
        return ids

    def _resolve_auto_reset(self, policy: ResetPolicy | None = None) -> ResetPolicy:
        """`policy` (default: this optimizer's), if 'auto', with the theory-guided period of
        group 0's reset state (reset.auto_period); `reset_policy.basis` says why."""
        group = self.param_groups[0]
        state = self.reset_state(group)
        return (policy or self.reset_policy).resolved(*auto_period(self.config(group).spec(state),
                                                                   self.state_betas(group)[state]))

    # ---- the rule, per optimizer (optimizers.py) --------------------------------------
    @staticmethod
    def state_betas(hp: dict) -> dict[str, float]:
        """{state: the EMA beta that sets its memory} from a group's hyper-parameters."""
        raise NotImplementedError

    @classmethod
    def reset_state(cls, hp: dict) -> str:
        """The state with the longest memory (largest beta): a reset is timed on it."""
        betas = cls.state_betas(hp)
        return max(cls.state_names, key=lambda s: betas[s])

    @staticmethod
    def replay_step(hp: dict, g: torch.Tensor, x_hat: dict, s, first: dict):
        """(update direction, {state: new fp32 state}) of one replayed step (optimizers.py): on
        a trace's sampled elements as one flat vector, so elementwise (diagnose/gaps.py steps
        groups of them apart)."""
        raise NotImplementedError

    @staticmethod
    def replay_notes(hp: dict) -> list[str]:
        """What a replay of this optimizer leaves out, for these hyper-parameters."""
        return []

    # ---- state access ----------------------------------------------------------------
    def load_states(self, group, p, tensor_id: int) -> dict[str, QuantizedState]:
        """p's states as QuantizedState objects (created empty on first use). For a sharded
        parameter: the states of its local shard, with global counters (optim/sharding.py);
        the format is chosen from the whole tensor's size (a tensor scale: optim/collectives.py)."""
        st = self.state[p]
        layout = sharding.layout_of(p)
        local = sharding.local_tensor(p)
        if not st:
            st["step"] = torch.zeros((), dtype=torch.int64)
            st["since_reset"] = torch.zeros((), dtype=torch.int64)
            st["nonfinite"] = torch.zeros((), dtype=torch.int64, device=local.device)
            for name in self.state_names:
                q = QuantizedState(self.spec_for(group, p, name), layout.local_shape,
                                   self._stream(group, tensor_id, name, layout.offset), device=local.device)
                st[name] = q.to_tensors()
        return collectives.with_tensor_scales(p, {
            name: QuantizedState.from_tensors(self.spec_for(group, p, name), layout.local_shape,
                                              self._stream(group, tensor_id, name, layout.offset), st[name])
            for name in self.state_names})

    def decoded_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """{state name ('m', and 'v' for AdamW / Adam): its value as the next step reads it}
        for parameter p: fp32 in p's shape (a DTensor's: its local shard's), decoded from the
        stored codes and scales as every path's step decodes them (a dithered v read back below
        0 clamped to 0), zeros where never written (or p never stepped); a reset due at the next
        step is not applied. For AdamW, m and v are torch's exp_avg and exp_avg_sq (before
        bias correction). New tensors: changing them changes nothing stored."""
        group = self._group_of(p)
        st = self.state.get(p)
        if not st:
            local = sharding.local_tensor(p)
            return {name: torch.zeros(sharding.layout_of(p).local_shape, dtype=torch.float32, device=local.device)
                    for name in self.state_names}
        states = self.load_states(group, p, self.tensor_ids()[id(p)])
        values = chunked.read(states)
        return {name: x.clone() if x.untyped_storage().data_ptr() == states[name].codes.untyped_storage().data_ptr()
                else x for name, x in values.items()}

    def step_counters(self, group, p, tensor_id: int) -> tuple[int, int, tuple[int, ...]]:
        """(this step, steps since the last reset including this one, the step each state was
        written at, 0 if never or reset now) of p's next step: what a fused or batched pass keys
        its launches on (optim/fused.py, optim/small.py). Creates p's (empty) states on first use."""
        st = self.state[p]
        if not st:
            self.load_states(group, p, tensor_id)
        step, since, reset = self.reset_policy.advance(int(st["step"]), int(st["since_reset"]))
        return step, since, tuple(0 if reset else int(st[n]["written"]) for n in self.state_names)

    def _stream(self, group, tensor_id: int, name: str, offset: int = 0) -> Stream:
        return Stream(group["seed"], tensor_id, STATE_IDS[name], offset)

    def audit(self, names: dict | None = None) -> list:
        """One AuditRow per parameter and state: global and local shape, path, format,
        bytes, block layout and the reason (optim/audit.py). `names`: {param: name}."""
        from .audit import audit_optimizer

        return audit_optimizer(self, names)

    def state_nbytes(self) -> int:
        """Bytes held by all optimizer states (codes + scales) right now."""
        total = 0
        for st in self.state.values():
            for name in self.state_names:
                if name in st:
                    total += sum(t.numel() * t.element_size() for k, t in st[name].items() if k != "written")
        return total

    def nonfinite_count(self) -> int:
        return int(sum(int(st["nonfinite"]) for st in self.state.values() if "nonfinite" in st))

    # ---- the step ----------------------------------------------------------------------
    # Kept out of torch.compile's graph (a graph break, then eager): dynamo tracing the packed
    # codes, the hash and the fused launches gave up with a RecursionError (or compiled for
    # minutes); the step is one fused launch per group already, so compiling it gains nothing.
    # A compiled training loop runs its forward/backward compiled and this step as written.
    @_eager_only
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        collectives.agree_once(self)  # sharded parameters: every rank the same configuration (first step)
        if self.__dict__.pop(HANDED, False):  # the first step after state_dict(): never write into the dict handed out
            self.__dict__.pop(BORROWED, None)  # (every state is copied: the loaded ones too)
            guards.forget_state_tensors(self)  # first: each old tensor goes as its copy replaces it
            copy_on_write(self)
        elif self.__dict__.get(BORROWED):
            self._unshare_loaded()  # the first step after load_state_dict: never write into the loaded dict
        ids = self.tensor_ids()
        ready = [steady.ready(self, group, ids) for group in self.param_groups]  # each as its last step?
        if any(r is None for r in ready):  # before anything is written: sparse gradients, states that no
            guards.before_routed_step(self, ready)  # longer fit, changed formats, DTensors for Muon (guards.py)
        for group, whole in zip(self.param_groups, ready):
            if whole is not None:  # as its last step, nothing routed
                steady.step_ready(self, group, whole)
                continue
            fused_params: dict[bool, list] = {}  # on the CPU path? -> parameters
            together = []  # elementwise states: the reference's ops in one pass (optim/small.py)
            shared = aliasing.overlapping(group["params"])  # stepped one by one, in order (optim/aliasing.py)
            for p in group["params"]:
                if p.grad is None:
                    continue
                route = self._route(group, p)  # (path, why the reference steps it[, stepped together])
                if id(p) in shared:
                    self._step_param(group, p, ids[id(p)])
                elif route[0] != "reference" and len(route) == 2:
                    fused_params.setdefault(route[0] == fused.cpu.PATH, []).append(p)
                elif small.steps_together(self, group, p):
                    together.append(p)
                else:
                    self._step_param(group, p, ids[id(p)])
            for on_cpu, params in fused_params.items():
                fused.step_group(self, group, params, ids, on_cpu=on_cpu)
            steady.remember(self, group, fused_params, small.step_together(self, group, together, ids))
        return loss

    def _refuse_shards(self) -> None:
        collectives.refuse_shards(self)

    def launch_kernel(self, group, batch, run) -> None:
        """Step the tensors of `batch` with this optimizer's fused kernel (optim/fused.py)."""
        raise NotImplementedError

    def _step_param(self, group, p, tensor_id: int) -> None:
        """The reference step of p (optim/chunked.py): whole, or, for an elementwise rule
        (`elementwise`) and a tensor above one chunk, in chunks that give the same bits."""
        states = self.load_states(group, p, tensor_id)
        st = self.state[p]
        step = int(st["step"]) + 1
        since = int(st["since_reset"])
        if self.reset_policy.should_reset(step, since):
            for q in states.values():
                q.reset()
            since = 0
        since += 1
        first = {name: q.written == 0 for name, q in states.items()}
        local = sharding.local_tensor(p.detach())
        grad = sharding.local_tensor(p.grad.detach())
        size = chunked.chunk_size(self, states, local, grad)
        if size is None:
            chunked.step_whole(self, group, states, st, local, grad, step, since, first)
        else:
            chunked.step_in_chunks(self, group, states, st, local, grad, step, since, first, size)
        for name, q in states.items():
            st[name] = q.to_tensors()
        st["step"] = torch.tensor(step, dtype=torch.int64)
        st["since_reset"] = torch.tensor(since, dtype=torch.int64)

    def update(self, group, p32, g, x_hat: dict, since_reset: int, first: dict):
        """The rule: returns (new fp32 parameter, {state name: new fp32 state})."""
        raise NotImplementedError

    def one_pass_rule(self) -> str | None:
        """The CPU path's one-pass rule (kernels/cpu/elementwise.py: "adamw", "lion", "sgd",
        "muon") that is this optimizer's `update`, op for op, so optim/small.py may step its
        elementwise states in one numba pass; None (here, and where a subclass rewrites the
        rule: _own_rule) keeps small.py's torch ops."""
        return None

    def _own_rule(self, cls) -> bool:
        """Whether `update` and `update_flat` are cls's (no subclass rewrote the rule)."""
        return type(self).update is cls.update and type(self).update_flat is cls.update_flat

    def update_flat(self, group, shapes: list, p32, g, x_hat: dict, since_reset: int, first: dict):
        """The rule over tensors of these shapes laid end to end (flat p32, g and x_hat;
        optim/small.py): what `update` gives each tensor, concatenated. An elementwise rule
        (`elementwise`, optim/rule_traits.py) gives it over the concatenation; a rule that is not
        overrides this (Muon)."""
        if not rule_traits.elementwise(type(self)):
            raise NotImplementedError(f"{type(self).__name__}: a rule that is not elementwise needs its own update_flat")
        return self.update(group, p32, g, x_hat, since_reset, first)

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's, with each group's `states` as its name (plain data: a checkpoint loads
        with `torch.load(..., weights_only=True)`). A sharded (DTensor) parameter's states
        are DTensors for torch.distributed.checkpoint (optim/sharded_state.py); for them
        this call is collective (the ranks' configurations compared, optim/collectives.py; one
        all-reduce of the non-finite counts). The dict keeps the states as they are now, on
        every path: the next step first copies the tensors it writes in place (torch's
        optimizers hand out their live tensors; optim/borrowed.py)."""
        collectives.check_ranks_agree(self)
        sd = super().state_dict()
        sd["state"] = {k: own_dicts(v) for k, v in sd["state"].items()}  # torch's are the live dicts
        handed_out(sd["state"])  # live tensors: a load_state_dict of this dict copies them (optim/checkpoint.py)
        self.__dict__[HANDED] = True  # and the next step copies them before it writes (borrowed.copy_on_write)
        for group in sd["param_groups"]:
            group["states"] = str(group["states"])
            group["reset"] = self.reset_policy.asked  # restored by load_state_dict (checkpoint.restore_reset)
        for idx, p in enumerate(p for g in self.param_groups for p in g["params"]):
            if sharding.is_dtensor(p) and idx in sd["state"]:  # DTensors DCP can reshard (sharded_state.py)
                sd["state"][idx] = sharded_state.to_saved(p, sd["state"][idx], self._specs(p))
            elif sd["state"].get(idx):  # flat codes: the shape tells a (64, 256) weight from a (256, 64) one
                sd["state"][idx]["shape"] = torch.tensor(p.shape, dtype=torch.int64)
        return sd

    def _specs(self, p) -> dict:
        group = self._group_of(p)
        return {name: self.spec_for(group, p, name) for name in self.state_names}

    def load_state_dict(self, state_dict: dict) -> None:
        """Like torch's: the dict's structure and param_groups are copied, its tensors moved to
        their parameter's device (shared where they are there already), each keeping its dtype
        (codes are uint8, scales fp32 whatever the parameter dtype). Each group's `states` name
        is parsed back into a StateConfig, once. A state that does not fit its parameter
        (another size, block size or format; damaged) is a ValueError, and then nothing is
        replaced (optim/checkpoint.py). A loaded tensor that a step writes in place (codes,
        scales, the non-finite count) never shares storage with the dict once this optimizer
        steps: one from another optimizer's state_dict() (live: its steps may write it in
        place) is copied at the load; one from a dict of its own (torch.load) is not copied at
        the load, but before this optimizer's next step, one parameter at a time (BORROWED)."""
        borrowed = load(self, state_dict)  # checked, then loaded (optim/checkpoint.py)
        guards.drop_caches(self)  # launch tables, plans, records: the old addresses, groups and states
        self.__dict__.pop(HANDED, None)  # the states handed out before are replaced
        self.__dict__[BORROWED] = borrowed

    def _unshare_loaded(self) -> None:
        """Storage of their own for loaded states that share the loaded dict's (load_state_dict)."""
        for p in self.__dict__.pop(BORROWED, None) or ():
            st = self.state.get(p)
            if st:
                unshare(st)
