"""Which tensors a Recorder records, and whose hyper-parameters its trace keeps (trace/recorder.py).

A trace holds one set of hyper-parameters and the replay steps every recorded tensor with
it. The Recorder keeps those of the parameter group holding the first recorded tensor (in
the optimizer's parameter order): a trace recorded with `include=`/`exclude=` choosing one
group's tensors replays with that group's betas, eps, momentum, ... (not group 0's). Where
the recorded tensors span groups that differ in a key the replay reads (hparams.py
REPLAYED_KEYS), one warning on stderr names them: record them apart, one recorder (or
callback) per group, to replay each with its own. The group is chosen on the whole
selection, before a rank of a distributed run drops the tensors another rank records, so
every rank of one recording keeps the same hyper-parameters. `meta.hparams_group` says
which group it was where the optimizer has more than one.
"""
from __future__ import annotations

import re
import sys

from ..errors import QstateError
from .hparams import differing_groups, group_hparams


class NoParamGroups(QstateError, ValueError):
    """An optimizer with no parameter groups (Lightning's stand-in when configure_optimizers
    returns None): nothing to record."""


def check_groups(optimizer) -> None:
    """Refuse an optimizer that has no parameter groups (NoParamGroups, one line)."""
    if optimizer is not None and not getattr(optimizer, "param_groups", None):
        raise NoParamGroups(f"cannot record {type(optimizer).__name__}: it has no parameter groups (no optimizer "
                            f"to record; Lightning substitutes such a stand-in when configure_optimizers returns None)")


def select(plist: list, model, include: str | None, exclude: str | None) -> list[tuple[int, str, object]]:
    """(index in the optimizer's parameter list, name, parameter) of each tensor `include` /
    `exclude` (regular expressions on the names `model` gives, else param0, param1, ...) keep;
    empty tensors are left out, and frozen ones (requires_grad=False: never a gradient, so
    they would count toward the size cap and replay as no data), said once on stderr."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    inc, exc = _regex(include, "include"), _regex(exclude, "exclude")
    out, frozen = [], []
    for i, p in enumerate(plist):
        name = names.get(id(p), f"param{i}")
        if (inc and not inc.search(name)) or (exc and exc.search(name)) or p.numel() == 0:
            continue
        if not getattr(p, "requires_grad", True):
            frozen.append(name)
            continue
        out.append((i, name, p))
    if frozen:
        shown = ", ".join(frozen[:5]) + (", ..." if len(frozen) > 5 else "")
        print(f"qstate: not recording {len(frozen)} frozen parameter(s) in the optimizer (requires_grad=False: "
              f"no gradient to record): {shown}", file=sys.stderr)
    return out


def recorded_hparams(optimizer, chosen: list[tuple[int, str, object]], meta: dict) -> dict:
    """The hyper-parameters of the group holding the first chosen tensor (module docstring);
    warns where the chosen tensors span groups that differ in what the replay reads, and
    sets meta['hparams_group'] where the optimizer has several groups."""
    groups = optimizer.param_groups
    ids = {id(p) for _, _, p in chosen}
    kept, first = 0, None
    if chosen:
        first = chosen[0]
        kept = next((k for k, g in enumerate(groups) if any(q is first[2] for q in g["params"])), 0)
    if len(groups) > 1:
        meta["hparams_group"] = kept
    differ = differing_groups(optimizer, ids, kept)
    if differ:
        print(f"qstate: the trace keeps the hyper-parameters of param_groups[{kept}] (the group of the first "
              f"recorded tensor, {first[1]}), and the replay steps every recorded tensor with them; these groups "
              f"differ: {'; '.join(differ)} (record them apart, with include=/exclude=, to replay each with "
              f"its own)", file=sys.stderr)
    return group_hparams(groups[kept])


def _regex(pattern: str | None, what: str):
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise QstateError(f"{what}={pattern!r} is not a regular expression ({exc})") from None
