"""Loaded optimizer states that share storage with the dict they were loaded from.

`load_state_dict` copies a dict's structure, not its tensors (optim/checkpoint.load), as
torch's does, so resuming from `torch.load` holds one copy of the state, not two. But qstate's
fused steps write codes, scales and the non-finite count in place, so a loaded tensor must
have storage of its own before a step writes it:

    from another optimizer's state_dict()   its live tensors (handed_out notes them): copied
                                            at the load (`live`), as both may step on
    from a dict nobody steps (torch.load)   shared at the load, copied per parameter just
                                            before this optimizer's next step (`unshare`)

state_dict() hands out dicts of its own (`own_dicts`; torch's are the optimizer's live dicts),
so what a later step puts in the optimizer's dicts never shows in one handed out before; and
the optimizer's next step gives the tensors it writes in place storage of their own first
(`copy_on_write`), so a dict handed out keeps the states as they were when it was taken, on
every path: the reference replaces codes and scales each step, the fused paths wrote them in
place, and a dict taken at step 3, loaded back after step 5, held step 5's codes with step 3's
counters (a stochastic or BReD state then decoded with the wrong random keys).
"""
from __future__ import annotations

import weakref

import torch

HOST_KEYS = ("step", "since_reset", "written")  # step counters live on the host: reading them never syncs
# storage address -> a tensor on it that a qstate optimizer's state_dict() handed out: its live
# state, which its steps may go on writing in place (the fused paths do): a load copies it
# (handed_out, load; held weakly: an address is in here only while its storage lives)
_HANDED_OUT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _written_in_place(value):
    """The tensors of one parameter's state that a step writes in place (codes, scales and the
    non-finite count; the host counters are replaced, never written)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in HOST_KEYS:
                yield from _written_in_place(v)


def own_dicts(value):
    """value's nested dicts copied, its tensors not: state_dict() hands out dicts of its own,
    so that what a step later puts in the optimizer's dicts (unshare's copies, a reset's fresh
    storage) never shows in a dict handed out before it, which keeps the tensors handed_out
    noted."""
    return {k: own_dicts(v) for k, v in value.items()} if isinstance(value, dict) else value


HANDED = "_states_handed_out"  # an optimizer's __dict__ key: its state_dict() handed out its live states


def copy_on_write(opt) -> None:
    """Before opt's first step after its state_dict() (HANDED): every state tensor a step
    writes in place gets storage of its own (`unshare`; module docstring). The caller drops
    the launch plans that held the old ones first (guards.forget_state_tensors), so a dict
    saved and let go costs one parameter's state at a time. One copy of the states per
    state_dict() a step follows."""
    for st in opt.state.values():
        if st:
            unshare(st)


def handed_out(state: dict) -> None:
    """Note the tensors a step writes in place of state_dict()'s `state` ({key: one
    parameter's state}: the optimizer's live tensors) as handed out (load copies them)."""
    for value in state.values():
        for t in _written_in_place(value):
            if t.untyped_storage().data_ptr():
                _HANDED_OUT[t.untyped_storage().data_ptr()] = t


def live(saved) -> bool:
    """Whether a saved state holds a tensor on storage a qstate optimizer's state_dict() handed out."""
    return any(_local(t).untyped_storage().data_ptr() in _HANDED_OUT for t in _written_in_place(saved))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a saved sharded state, optim/sharded_state.py), else t."""
    return t.to_local() if hasattr(t, "to_local") else t


def shares_storage(loaded: dict, saved) -> bool:
    """Whether a loaded state (to_device keeps a tensor already on its device and dtype, as
    torch's load_state_dict does) writes in place into storage the saved state holds."""
    saved_at = {_local(t).untyped_storage().data_ptr() for t in _written_in_place(saved)} - {0}
    return any(t.untyped_storage().data_ptr() in saved_at for t in _written_in_place(loaded))


def unshare(st: dict) -> None:
    """Give one parameter's state tensors that a step writes in place storage of their own
    (QuantizedOptimizer.step, before its first step after load_state_dict)."""
    for k, v in st.items():
        if k in HOST_KEYS:
            continue
        if isinstance(v, torch.Tensor):
            st[k] = v.clone()
        elif isinstance(v, dict):
            unshare(v)
