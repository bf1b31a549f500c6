"""Load a YAML file into typed dataclasses: overrides, ``${key}`` interpolation, strict checking.

>>> cfg = load_config("examples/config/rlvr_config.yaml", overrides=["max_steps=3"])

Every problem becomes one ``ConfigError`` naming the key path; nothing is dropped silently. This
parses and types only (``roll.configs.build``: keys, types, ranges, inline names; each role's
``strategy_config`` is typed by its ``strategy_name`` as ``StrategyArgs`` is built); what needs the registries, the placement, the algorithm tables or the files
is the pre-launch step's (``roll.launch.checks.check_before_launch``), which the launchers run.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any, TypeVar

import yaml

from roll.configs.build import build_dataclass
from roll.configs.errors import ConfigError, did_you_mean, join_path
from roll.configs.roll_compat import translate_roll_keys

T = TypeVar("T")

# Top-level blocks that alibaba/ROLL files carry for Hydra; they configure nothing here.
IGNORED_TOP_LEVEL = ("hydra", "defaults")

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
