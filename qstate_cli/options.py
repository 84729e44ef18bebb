"""A command's options: one dataclass, filled by Typer in the CLI and by the suite loader.

An engine declares what it takes as a dataclass of `option(...)` / `many(...)` fields:

    @dataclass
    class MemoryOptions(Options):
        numel: list[int] = many("Single tensors of these sizes.", "--numel", "-n", parse=parse_count)
        dtype: str = option("fp32", "Parameter dtype: fp32, bf16, fp16.")

Each field carries its help text, its flags (default: --field-name) and an optional
`parse` that turns one raw value (text from the command line, a YAML scalar from a
suite) into the value the engine uses: a count ("1e6", "2^20") into an int, a name into a
StateConfig. `Options.__post_init__` applies it, so every way of filling the options
(Typer, `from_params`, a direct call in a test) parses each value exactly once, and a
parser that is handed an already parsed value returns it unchanged.

- The CLI (cli/commands.py) turns the fields into Typer options; the command body gets
  the options object.
- A suite point is a dict of the same field names (`from_params`): an unknown name is
  an error naming the closest ones; a list field takes a scalar or a comma-separated
  string too; a scalar is converted to the field's type.
- A list field whose values may themselves hold commas is split by its own rule, given as
  `many(..., split=)`: `--model` of bench kernels and bench memory, where
  `4096x1024*2,1024*4` is one custom model and `gpt2-small,llama-1b` two built-in ones
  (bench/shapes.py, split_models).
- `to_params()` is the inverse: plain JSON values (for result files' meta).
- `MOST` bounds the counts that size a command's work (`bench train --seeds`, `--rounds`,
  ...), by the command's COMMAND and the field: a value above it is refused when the
  options are made, on the command line and in a suite alike, before any work.

Nothing here imports Typer or an engine: engines import this module, never the CLI.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import MISSING, field, fields
from typing import Any, Callable

from .errors import QstateError, clip
from .quant.formats import suggest

SCALAR_TYPES = (bool, int, float, str)
MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed (quant/hash.py keeps its low 32 bits)
MAX_THREADS = 1024  # torch threads per run (--threads): more is a typo (10^6 segfaulted inside torch)

# Upper bounds of counts that size the work (and the lists built for it) before it starts:
# (the command, as Options.COMMAND names it; the field) -> (the most, why). A typo's 10^9
# was 10^9 training runs planned (24 GB of seed list), or a night of timing rounds.
MOST = {
    ("bench train", "seeds"): (1000, "one training run per seed and configuration"),
    ("bench train", "steps"): (10**7, "the loss series keeps a point every --log-every steps"),
    ("bench kernels", "rounds"): (1000, "each round times every row again"),
    ("bench kernels", "threads"): (MAX_THREADS, "torch CPU threads; more than the CPUs only adds waiting"),
    ("compare --ab", "rounds"): (1000, "each round times both configurations again"),
    ("bench headline", "reps"): (10_000, "timed repetitions of each row"),
    ("bench headline", "warmup"): (10_000, "warm-up calls of each row"),
}


def option(default: Any = None, help: str = "", *flags: str, parse: Callable | None = None,
           type: type | None = None, argument: bool = False, metavar: str | None = None):
    """A scalar option. `type` is the value's type (default: the default's; give it when the
    default is None); `argument=True` makes it the command's positional argument."""
    kind = type or (default.__class__ if default is not None else str)
    if kind not in SCALAR_TYPES:
        raise TypeError(f"option type must be one of {SCALAR_TYPES}, got {kind}")
    return field(default=default, metadata={"help": help, "flags": flags, "parse": parse, "type": kind,
                                            "many": False, "argument": argument, "metavar": metavar})


def many(help: str = "", *flags: str, parse: Callable | None = None, type: type = str,
         default: tuple = (), metavar: str | None = None, split: Callable | None = None):
    """A list option: repeatable on the command line, each value may be a comma list (split
    by split_items, or by `split` where a value holds commas of its own)."""
    return field(default_factory=lambda: list(default),
                 metadata={"help": help, "flags": flags, "parse": parse, "type": type, "many": True,
                           "argument": False, "metavar": metavar, "split": split or split_items})


def lower(text) -> str:
    """A name compared case-insensitively (optimizer names)."""
    return str(text).strip().lower()


def option_fields(cls) -> list[dataclasses.Field]:
    """The fields of an options class, in declaration order."""
    return [f for f in fields(cls) if "many" in f.metadata]


