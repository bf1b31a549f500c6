"""Build a dataclass from plain data strictly, every problem one ``ConfigError`` naming the key path.

>>> build_dataclass(TrainingArgs, {"learning_rate": 1e-6}, "actor_train.training_args")

The loader (``roll.configs.loader``) builds whole config files with it; ``StrategyArgs`` builds its
``strategy_config`` with it. Unknown keys, wrong types, missing keys, values outside the fields'
declared ranges (``roll.configs.ranges``) and failed ``__post_init__`` checks are errors: nothing
is dropped silently. A ``__post_init__`` may raise a ValueError ``"<field>: <message>"`` or a
ConfigError whose path is relative to its dataclass; either is reported under the full path.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import dacite

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.errors import ConfigError, did_you_mean, join_path
from roll.configs.ranges import check_fields, check_raw_values, strip_optional

T = TypeVar("T")

# Keys renamed from alibaba/ROLL, named in the error so a user knows what to write instead.
RENAMED_KEYS = {"worker_cls": "reward_fn (a registered reward name, e.g. math_rule)"}


def build_dataclass(cls: type[T], data: Any, path: str = "") -> T:
    """Build ``cls`` from plain data strictly: unknown keys, wrong types, missing keys, values
    outside the fields' declared ranges and failed ``__post_init__`` checks become ConfigErrors
    with the full key path."""
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", f"expected a mapping of {cls.__name__} keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            hint = RENAMED_KEYS.get(key)
            advice = f"; use {hint}" if hint else did_you_mean(str(key), fields)
            raise ConfigError(
                join_path(path, str(key)), f"unknown key{advice}; valid keys: {', '.join(fields)}"
            )
    check_raw_values(cls, data, path)
    built = {key: _build_field(hints[key], value, join_path(path, key), key) for key, value in data.items()}
    for name, f in fields.items():
        missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if missing and name not in built:
            raise ConfigError(join_path(path, name), "is required")
    try:
        obj = dacite.from_dict(cls, built, config=dacite.Config(strict=True, type_hooks=_TYPE_HOOKS))
    except dacite.DaciteFieldError as exc:
        raise ConfigError(join_path(path, exc.field_path or ""), _dacite_message(exc)) from None
    except ConfigError as exc:  # from ``__post_init__``, naming a key relative to ``cls``
        raise ConfigError(join_path(path, exc.path) if exc.path else path, exc.message) from None
    except ValueError as exc:
        key, _, message = str(exc).partition(": ")
        if key in fields and message:
            raise ConfigError(join_path(path, key), message) from None
        raise ConfigError(path or "<root>", str(exc)) from None
    check_fields(obj, path)  # the ranges and inline names declared on the fields (roll.configs.ranges)
    return obj


def _build_field(tp: Any, value: Any, path: str, name: str) -> Any:
    if name == "device_mapping":
        return parse_device_mapping(value, path)
    if value is None:
        return None
    tp = strip_optional(tp)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path)
    if typing.get_origin(tp) is dict:
        _, value_tp = typing.get_args(tp)
        if dataclasses.is_dataclass(value_tp):
            if not isinstance(value, Mapping):
                raise ConfigError(path, f"expected a mapping of names to {value_tp.__name__} sections")
            return {k: build_dataclass(value_tp, v, join_path(path, k)) for k, v in value.items()}
    return value


def _to_float(value: Any) -> Any:
    # YAML 1.1 reads 1e-6 (no dot) as a string; accept it and ints where a float is expected.
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _to_str_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


_TYPE_HOOKS = {float: _to_float, list[str]: _to_str_list}


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _dacite_message(exc: dacite.DaciteFieldError) -> str:
    if isinstance(exc, dacite.WrongTypeError):
        return f"expected {_type_name(exc.field_type)}, got {exc.value!r}"
    if isinstance(exc, dacite.MissingValueError):
        return "is required"
    if isinstance(exc, dacite.UnionMatchError):
        return f"expected {_type_name(exc.field_type)}, got {exc.value!r}"
    return str(exc)
