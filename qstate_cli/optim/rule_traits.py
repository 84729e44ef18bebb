"""What an optimizer class's rule allows, read from where the class declares it.

A subclass that rewrites `update` inherits its parent's class attributes, and they describe
the parent's rule, not the new one: AdamW's `kernel = "adamw"` is AdamW's step, and its
`elementwise = True` says AdamW's step gives each element's new values from that element's
own parameter, gradient and states. So a trait counts only where the class that defines
`update` declares it, or a subclass of that class does (a rewritten rule that is still
elementwise says so again: `elementwise = True` beside its `update`).

    elementwise(cls)    the reference may step a large tensor in chunks (optim/chunked.py),
                        a DTensor's local shard alone (optim/sharding.py), and tensors laid
                        end to end through the base class's `update_flat` (optim/small.py)
    flat_rule(cls)      `update_flat` is the rule over tensors laid end to end: elementwise,
                        or the class that defines `update` (or a subclass) defines it (Muon)
    kernel_is_rule(cls) the class's fused kernel (`kernel`) is its `update`, so the fused
                        paths may step it (optim/fused.py); else the reference steps it
"""
from __future__ import annotations

from functools import lru_cache


def _declarer(cls, name: str):
    """The class in cls's method resolution order whose own namespace holds `name` (or None)."""
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def _at_rule(cls, name: str) -> bool:
    """Whether `name` is declared by the class that defines `update` or by a subclass of it."""
    where, rule = _declarer(cls, name), _declarer(cls, "update")
    return where is not None and rule is not None and issubclass(where, rule)


@lru_cache(maxsize=None)
def elementwise(cls) -> bool:
    """The class's `update` is elementwise (module docstring)."""
    return bool(getattr(cls, "elementwise", False)) and _at_rule(cls, "elementwise")


@lru_cache(maxsize=None)
def flat_rule(cls) -> bool:
    """The class's `update_flat` is its rule over tensors laid end to end (module docstring)."""
    return elementwise(cls) or _at_rule(cls, "update_flat")  # (the base class's update_flat needs elementwise)


@lru_cache(maxsize=None)
def kernel_is_rule(cls) -> bool:
    """The class's fused kernel is its `update` (module docstring)."""
    return getattr(cls, "kernel", None) is not None and _at_rule(cls, "kernel")


def rewritten_rule(cls) -> str:
    """Why a class's inherited kernel or traits do not apply: one line, for why_reference."""
    return (f"{cls.__name__} rewrites `update`: {_declarer(cls, 'kernel').__name__}'s kernel is not its rule")
