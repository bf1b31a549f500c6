"""Load a YAML file into typed dataclasses: overrides, ``${key}`` interpolation, strict checking.

>>> cfg = load_config("examples/config/rlvr_config.yaml", overrides=["max_steps=3"])

Every problem becomes one ``ConfigError`` naming the key path; nothing is dropped silently. This
parses and types only (keys, types, ranges, inline names, each role's ``strategy_config`` typed by
its ``strategy_name``); what needs the registries, the placement, the algorithm tables or the files
is the pre-launch step's (``roll.launch.checks.check_before_launch``), which the launchers run.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import dacite
import yaml

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.errors import ConfigError, did_you_mean, join_path
from roll.configs.ranges import check_fields, check_raw_values, strip_optional
from roll.configs.role import StrategyArgs
from roll.configs.roll_compat import translate_roll_keys
from roll.configs.strategy_configs import STRATEGY_CONFIGS

T = TypeVar("T")

# Top-level blocks that alibaba/ROLL files carry for Hydra; they configure nothing here.
IGNORED_TOP_LEVEL = ("hydra", "defaults")
# Keys renamed from alibaba/ROLL, named in the error so a user knows what to write instead.
RENAMED_KEYS = {"worker_cls": "reward_fn (a registered reward name, e.g. math_rule)"}

_REF = re.compile(r"\$\{([^{}]+)\}")


def read_yaml(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(str(file), "config file not found")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(str(file), f"invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(file), f"the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides; values are read as YAML (``3``, ``true``, ``[0,1]``)."""
    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override must look like key.sub=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(dotted, "an override key must be a dotted path like actor_train.device_mapping")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = out
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(".".join(keys[: i + 1]), f"is a value, not a section; cannot set {dotted}")
            node = child
        node[keys[-1]] = value
    return out


def interpolate(data: dict[str, Any]) -> dict[str, Any]:
    """Replace ``${a.b}`` with the value at key path ``a.b``. A string that is only a reference keeps
    the referenced value's type (``${response_length}`` stays an int)."""
    root = copy.deepcopy(data)
    resolving: list[str] = []

    def lookup(ref: str, at: str) -> Any:
        node: Any = root
        walked: list[str] = []
        for key in ref.split("."):
            if not isinstance(node, dict) or key not in node:
                options = node.keys() if isinstance(node, dict) else []
                raise ConfigError(at, f"${{{ref}}} refers to unknown key '{ref}'{did_you_mean(key, options)}")
            walked.append(key)
            node = node[key]
        return resolve(node, ".".join(walked))

    def resolve(value: Any, at: str) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v, join_path(at, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, join_path(at, i)) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        if at in resolving:
            raise ConfigError(at, f"interpolation cycle: {' -> '.join(resolving + [at])}")
        resolving.append(at)
        try:
            whole = _REF.fullmatch(value.strip())
            if whole:
                return lookup(whole.group(1).strip(), at)
            return _REF.sub(lambda m: str(lookup(m.group(1).strip(), at)), value)
        finally:
            resolving.pop()

    return resolve(root, "")


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
    except ValueError as exc:
        key, _, message = str(exc).partition(": ")
        if key in fields and message:
            raise ConfigError(join_path(path, key), message) from None
        raise ConfigError(path or "<root>", str(exc)) from None
    check_fields(obj, path)  # the ranges and inline names declared on the fields (roll.configs.ranges)
    if isinstance(obj, StrategyArgs):
        obj.config = _typed_strategy_config(obj, path)
    return obj


def _typed_strategy_config(args: StrategyArgs, path: str) -> Any:
    """``strategy_config`` built as the options class of ``strategy_name``."""
    name = args.strategy_name
    if name not in STRATEGY_CONFIGS:
        raise ConfigError(
            join_path(path, "strategy_name"),
            f"unknown strategy {name!r}{did_you_mean(str(name), STRATEGY_CONFIGS)}; "
            f"valid names: {', '.join(sorted(STRATEGY_CONFIGS))}",
        )
    return build_dataclass(
        STRATEGY_CONFIGS[name], args.strategy_config or {}, join_path(path, "strategy_config")
    )


def load_config(path: str | Path, overrides: list[str] | None = None, config_cls: type[T] | None = None) -> T:
    """Read, override, interpolate and build an RLVR config file (see the module docstring for
    what is checked here and what before launch)."""
    from roll.configs.pipeline_config import RLVRConfig

    raw = read_yaml(path)
    for key in IGNORED_TOP_LEVEL:
        if raw.pop(key, None) is not None:
            print(
                f"roll: ignoring the '{key}' block of {path} (Hydra settings are not used)", file=sys.stderr
            )
    raw = translate_roll_keys(interpolate(apply_overrides(raw, overrides or [])), str(path))
    return build_dataclass(config_cls or RLVRConfig, raw)


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
