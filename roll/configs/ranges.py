"""Allowed values of config fields, declared once on the dataclass field and read from there.

A numeric field says its range; a field with named values says where those names live, usually
the table that implements them (``"roll.pipeline.rlvr.algorithms.kl:KL_ESTIMATORS"``), so the
check, the error message and the docs never hold a copy::

    @dataclass
    class TrainingArgs:
        learning_rate: float = bounded(1.0e-6, ge=0)
        lr_scheduler_type: str = one_of("constant", table="roll.utils.lr_schedule:DECAYS")

``check_fields(obj, path)`` (called by the loader for every dataclass it builds) raises one
``ConfigError`` for the first value out of its range or outside its inline names; floats must also
be finite. For a dict or list field the bound applies to each item. Names read from a ``table``
live above configs/ (the algorithms, the models), so the loader does not import them: the
pre-launch step resolves every table and checks those values (roll.launch.named_values).
``python -m roll.launch.range_table`` prints every range as the markdown table in
docs/config_checks.md (``--update docs/config_checks.md`` rewrites it there).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from roll.configs.errors import ConfigError, did_you_mean, join_path

RANGE_KEY = "roll_range"
CHOICES_KEY = "roll_choices"


@dataclass(frozen=True)
class Bounds:
    """A closed or open interval; ``None`` ends are unbounded. ``note`` says why, in errors."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""

    def violation(self, value: Any) -> str | None:
        """Why ``value`` is out of range, or None when it is in range (or not a number: the type
        check names those). YAML's true/false would pass as 1/0, so they are refused here."""
        if isinstance(value, bool):
            return f"expected a number ({self.describe()}), got {str(value).lower()}"
        if not isinstance(value, (int, float)):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number ({self.describe()}), got {value}"
        low_ok = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        high_ok = (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
        if low_ok and high_ok:
            return None
        note = f" ({self.note})" if self.note else ""
        return f"must be {self.describe()}, got {value}{note}"

    def describe(self) -> str:
        low = (
            f">= {_num(self.ge)}"
            if self.ge is not None
            else f"> {_num(self.gt)}"
            if self.gt is not None
            else ""
        )
        high = (
            f"<= {_num(self.le)}"
            if self.le is not None
            else f"< {_num(self.lt)}"
            if self.lt is not None
            else ""
        )
        if self.ge is not None and self.ge == self.le:
            return f"= {_num(self.ge)}"
        if low and high:
            left = "[" if self.ge is not None else "("
            right = "]" if self.le is not None else ")"
            lo = self.ge if self.ge is not None else self.gt
            hi = self.le if self.le is not None else self.lt
            return f"in {left}{_num(lo)}, {_num(hi)}{right}"
        return low or high or "any finite number"


@dataclass(frozen=True)
class Choices:
    """Named values: an inline tuple, or ``table`` = ``"module:NAME"`` of the dict (its keys) or
    tuple that implements them. ``refused`` = ``"module:NAME"`` of a dict name -> reason, for
    names users try that are known not to work. Tables are resolved by the pre-launch step
    (roll.launch.named_values), never here: configs/ imports nothing above it."""

    values: tuple[Any, ...] = ()
    table: str | None = None
    refused: str | None = None

    def violation(
        self, value: Any, allowed: list[Any] | None = None, reasons: Mapping[str, str] | None = None
    ) -> str | None:
        """Why ``value`` is not one of ``allowed`` (default: the inline values), or None;
        ``reasons`` says why a known-refused name is refused."""
        allowed = list(self.values) if allowed is None else allowed
        reasons = reasons or {}
        if value in allowed:
            return None
        names = [a for a in allowed if a is not None]
        if isinstance(value, str) and value in reasons:
            return f"{value!r} {reasons[value]}; use one of {names}"
        hint = did_you_mean(value, names) if isinstance(value, str) else ""
        return f"expected one of {allowed}, got {value!r}{hint}"


def bounded(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    note: str = "",
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with a numeric range (``ge``/``gt`` below, ``le``/``lt`` above)."""
    bounds = Bounds(ge=ge, gt=gt, le=le, lt=lt, note=note)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={RANGE_KEY: bounds})


def one_of(default: Any, *values: Any, table: str | None = None, refused: str | None = None) -> Any:
    """A dataclass field whose value is one of ``values`` or of the keys of ``table``."""
    choices = Choices(values=tuple(values), table=table, refused=refused)
    return dataclasses.field(default=default, metadata={CHOICES_KEY: choices})


def check_fields(obj: Any, path: str = "") -> None:
    """Raise a ConfigError for the first field of dataclass ``obj`` outside its declared values.
    Nested dataclasses are not walked (the loader checks each one as it builds it)."""
    _check(dataclasses.fields(obj), lambda name: getattr(obj, name), path)


def check_raw_values(cls: type, data: Mapping[str, Any], path: str = "") -> None:
    """The same check on plain data before ``cls`` is built, for numbers and names only: a
    top-level value (``response_length: 0``) is then named before the nested sections that
    interpolate it (``max_new_tokens: ${response_length}``)."""
    fields = [f for f in dataclasses.fields(cls) if f.name in data]
    _check(fields, data.__getitem__, path, names_only_str=True)


def _check(fields: Any, get: Any, path: str, names_only_str: bool = False) -> None:
    for f in fields:
        value = get(f.name)
        if value is None:
            continue
        key = join_path(path, f.name)
        choices = f.metadata.get(CHOICES_KEY)
        if choices is not None and choices.table is None and (isinstance(value, str) or not names_only_str):
            if problem := choices.violation(value):
                raise ConfigError(key, problem)
        bounds = f.metadata.get(RANGE_KEY)
        if bounds is None:
            continue
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            items = [(None, value)]
        for sub, item in items:
            if problem := bounds.violation(item):
                raise ConfigError(key if sub is None else join_path(key, sub), problem)


def _num(x: float | None) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x)


def strip_optional(tp: Any) -> Any:
    """``X`` for an annotation ``X | None`` (``Optional[X]``); any other annotation as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp
