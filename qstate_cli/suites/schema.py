"""The suite schema (pydantic): the only module that imports pydantic.

Validation only: the runner works on the plain dicts of the YAML file once they pass.
Unknown keys are rejected everywhere except in `defaults`, whose extra keys are engine
parameters (checked against the kind's options, the command's flags, by `load.py`).
`qstate suite schema` prints `Suite.model_json_schema()` for editors.
"""
from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictFloat, StrictInt, Tag, ValidationError,
                      field_validator, model_validator)

from ..kinds import runnable_kinds
from .checks import MAX_NAME, NAME_PATTERN, name_problem, unknown_key
from .expand import MAX_AXIS_VALUES, range_values

ParamName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]
RunName = Annotated[str, Field(pattern=NAME_PATTERN, max_length=MAX_NAME)]
Number = Union[StrictInt, StrictFloat]
KindName = Literal[runnable_kinds()]  # kinds.py: the kinds with an engine


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_name(value):
    """A name (before its pattern): the rule's own message, not the regular expression."""
    if value is not None and isinstance(value, str) and name_problem(value):
        raise ValueError(name_problem(value))
    return value


class AxisRange(_Strict):
    """Inclusive range: start, start+step, ... or start, start*factor, ... up to stop."""

    start: Number
    stop: Number
    step: Optional[Number] = Field(None, gt=0, description="arithmetic step (> 0)")
    factor: Optional[Number] = Field(None, gt=1, description="geometric factor (> 1), e.g. 4 for sizes")

    @field_validator("start", "stop", "step", "factor", mode="before")
    @classmethod
    def _finite(cls, value):
        if isinstance(value, float) and not math.isfinite(value):  # .inf would never end, .nan never compare
            raise ValueError(f"must be a finite number (got {value})")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if (self.step is None) == (self.factor is None):
            raise ValueError("give exactly one of step or factor")
        if self.stop < self.start:
            raise ValueError(f"stop ({self.stop}) is below start ({self.start})")
        if self.factor is not None and self.start <= 0:
            raise ValueError("a geometric range (factor) needs start > 0")
        if len(range_values(self.model_dump())) > MAX_AXIS_VALUES:
            raise ValueError(f"more than {MAX_AXIS_VALUES} values")
        return self


def _axis_tag(value: Any) -> str | None:
    if isinstance(value, list):
        return "values"
    if isinstance(value, (dict, AxisRange)):
        return "range"
    return None


Axis = Annotated[
    Union[Annotated[list[Any], Field(min_length=1), Tag("values")], Annotated[AxisRange, Tag("range")]],
    Discriminator(_axis_tag, custom_error_type="axis",
                  custom_error_message="an axis is a list of values or a range {start, stop, step | factor}"),
]


class Defaults(BaseModel):
    """Parameters of every point; keys mirror the CLI options of the kind's command."""

    model_config = ConfigDict(extra="allow")
    device: Optional[str] = Field(None, description="auto | cpu | cuda[:N]", json_schema_extra={
        "pattern": r"^(auto|cpu|cuda(:\d+)?)$"})

    @field_validator("device")
    @classmethod
    def _device(cls, value):
        if value is not None and not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"use auto, cpu or cuda[:N] (got {value!r})")
        return value

    @model_validator(mode="after")
    def _param_names(self):
        for key in self.model_extra or {}:
            if not isinstance(key, str) or not key.isidentifier() or not key.islower():
                raise ValueError(f"parameter {key!r}: use the CLI option name with underscores (e.g. warmup_ms)")
        return self


class Run(_Strict):
    """One kind of measurement: defaults, axes (a cross product), excludes, baselines."""

    kind: KindName
    name: Optional[RunName] = Field(None, description="results file name (default: the kind)")
    description: str = ""
    defaults: Defaults = Field(default_factory=Defaults)
    axes: dict[ParamName, Axis] = Field(default_factory=dict)
    excludes: list[dict[ParamName, Any]] = Field(default_factory=list)
    baselines: list[str] = Field(default_factory=list, description="baselines run at every non-config point")

    _name = field_validator("name", mode="before")(_check_name)


class Suite(_Strict):
    """A suite: one run given inline (`kind`, `axes`, ...) or several under `runs`."""

    name: Optional[RunName] = Field(None, description="default: the file's stem")
    description: str = ""
    defaults: Defaults = Field(default_factory=Defaults)
    kind: Optional[KindName] = None
    axes: dict[ParamName, Axis] = Field(default_factory=dict)
    excludes: list[dict[ParamName, Any]] = Field(default_factory=list)
    baselines: list[str] = Field(default_factory=list)
    runs: Optional[list[Run]] = Field(None, min_length=1)

    _name = field_validator("name", mode="before")(_check_name)


def validate(data: Any) -> list[tuple[tuple, str]]:
    """Schema errors as (loc, message); [] when `data` is a valid suite."""
    try:
        Suite.model_validate(data)
    except ValidationError as exc:
        out = {}
        for err in exc.errors(include_url=False):
            loc = tuple(err["loc"])
            if "range" in loc and loc[-1] in ("int", "float"):  # a Number's union tags: one error
                loc = loc[:-1]
            whole = loc == tuple(err["loc"])
            out.setdefault(loc, _message(err) if whole else f"must be a number (got {err.get('input')!r})")
        return list(out.items())
    return []


def _allowed(loc: tuple) -> list[str]:
    """The keys of the mapping that holds the last key of `loc` (an unknown one's neighbours)."""
    parent = loc[:-1]
    model = AxisRange if "range" in parent else Run if parent[:1] == ("runs",) else Suite
    return list(model.model_fields)


def _message(err: dict) -> str:
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    if err["type"] == "extra_forbidden":
        return unknown_key(err["loc"][-1], _allowed(tuple(err["loc"])))
    if err["type"] == "missing":
        return "required key is missing"
    if err["type"] == "literal_error":
        return f"{msg} (got {err.get('input')!r})"
    return msg


def json_schema() -> dict:
    schema = Suite.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "qstate suite"
    return schema
