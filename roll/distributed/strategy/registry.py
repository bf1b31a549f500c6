"""Strategy classes by ``strategy_name``, imported only when used and checked against their Protocols.

>>> strategy_cls = load_strategy_class("hf_infer")   # imports transformers only now, checks the Protocols

The rows live in ``roll.configs.strategies`` (``STRATEGIES``: options class, lazy class path,
capability flags); this module turns a row into its class. Each row names the Protocols of
``base.py`` its class implements: its side's (``TrainStrategy`` or ``InferenceStrategy``) plus
``protocols``. ``check_strategy_class`` checks them against the class's methods (no instance is
made, so vLLM/SGLang classes are checked without the engines) when the class is loaded, and
``tests/test_strategy_protocols.py`` runs it over every row.

Importing a strategy whose engine is missing raises a ConfigError that names the extra to install.
"""

from __future__ import annotations

import functools
import importlib

from roll.configs.errors import ConfigError
from roll.configs.strategies import StrategySpec, get_strategy_spec
from roll.distributed.strategy import base
from roll.distributed.strategy.base import (
    OPTIONAL_PROTOCOLS,
    InferenceStrategy,
    TrainStrategy,
    check_protocol,
)


def required_protocols(spec: StrategySpec) -> tuple[type, ...]:
    """The Protocols of ``base.py`` the row's class must implement: its side's, then ``protocols``."""
    side = TrainStrategy if spec.side == "train" else InferenceStrategy
    return (side, *(getattr(base, name) for name in spec.protocols))


def implements(spec: StrategySpec, protocol: type) -> bool:
    """Whether the row declares ``protocol`` (or a Protocol that extends it), e.g.
    ``implements(spec, ValueModelStrategy)`` for a critic; true of the class once it is loaded."""
    return any(protocol in required.__mro__ for required in required_protocols(spec))


def load_strategy_class(name: str, path: str = "strategy_args.strategy_name") -> type:
    """Import and return the strategy class registered under ``name``, checked against its row's
    Protocols (``check_strategy_class``)."""
    spec = get_strategy_spec(name, path)
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                path,
                f"strategy {name!r} needs the '{module}' package, which is not installed ({exc}); "
                f"install it with: pip install -e .[{spec.extra}]",
            ) from exc
    return check_strategy_class(name)


@functools.cache
def check_strategy_class(name: str) -> type:
    """Import the class of row ``name`` (not its engine) and check that it implements the row's
    Protocols, and declares every optional Protocol it has all the methods of; a TypeError lists
    what differs. Returns the class."""
    spec = get_strategy_spec(name)
    module_name, class_name = spec.target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    problems = [
        f"{protocol.__name__}.{problem}"
        for protocol in required_protocols(spec)
        for problem in check_protocol(cls, protocol)
    ]
    undeclared = [
        p.__name__ for p in OPTIONAL_PROTOCOLS if not implements(spec, p) and not check_protocol(cls, p)
    ]
    if undeclared:
        problems.append(f"implements {undeclared} without declaring them in its row's protocols")
    if problems:
        raise TypeError(f"strategy {name!r} ({spec.target}): " + "; ".join(problems))
    return cls
