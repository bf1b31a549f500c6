"""Named config values against the tables that implement them.

A field declared ``one_of("grpo", table="roll.pipeline.rlvr.algorithms.advantages:ADV_ESTIMATORS")``
(roll.configs.ranges) allows exactly the keys of that table, so the check can neither fall behind
the code nor allow a name the code refuses. The tables live above configs/ (algorithms, models,
strategies), so the loader leaves these fields to this step:

    check_named_values(config)      # every table-backed field of the whole config, nested ones too
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from typing import Any

from roll.configs.errors import ConfigError, join_path
from roll.configs.ranges import CHOICES_KEY, Choices


def load_table(target: str) -> Any:
    """The object ``"module:NAME"`` names (a dict, whose keys are the names, or a tuple)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def allowed_values(choices: Choices) -> list[Any]:
    """The names a field allows: its table's keys (or items), else its inline values."""
    return list(load_table(choices.table)) if choices.table else list(choices.values)


def refused_reasons(choices: Choices) -> dict[str, str]:
    return load_table(choices.refused) if choices.refused else {}


def check_named_values(config: Any, path: str = "") -> None:
    """Raise one ConfigError for the first table-backed field whose value its table lacks."""
    for key, choices, value in table_fields(config, path):
        if value is None:
            continue
        if problem := choices.violation(value, allowed_values(choices), refused_reasons(choices)):
            raise ConfigError(key, problem)


def table_fields(obj: Any, path: str) -> Iterator[tuple[str, Choices, Any]]:
    """(key path, choices, value) of every table-backed field under dataclass ``obj``, walking
    nested dataclasses, dicts of them (rewards) and each role's typed ``strategy_config``."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = join_path(path, f.name)
        choices = f.metadata.get(CHOICES_KEY)
        if choices is not None and choices.table is not None:
            yield key, choices, value
        yield from _nested(value, key)


def _nested(value: Any, key: str) -> Iterator[tuple[str, Choices, Any]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield from table_fields(value, key)
    elif isinstance(value, dict):
        for name, item in value.items():
            if dataclasses.is_dataclass(item) and not isinstance(item, type):
                yield from table_fields(item, join_path(key, str(name)))
