"""Shell completion of option values: what TAB offers after a flag.

`qstate --install-completion` installs Typer's completion for the current shell (bash,
zsh, fish, PowerShell); command and flag names complete from the app itself. This module
adds the values: after `--config` the presets and format names (and, inside an explicit
configuration such as `m=int4:`, the next part of the grammar, quant/config.py), after
`--optimizer` the registered optimizers, after `--model` the built-in models, a TRACE
argument `demo` and the corpus entries (`corpus:NAME`). Every list is read from the
table that defines it, so a new preset, optimizer or model completes without an edit
here. Where nothing matches, the shell falls back to file names.

A value completer takes the word typed so far and returns the candidates that extend it
(Typer's `autocompletion=`). `for_option` picks one by the option's flags, or by its field
where one command's flag takes other values (`bench train --model`).
"""
from __future__ import annotations

from typing import Callable, Iterable

# the spec grammar's parts after a ':' (quant/config.py): a rounding, then a block or `tensor`, then modifiers
BLOCKS = ("b32", "b64", "b128", "b256", "b512", "b1024", "b2048")
MODIFIERS = ("sqrt", "softsign", "sbf16", "sfp16")


def _starting(incomplete: str, names: Iterable[str]) -> list[str]:
    return [n for n in dict.fromkeys(names) if n.startswith(incomplete)]


def configs(incomplete: str) -> list[str]:
    """Presets and format names; within `m=...,v=...` or `FORMAT:...` the next part; after a
    comma that ends a whole configuration (`bred-4bit,`: a comma list of them) another one."""
    from ..quant.config import PRESETS, STATE_NAMES
    from ..quant.formats import FORMATS

    whole = [*PRESETS, *FORMATS, *(f"{s}=" for s in STATE_NAMES)]
    cut = max(incomplete.rfind(","), incomplete.rfind("="), incomplete.rfind(":"))
    if cut < 0:
        return _starting(incomplete, [*whole, "none"])
    head, word = incomplete[:cut + 1], incomplete[cut + 1:]
    named = {part.partition("=")[0] for part in head.split(",") if "=" in part}
    if incomplete[cut] == ",":  # inside m=...,v=... the other state; else the next configuration
        after = [f"{s}=" for s in STATE_NAMES if s not in named] if "=" in head.rsplit(",", 2)[-2] else whole
    else:
        after = list(FORMATS) if incomplete[cut] == "=" else _spec_parts(head)
    return [head + n for n in _starting(word, after)]


def _spec_parts(head: str) -> list[str]:
    """The parts the spec ending `head` (in ':') can take next and still parse: one
    rounding, one block size (or `tensor`), each modifier once."""
    from ..errors import QstateError
    from ..quant.config import ROUNDINGS, parse_spec

    spec = head[:-1].rpartition("=")[2].rpartition(",")[2]
    given = spec.lower().split(":")[1:]
    out = [] if any(g in ROUNDINGS for g in given) else list(dict.fromkeys(ROUNDINGS.values()))
    if not any(g == "tensor" or g[:1] == "b" and g[1:].isdigit() for g in given):
        out += [*BLOCKS, "tensor"]
    out += [m for m in MODIFIERS if m not in given]

    def parses(part: str) -> bool:
        try:
            parse_spec(f"{spec}:{part}")
        except QstateError:
            return False
        return True

    return [part for part in out if parses(part)]


def optimizers(incomplete: str) -> list[str]:
    from ..optim.registry import OPTIMIZERS

    return _starting(incomplete, OPTIMIZERS)


def roundings(incomplete: str) -> list[str]:
    from ..quant.config import ROUNDINGS

    return _starting(incomplete, ROUNDINGS.values())


def backends(incomplete: str) -> list[str]:
    from ..optim.base import BACKENDS

    return _starting(incomplete, BACKENDS)


def devices(incomplete: str) -> list[str]:
    return _starting(incomplete, ("auto", "cpu", "cuda"))


def dtypes(incomplete: str) -> list[str]:
    from ..bench.bytes_model import DTYPES

    return _starting(incomplete, DTYPES)


def models(incomplete: str) -> list[str]:
    from ..bench.shapes import MODELS

    return _starting(incomplete, MODELS)


def trained_models(incomplete: str) -> list[str]:
    """The models `trace demo` and `bench train` train."""
    from ..models.tiny_lm import SIZES

    return _starting(incomplete, SIZES)


def baselines(incomplete: str) -> list[str]:
    from ..bench.subjects import NONE, baselines as of
    from ..optim.registry import OPTIMIZERS

    return _starting(incomplete, ["all", NONE, *(n for name in OPTIMIZERS for n in of(name))])


def grad_dtypes(incomplete: str) -> list[str]:
    from ..trace.schema import GRAD_DTYPES

    return _starting(incomplete, GRAD_DTYPES)


def float_formats(incomplete: str) -> list[str]:
    """What `diagnose --theory --format` takes: the formats with fraction bits."""
    from ..quant.formats import FORMATS

    return _starting(incomplete, [n for n, f in FORMATS.items() if f.kind == "float"])


def traces(incomplete: str) -> list[str]:
    """`demo` and `corpus:NAME` (any other word completes as a file name)."""
    from ..trace.corpus import DEMO, ENTRIES, PREFIX

    return _starting(incomplete, [DEMO, *(PREFIX + name for name in ENTRIES)])


BY_FLAG: dict[str, Callable[[str], list[str]]] = {
    "--config": configs, "--states": configs, "--optimizer": optimizers, "--rounding": roundings,
    "--backend": backends, "--device": devices, "--dtype": dtypes, "--model": models, "--format": float_formats,
    "--baseline": baselines, "--grad-dtype": grad_dtypes,
}
BY_FIELD: dict[str, Callable[[str], list[str]]] = {  # where one options class takes other values
    "TrainSettings.model": trained_models,
}
BY_ARGUMENT: dict[str, Callable[[str], list[str]]] = {"trace": traces}


def for_option(options_cls: type, field: str, flags: Iterable[str]) -> Callable[[str], list[str]] | None:
    """The value completer of this field of an options class (None: the shell's default)."""
    own = BY_FIELD.get(f"{options_cls.__name__}.{field}")
    return own or next((BY_FLAG[f] for f in flags if f in BY_FLAG), None)
