"""Typer commands made from an options dataclass (qstate_cli/options.py) plus output flags.

    @options_command(bench_app, "memory", MemoryOptions, help="...", outputs=("json", "csv"))
    def memory(opts: MemoryOptions, out: Destinations) -> None:
        ...

Every field of the options class becomes an option (or the positional argument) with the
field's flags and help; list fields are repeatable and take comma lists. The body gets
the options object, built by the same constructor a suite point uses, and the output
destinations (cli/output.py). What a suite may set is therefore exactly what the command
line may set, and nothing inspects the Typer app to find out.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable, List, Optional

import typer

from ..options import default_of, flags_of, option_fields
from . import completion
from .output import OUTPUT_FLAGS, Destinations


def _parameter(f, options_cls) -> inspect.Parameter:
    md = f.metadata
    complete = completion.for_option(options_cls, f.name, flags_of(f))
    kind = md["type"]
    cli_type = str if md["parse"] is not None and kind is not bool else kind
    if md["argument"]:
        default = typer.Argument(default_of(f), help=md["help"], metavar=md["metavar"] or f.name.upper(),
                                 show_default=False, autocompletion=completion.BY_ARGUMENT.get(f.name))
        annotation = Optional[cli_type]
    elif md["many"]:
        default = typer.Option(None, *flags_of(f), help=md["help"], metavar=md["metavar"], show_default=False,
                               autocompletion=complete)
        annotation = Optional[List[cli_type]]
    else:
        value = default_of(f)
        default = typer.Option(value, *flags_of(f), help=md["help"], metavar=md["metavar"],
                               show_default=value is not None and value is not False,
                               autocompletion=complete)
        annotation = cli_type if kind is bool else Optional[cli_type]
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _output_parameter(name: str, help_text: str | None) -> inspect.Parameter:
    flags, default_help = OUTPUT_FLAGS[name]
    return inspect.Parameter(f"out_{name}", inspect.Parameter.KEYWORD_ONLY,
                             default=typer.Option(None, *flags, help=help_text or default_help),
                             annotation=Optional[Path])


def _input_label(f) -> str:
    """How an input field is named in messages: the argument's metavar (TRACE) or the flag."""
    return (f.metadata["metavar"] or f.name.upper()) if f.metadata["argument"] else flags_of(f)[0]


def options_command(group: typer.Typer, name: str, options_cls, *, help: str, outputs: tuple[str, ...] = (),
                    output_help: dict[str, str] | None = None, inputs: tuple[str, ...] = ()) -> Callable:
    """Register `body(opts, out)` as `group`'s command `name` (see module docstring).
    `inputs` names the fields that are files the command reads: no output may be one."""
    output_help = output_help or {}

    def decorator(body: Callable) -> Callable:
        fields = option_fields(options_cls)
        unknown = set(inputs) - {f.name for f in fields}
        if unknown:
            raise TypeError(f"{name}: inputs {sorted(unknown)} are not fields of {options_cls.__name__}")
        params = [_parameter(f, options_cls) for f in fields] + [_output_parameter(o, output_help.get(o)) for o in outputs]

        def command(**given):
            read = tuple((_input_label(f), given[f.name]) for f in fields if f.name in inputs)
            out = Destinations(**{o: given.pop(f"out_{o}") for o in outputs}, inputs=read)
            values = {f.name: given[f.name] for f in fields
                      if given[f.name] is not None and not (f.metadata["many"] and not given[f.name])}
            return body(options_cls(**values), out)

        command.__signature__ = inspect.Signature(params)
        command.__name__ = body.__name__
        command.__doc__ = help
        group.command(name, help=help)(command)
        return body

    return decorator