def flags_of(f: dataclasses.Field) -> tuple[str, ...]:
    return tuple(f.metadata["flags"]) or (f"--{f.name.replace('_', '-')}",)


def split_items(value) -> list:
    """A list value from one value, a list of them, or comma-separated text. A part
    `KEY=...` that follows a part holding `=` continues it (`m=int4,v=lin4nz` is one
    state configuration, `bred-4bit,m=int4,v=lin4nz` two)."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if isinstance(item, str):
            parts: list[str] = []
            for part in (p.strip() for p in item.split(",")):
                if parts and "=" in parts[-1] and _KEYED.match(part):
                    parts[-1] += "," + part
                elif part:
                    parts.append(part)
            out += parts
        elif item is not None:
            out.append(item)
    return out


_KEYED = re.compile(r"^[A-Za-z_]\w*\s*=")


def _convert(f: dataclasses.Field, value, what: str):
    """One raw value of field `f` as the engine's value (parse, else the field's type)."""
    parse, kind = f.metadata["parse"], f.metadata["type"]
    if parse is not None:
        return parse(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    try:
        if kind is bool:
            raise ValueError
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise QstateError(f"{what}: {f.name} must be {kind.__name__}, got {value!r}") from None


def parse_seed(value, flag: str = "--seed") -> int:
    """A seed: a whole number in 0 .. 2^63-1 (torch.manual_seed overflows past it)."""
    text = str(value).strip()
    if isinstance(value, bool) or not (isinstance(value, int) or re.fullmatch(r"\+?\d{1,19}", text)) \
            or not 0 <= int(text) <= MAX_SEED:
        raise QstateError(f"{flag} {_short(value)}: must be a whole number from 0 to 2^63-1")
    return int(text)


def seed_option(help: str):
    """The `--seed` option of an engine (parse_seed)."""
    return option(0, help, parse=parse_seed, type=int)


def positive_number(flag: str) -> Callable:
    """A parser of a finite number > 0 (`--max-gib`): NaN, inf and 0 are refused."""
    def parse(value) -> float:
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not (math.isfinite(number) and number > 0):
            raise QstateError(f"{flag} {_short(value)}: must be a finite number > 0")
        return number
    return parse


def _short(value) -> str:
    """A value as a message shows it: at most 40 characters."""
    return clip(str(value))


class Options:
    """Base of every command's options dataclass (see module docstring); not a dataclass
    itself, so frozen and mutable options classes can both derive from it. `COMMAND`
    names the command in messages. `check()` is what the engine would refuse about the
    values together (an engine overrides it), found without doing any work."""

    COMMAND = ""

    def __post_init__(self):
        what = self.COMMAND or type(self).__name__
        for f in option_fields(self):
            value = getattr(self, f.name)
            if f.metadata["many"]:
                split = f.metadata["split"]
                for item in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(item, str) and not split(item):  # `-m ,,`: not the default
                        raise QstateError(f"{flags_of(f)[0]} {item!r}: names nothing; give at least one value")
                value = [_convert(f, v, what) for v in split(value)]
            elif value is not None:
                value = _convert(f, value, what)
            most = MOST.get((self.COMMAND, f.name))
            if most is not None and isinstance(value, int) and value > most[0]:
                raise QstateError(f"{flags_of(f)[0]} {_short(value)}: at most {most[0]:,} ({most[1]})")
            object.__setattr__(self, f.name, value)

    @classmethod
    def from_params(cls, params: dict | None, what: str | None = None):
        """The options a suite point's `params` name (see module docstring)."""
        what = what or cls.COMMAND or cls.__name__
        known = {f.name: f for f in option_fields(cls)}
        values = {}
        for key, value in (params or {}).items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise QstateError(f"{what}: unknown parameter {key!r}{suggest(name, list(known))}")
            if value is None and not known[name].metadata["many"]:
                continue  # null: the default
            values[name] = value
        return cls(**values)

    def check(self, here: bool = True) -> None:
        """QstateError for what the engine would refuse, before any work. here=False: a
        device is checked by name only, not for being on this machine (`suite validate`
        of a CUDA suite on a laptop); `run` checks every point with here=True."""

    def to_params(self) -> dict:
        """Every field as a plain JSON value (objects such as a StateConfig by name)."""
        return {f.name: _plain(getattr(self, f.name)) for f in option_fields(self)}

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _plain(value):
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, SCALAR_TYPES):
        return value
    return str(value)


def default_of(f: dataclasses.Field):
    """The field's default value (a fresh list for list fields)."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory()
